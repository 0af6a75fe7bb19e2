"""``kvcmas serve``: an OpenAI-compatible HTTP gateway over one engine, or over engine replicas on Ray.

``create_app`` (in ``serve.app``) needs FastAPI; import it from there, so that the backend seam imports
without the serve extra.
"""
from .backend import Backend, LocalBackend
from .config import ServeConfig

__all__ = ["Backend", "LocalBackend", "ServeConfig"]
