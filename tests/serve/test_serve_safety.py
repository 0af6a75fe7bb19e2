"""What makes the gateway safe to expose: auth, limits, 4xx for bad input, disconnects freeing KV, metrics."""
from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from serve_gateway import API_KEY, MAX_BODY_BYTES, MAX_PROMPT_TOKENS, MODEL  # type: ignore[import-not-found]

CHAT = "/v1/chat/completions"


def hello(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4, **extra}


def request_blocks(stats: dict) -> int:
    """KV blocks referenced by requests (in use minus those home views hold)."""
    m = stats["memory"]
    return m["blocks_in_use"] - m["home_view_bytes"] // m["block_bytes"]


def wait_for(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_health_needs_no_key_but_the_api_does(gateway):
    with httpx.Client(base_url=gateway.url, timeout=30) as anon:
        assert anon.get("/health").json()["status"] == "ok"
        for path in ("/v1/models", "/metrics", "/v1/kvcmas/stats"):
            r = anon.get(path)
            assert r.status_code == 401, path
        r = anon.post(CHAT, json=hello(), headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        err = r.json()["error"]
        assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"


def test_body_over_the_limit_is_413(gateway):
    big = hello()
    big["messages"][0]["content"] = "x" * (MAX_BODY_BYTES + 10)
    with gateway.client() as c:
        r = c.post(CHAT, json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_prompt_over_the_limit_is_400_context_length_exceeded(gateway):
    long = hello()
    long["messages"][0]["content"] = "word " * (MAX_PROMPT_TOKENS + 50)
    with gateway.client() as c:
        r = c.post(CHAT, json=long)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "messages"


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": [{"role": "user"}]}, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": 5}, "stop"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "yaml"}},
     "response_format"),
])
def test_malformed_requests_are_400_in_openai_format(gateway, body, param):
    with gateway.client() as c:
        r = c.post(CHAT, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and err["message"]


def test_invalid_json_and_unknown_route(gateway):
    with gateway.client() as c:
        r = c.post(CHAT, content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        assert c.get("/v1/nothing").status_code == 404


def test_disconnect_mid_stream_aborts_and_frees_the_kv(gateway):
    before = gateway.stats()
    assert before["counters"]["num_running"] == 0
    body = hello(max_tokens=300, stream=True, temperature=0)
    body["messages"][0]["content"] = "Write a very long story about a lighthouse keeper."
    with gateway.client() as c, c.stream("POST", CHAT, json=body) as r:
        assert r.status_code == 200
        got = []
        for line in r.iter_lines():            # read a few tokens, then hang up
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                got.append(line)
                if len(got) == 3:
                    break
    assert len(got) == 3
    assert wait_for(lambda: gateway.stats()["counters"]["aborted"] == before["counters"]["aborted"] + 1)
    after = gateway.stats()
    assert after["counters"]["num_running"] == 0
    assert request_blocks(after) == request_blocks(before) == 0
    assert after["counters"]["completion_tokens"] == before["counters"]["completion_tokens"]


def test_disconnect_mid_request_aborts_a_non_streaming_request(gateway):
    before = gateway.stats()["counters"]["aborted"]
    body = hello(max_tokens=400, temperature=0)
    body["messages"][0]["content"] = "Write a very long essay about tides."
    with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=httpx.Timeout(3.0)) as c, pytest.raises(httpx.ReadTimeout):
        c.post(CHAT, json=body)
    assert wait_for(lambda: gateway.stats()["counters"]["aborted"] == before + 1)
    stats = gateway.stats()
    assert stats["counters"]["num_running"] == 0 and request_blocks(stats) == 0


def parse_prometheus(text: str) -> dict[str, float]:
    """``name{labels}`` -> value; raises on a line that is not a comment or a sample."""
    sample = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-zA-Z_]+="[^"]*"(?:,[a-zA-Z_]+="[^"]*")*\})? (\S+)$')
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        m = sample.match(line)
        assert m, f"not a Prometheus sample: {line!r}"
        out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def test_metrics_parse_and_count_requests(gateway):
    ok, bad = 'kvcmas_http_requests_total{endpoint="chat",outcome="ok"}', \
        'kvcmas_http_requests_total{endpoint="chat",outcome="client_error"}'
    with gateway.client() as c:
        first = parse_prometheus(c.get("/metrics").text)
        r = c.post(CHAT, json=hello(user="metrics-probe"), headers={"X-KVCMAS-Session": "s-1"})
        assert r.status_code == 200
        assert (r.headers["x-kvcmas-agent"], r.headers["x-kvcmas-session"]) == ("metrics-probe", "s-1")
        assert gateway.stats()["agents"]["metrics-probe"]["requests"] >= 1
        assert c.post(CHAT, json=hello(n=3)).status_code == 400
        r = c.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    m = parse_prometheus(r.text)
    assert m[ok] == first[ok] + 1 and m[bad] == first[bad] + 1
    assert m['kvcmas_tokens_total{kind="completion"}'] > first['kvcmas_tokens_total{kind="completion"}']
    assert m['kvcmas_ttft_seconds_bucket{le="+Inf"}'] == m["kvcmas_ttft_seconds_count"] == first[
        "kvcmas_ttft_seconds_count"] + 1
    assert m["kvcmas_kv_bytes"] > 0 and m["kvcmas_kv_budget_bytes"] == gateway.engine.config.kv_budget_bytes
    assert m["kvcmas_http_requests_in_flight"] == 0
