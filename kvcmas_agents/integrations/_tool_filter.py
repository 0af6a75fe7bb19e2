"""Kept for the adapters' imports: the filter lives in the chat layer, where the HTTP gateway can use it too."""
from ..chat.tool_filter import ToolBlockFilter

__all__ = ["ToolBlockFilter"]
