"""kvcmas-agents: one embedded LLM engine for multi-agent LangGraph and AutoGen workflows."""
from .engine import (
    ContextLengthError, Engine, EngineClosedError, EngineConfig, EngineError, InvalidRequestError,
    ModelNotFoundError, RequestOutput, SamplingParams, StreamDelta, Usage,
)

__version__ = "0.1.0"
__all__ = [
    "Engine", "EngineConfig", "SamplingParams", "RequestOutput", "StreamDelta", "Usage",
    "InvalidRequestError", "ContextLengthError", "EngineError", "EngineClosedError", "ModelNotFoundError",
]
