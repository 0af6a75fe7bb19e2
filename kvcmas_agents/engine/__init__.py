"""The embedded engine: model runner, paged KV store, prefix cache, scheduler and chat layer."""
from .config import EngineConfig, ReuseOptions, SamplingParams
from .engine import Engine
from .errors import ContextLengthError, EngineClosedError, EngineError, InvalidRequestError, ModelNotFoundError
from .outputs import RequestOutput, StreamDelta, Usage
from .tools import InvalidToolCall, ToolCall

__all__ = [
    "Engine", "EngineConfig", "ReuseOptions", "SamplingParams", "RequestOutput", "StreamDelta", "Usage", "ToolCall",
    "InvalidToolCall", "InvalidRequestError", "ContextLengthError", "EngineError", "EngineClosedError",
    "ModelNotFoundError",
]
