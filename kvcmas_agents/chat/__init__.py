"""The chat layer: rendering messages with the model's template and splitting the prompt into
segments, the tool-call format, and incremental detokenization."""
from .template import ChatFormatter, RenderedPrompt, Segment
from .tools import InvalidToolCall, ToolCall, parse_tool_calls

__all__ = ["ChatFormatter", "InvalidToolCall", "RenderedPrompt", "Segment", "ToolCall", "parse_tool_calls"]
