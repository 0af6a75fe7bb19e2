"""Errors the engine raises to callers."""
from __future__ import annotations


class InvalidRequestError(ValueError):
    """The request is malformed; raised before any work is done."""


class ContextLengthError(InvalidRequestError):
    """The prompt does not fit the model's context window."""


class EngineError(RuntimeError):
    """The engine failed while serving a request; other requests are unaffected."""


class EngineClosedError(EngineError):
    """The engine was closed before or while the request ran."""


class RequestTimeoutError(EngineError, TimeoutError):
    """A synchronous request did not finish within its timeout; it was aborted and its KV freed."""


class ConfigError(ValueError):
    """An EngineConfig value is invalid, or the engine cannot be built with it (e.g. a corrupt model file)."""


class ModelNotFoundError(FileNotFoundError):
    """The requested model is not installed locally; the message says what to install."""


class ReplicaUnavailableError(EngineError):
    """The engine replica serving the request died (or none is alive); a retry is routed to a live one."""
