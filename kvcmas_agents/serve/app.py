"""The FastAPI app: OpenAI-compatible chat completions plus kvcmas endpoints, over any ``Backend``."""
from __future__ import annotations

import hmac
import json
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import EngineError, RequestOutput
from .backend import Backend
from .config import ServeConfig
from .errors import APIError, from_exception
from .metrics import CONTENT_TYPE, Metrics
from .models import check_model, model_ids
from .naming import AGENT_HEADER, SESSION_HEADER, agent_name, session_key
from .protocol import completion_json, new_completion_id, parse_chat_request, tool_names
from .streaming import ClientGone, SSEResponse, aclose, sse_chunks, until_disconnect


def _outcome(status: int) -> str:
    return "client_error" if status < 500 else "server_error"


async def read_json(request: Request, limit: int) -> Any:
    """The decoded body; 413 past ``limit`` bytes (checked on the declared length, then while reading)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is {declared} bytes; the limit is {limit}", None, "request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes", None, "request_too_large")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", None, "invalid_json") from exc


def create_app(backend: Backend, config: ServeConfig | None = None, *, close_backend: bool = True) -> FastAPI:
    """The gateway over ``backend``. With ``close_backend`` the app's shutdown closes it, after uvicorn
    has drained the requests in flight."""
    config = config or ServeConfig()
    metrics = Metrics()
    model_name = config.model_name or backend.model_name
    served_ids = model_ids(model_name, backend.model_name, config.model_aliases)
    prompt_limit = min(config.max_prompt_tokens or backend.max_context, backend.max_context)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if close_backend:
            await backend.aclose()

    app = FastAPI(title="kvcmas gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.backend, app.state.config, app.state.metrics = backend, config, metrics

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail), None, None).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return APIError(400, str(exc), None, "invalid_request").response()

    def require_key(request: Request) -> None:
        if config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)", None,
                           "invalid_api_key")

    auth = [Depends(require_key)]

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": model_name}

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(model_name, backend.max_context)]}

    @app.get("/v1/models/{model_id:path}", dependencies=auth)
    async def model(model_id: str) -> dict:
        check_model(model_id, served_ids)
        return _model_card(model_name, backend.max_context)

    @app.get("/metrics", dependencies=auth)
    async def prometheus() -> Response:
        try:
            stats = await backend.stats()
        except Exception:          # the gateway's own figures are still worth scraping
            stats = None
        return PlainTextResponse(metrics.render(stats), media_type=CONTENT_TYPE)

    @app.get("/v1/kvcmas/stats", dependencies=auth)
    async def stats() -> JSONResponse:
        return JSONResponse(jsonable_encoder(await backend.stats()))

    @app.post("/v1/kvcmas/edges", dependencies=auth)
    async def edges(request: Request) -> dict:
        body = await read_json(request, config.max_body_bytes)
        pairs = body.get("edges") if isinstance(body, dict) else None
        if not isinstance(pairs, list) or not all(
                isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(a, str) and a for a in p)
                for p in pairs):
            raise APIError(400, 'edges must be an array of [predecessor, successor] agent-name pairs',
                           "edges", "invalid_value")
        session = session_key(request.headers, {"session": body.get("session")})
        try:
            await backend.set_edges([tuple(p) for p in pairs], session=session)
        except Exception as exc:
            raise from_exception(exc) from exc
        return {"edges": pairs, "session": session}

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request) -> Response:
        metrics.in_flight += 1
        streaming = False
        try:
            response = await _chat(request)
            streaming = isinstance(response, SSEResponse)
            return response
        except ClientGone:
            metrics.outcome("cancelled")
            return Response(status_code=499)
        except Exception as exc:
            err = from_exception(exc)
            metrics.outcome(_outcome(err.status))
            return err.response()
        finally:
            if not streaming:
                metrics.in_flight -= 1

    async def _chat(request: Request) -> Response:
        req = parse_chat_request(await read_json(request, config.max_body_bytes), config.default_max_tokens)
        check_model(req.model, served_ids)
        agent = agent_name(request.headers, req.user, req.metadata, req.messages)
        session = session_key(request.headers, req.metadata, req.prompt_cache_key)
        if prompt_limit < backend.max_context:
            n = await backend.count_tokens(req.messages, req.tools)
            if n > prompt_limit:
                raise APIError(400, f"prompt is {n} tokens; this server accepts at most {prompt_limit}",
                               "messages", "context_length_exceeded")
        cid = new_completion_id()
        stream = backend.stream(req.messages, agent=agent, sampling=req.sampling, tools=req.tools,
                                tool_choice=req.tool_choice, session=session, request_id=cid)
        headers = {AGENT_HEADER: agent, **({SESSION_HEADER: session} if session else {})}
        # The first delta comes after validation and prefill: errors up to here get a proper status.
        try:
            first = await until_disconnect(request, anext(stream), config.disconnect_poll_s)
            if not req.stream:
                output = first.output or await until_disconnect(request, _rest(stream), config.disconnect_poll_s)
        except BaseException:
            await aclose(stream)
            raise
        if not req.stream:
            await aclose(stream)
            metrics.finished(output)
            metrics.outcome("ok")
            return JSONResponse(completion_json(cid, model_name, output, req.parallel_tool_calls), headers=headers)

        settled = False

        def settle(outcome: str, output: RequestOutput | None = None) -> None:
            nonlocal settled
            if settled:
                return
            settled = True
            if output is not None:
                metrics.finished(output)
            metrics.outcome(outcome)
            metrics.in_flight -= 1

        body = sse_chunks(first, stream, cid=cid, model=model_name, created=int(time.time()),
                          tool_names=tool_names(req.tools), include_usage=req.include_usage,
                          on_output=lambda out: settle("ok", out),
                          on_error=lambda status: settle(_outcome(status)),
                          max_tool_calls=None if req.parallel_tool_calls else 1)
        response = SSEResponse(body, on_close=lambda: settle("cancelled"))
        response.headers.update(headers)
        return response

    return app


async def _rest(stream: AsyncIterator) -> RequestOutput:
    async for delta in stream:
        if delta.output is not None:
            return delta.output
    raise EngineError("the engine stream ended without an output")


def _model_card(name: str, max_context: int) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "kvcmas", "max_model_len": max_context}
