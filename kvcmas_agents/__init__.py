"""kvcmas-agents: one embedded LLM engine for multi-agent LangGraph and AutoGen workflows."""
from .engine import (
    ConfigError, ContextLengthError, Engine, EngineClosedError, EngineConfig, EngineError, InvalidRequestError, KVCMASConfig,
    ModelNotFoundError, RequestOutput, RequestTimeoutError, ReuseOptions, SamplingParams, StorageSpec, StreamDelta,
    ToolDecision, Usage,
)

__version__ = "0.1.0"

# Framework adapters load on first use, so importing kvcmas_agents needs no framework installed.
_LAZY_INTEGRATIONS = ("KVCMASClient", "register_team", "ChatKVCMAS", "register_graph")
__all__ = [
    "Engine", "EngineConfig", "KVCMASConfig", "StorageSpec", "ReuseOptions", "SamplingParams", "RequestOutput",
    "StreamDelta", "Usage", "ToolDecision",
    "InvalidRequestError", "ContextLengthError", "EngineError", "EngineClosedError", "ModelNotFoundError",
    "ConfigError", "RequestTimeoutError", *_LAZY_INTEGRATIONS,
]


def __getattr__(name: str) -> object:
    if name in _LAZY_INTEGRATIONS:
        from . import integrations
        return getattr(integrations, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
