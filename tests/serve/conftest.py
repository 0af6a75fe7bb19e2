"""One live gateway for the serve tests: uvicorn in a background thread on a free port, over one
default-model engine running kvcmas (the gateway's default reuse mode)."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import httpx
import pytest

uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from kvcmas_agents import Engine, EngineConfig  # noqa: E402
from kvcmas_agents.registry import ADAPTER_REUSE  # noqa: E402
from kvcmas_agents.serve import LocalBackend, ServeConfig  # noqa: E402
from kvcmas_agents.serve.app import create_app  # noqa: E402

from serve_gateway import API_KEY, MAX_BODY_BYTES, MAX_PROMPT_TOKENS, free_port  # noqa: E402


@dataclass
class Gateway:
    url: str            # http://127.0.0.1:PORT
    engine: Engine
    app: object

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)

    def stats(self) -> dict:
        with self.client() as c:
            r = c.get("/v1/kvcmas/stats")
            r.raise_for_status()
            return r.json()


@pytest.fixture(scope="session")
def gateway():
    engine = Engine(EngineConfig(reuse=ADAPTER_REUSE))
    config = ServeConfig(api_key=API_KEY, max_body_bytes=MAX_BODY_BYTES, max_prompt_tokens=MAX_PROMPT_TOKENS,
                         default_max_tokens=16)
    app = create_app(LocalBackend(engine), config)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the gateway did not start")
        time.sleep(0.05)
    yield Gateway(f"http://127.0.0.1:{port}", engine, app)
    server.should_exit = True
    thread.join(timeout=60)
    assert engine._closed, "the app's shutdown closes the backend"
