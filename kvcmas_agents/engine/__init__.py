"""The embedded engine: public API, worker loop, scheduler, requests and outputs."""
from ..chat.tools import InvalidToolCall, ToolCall
from ..errors import (ConfigError, ContextLengthError, EngineClosedError, EngineError, InvalidRequestError,
                      ModelNotFoundError, RequestTimeoutError)
from .config import EngineConfig, KVCMASConfig, ReuseOptions, SamplingParams, StorageSpec
from .engine import Engine
from .outputs import RequestOutput, StreamDelta, Usage
from .tool_decision import ToolDecision

__all__ = [
    "Engine", "EngineConfig", "KVCMASConfig", "StorageSpec", "ReuseOptions", "SamplingParams", "RequestOutput",
    "StreamDelta", "Usage", "ToolDecision", "ToolCall", "InvalidToolCall", "InvalidRequestError", "ContextLengthError",
    "EngineError", "EngineClosedError", "ModelNotFoundError", "ConfigError", "RequestTimeoutError",
]
