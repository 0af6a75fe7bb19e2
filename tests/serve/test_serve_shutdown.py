"""Graceful shutdown on its own gateway and engine: requests in flight finish, then the backend closes;
a closed engine answers 503 without taking the server down."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

uvicorn = pytest.importorskip("uvicorn")
from fastapi.testclient import TestClient  # noqa: E402

from serve_gateway import MODEL, free_port  # type: ignore[import-not-found]  # noqa: E402
from kvcmas_agents import Engine, EngineConfig  # noqa: E402
from kvcmas_agents.serve import LocalBackend, ServeConfig  # noqa: E402
from kvcmas_agents.serve.app import create_app  # noqa: E402

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 12,
        "temperature": 0}


def test_shutdown_drains_in_flight_requests_then_closes_the_backend():
    engine = Engine(EngineConfig(reuse="prefix"))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(LocalBackend(engine), ServeConfig()), host="127.0.0.1",
                                           port=port, log_level="warning", timeout_graceful_shutdown=120))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    got: dict = {}
    caller = threading.Thread(target=lambda: got.update(
        r=httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=BODY, timeout=120)))
    caller.start()
    deadline = time.monotonic() + 60
    while engine.stats()["counters"]["num_running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    server.should_exit = True           # what SIGINT/SIGTERM do
    caller.join(timeout=120)
    thread.join(timeout=120)
    r = got["r"]
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
    assert engine._closed and not thread.is_alive()

    # An engine that is gone: 503 in OpenAI's format; the app keeps answering.
    with TestClient(create_app(LocalBackend(engine), close_backend=False)) as client:
        r = client.post("/v1/chat/completions", json=BODY)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_closed"
        assert client.get("/health").status_code == 200
