"""Engine failures over HTTP: a backend over the real engine that fails on purpose, before the first token
(500 in OpenAI's format) or mid-stream (an SSE error event, then [DONE]); the app keeps serving."""
from __future__ import annotations

import json

from fastapi.testclient import TestClient

from kvcmas_agents.errors import EngineError
from kvcmas_agents.serve import LocalBackend
from kvcmas_agents.serve.app import create_app

from serve_gateway import MODEL  # type: ignore[import-not-found]

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 6,
        "temperature": 0}


class FailingBackend(LocalBackend):
    """The real engine, but requests of agent "fail-now" fail at once and "fail-later" after one delta."""

    def stream(self, messages, *, agent, **kw):
        async def run():
            if agent == "fail-now":
                raise EngineError("injected failure")
            async for delta in super(FailingBackend, self).stream(messages, agent=agent, **kw):
                yield delta
                if agent == "fail-later":
                    raise EngineError("injected failure mid-stream")
        return run()


def test_engine_errors_become_500_and_error_events(gateway):
    before = gateway.stats()["counters"]
    with TestClient(create_app(FailingBackend(gateway.engine), close_backend=False)) as client:
        r = client.post("/v1/chat/completions", json={**BODY, "user": "fail-now"})
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
        r = client.post("/v1/chat/completions", json={**BODY, "user": "fail-later", "stream": True})
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert r.status_code == 200 and events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_error" and "mid-stream" in error["message"]
        assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"
        r = client.post("/v1/chat/completions", json=BODY)        # still serving
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        metrics = client.get("/metrics").text
    assert 'kvcmas_http_requests_total{endpoint="chat",outcome="server_error"} 2' in metrics
    assert "kvcmas_http_requests_in_flight 0" in metrics
    after = gateway.stats()["counters"]
    assert after["aborted"] == before["aborted"] + 1 and after["num_running"] == 0   # the mid-stream one
