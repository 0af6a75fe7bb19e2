"""``kvcmas serve``: an OpenAI-compatible HTTP gateway over one engine, or over engine replicas on Ray."""
from .backend import Backend, LocalBackend

__all__ = ["Backend", "LocalBackend"]
