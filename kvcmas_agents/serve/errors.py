"""OpenAI-format errors: ``{"error": {"message", "type", "param", "code"}}`` with the matching status."""
from __future__ import annotations

import re
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from ..errors import ContextLengthError, EngineClosedError, EngineError, InvalidRequestError, ReplicaUnavailableError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 500: "server_error", 503: "service_unavailable"}
_PARAMS = ("messages", "tools", "tool_choice", "response_format", "max_tokens", "temperature", "top_p", "top_k",
           "seed", "stop", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "top_logprobs")


@dataclass
class APIError(Exception):
    """An HTTP error the gateway answers in OpenAI's format."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def from_exception(exc: BaseException) -> APIError:
    """The API error for an exception the backend raised (4xx for the caller's mistakes, 5xx for ours)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextLengthError):
        return APIError(400, str(exc), "messages", "context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        message = str(exc)
        # The engine's messages name the parameter at fault first (e.g. "messages[2] has unknown role").
        found = [(m.start(), p) for p in _PARAMS if (m := re.search(rf"\b{p}\b", message))]
        param = min(found)[1] if found else None
        return APIError(400, message, param, "invalid_request")
    if isinstance(exc, ReplicaUnavailableError):      # a replica died; a retry goes to a live one
        return APIError(503, f"engine replica unavailable: {exc}", None, "replica_unavailable")
    if isinstance(exc, EngineClosedError):
        return APIError(503, f"the engine is shutting down: {exc}", None, "engine_closed")
    if isinstance(exc, EngineError):
        return APIError(500, f"engine error: {exc}", None, "engine_error")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", None, "internal_error")
