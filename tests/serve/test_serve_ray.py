"""``kvcmas serve --replicas 2`` end to end: the HTTP gateway over RayBackend on a local Ray cluster
(2 CPU replicas of the default model), workflows routed by the X-KVCMAS-Session header."""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest

ray = pytest.importorskip("ray")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from kvcmas_agents.cli import build_parser  # noqa: E402
from kvcmas_agents.errors import ReplicaUnavailableError  # noqa: E402
from kvcmas_agents.serve.app import create_app  # noqa: E402
from kvcmas_agents.serve.cli import build_backend, serve_config  # noqa: E402
from kvcmas_agents.serve.errors import from_exception  # noqa: E402
from kvcmas_agents.serve.naming import AGENT_HEADER, SESSION_HEADER  # noqa: E402
from kvcmas_agents.serve.ray_backend import RayBackend  # noqa: E402

pytestmark = pytest.mark.timeout(300)
TASK = "Write a Python function that merges overlapping intervals, with tests."
AGENTS = ("planner", "coder", "reviewer")


@pytest.fixture(scope="module")
def gateway():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    args = build_parser().parse_args(["serve", "--replicas", "2", "--device", "cpu", "--kv-budget-mib", "256",
                                      "--default-max-tokens", "6", "--port", "0"])
    backend = build_backend(args)
    assert isinstance(backend, RayBackend) and len(backend.replica_info) == 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(backend, serve_config(args)), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, name="gateway-ray", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the gateway did not start"
        time.sleep(0.05)
    yield backend, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
    server.should_exit = True
    thread.join(timeout=60)
    assert backend._closed, "the app's shutdown closes the replicas"
    ray.shutdown()


def turn(client: httpx.Client, session: str, agent: str, history: list[dict], stream: bool = False) -> str:
    messages = [{"role": "system", "content": f"You are the {agent}."}, *history]
    headers = {SESSION_HEADER: session, AGENT_HEADER: f"{session}-{agent}"}
    body = {"model": "smollm2-135m-instruct", "messages": messages, "max_tokens": 6, "stream": stream}
    r = client.post("/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    if stream:
        assert r.text.rstrip().endswith("data: [DONE]")
        return "streamed"
    return r.json()["choices"][0]["message"]["content"]


def test_sessions_stick_to_replicas_through_http_and_share_kv_there(gateway):
    backend, client = gateway
    for session in ("http-a", "http-b"):
        history = [{"role": "user", "content": TASK}]
        for i, agent in enumerate(AGENTS):
            text = turn(client, session, agent, history, stream=(i == 2))
            history.append({"role": "assistant", "content": text})
    ra, rb = backend.replica_of("http-a"), backend.replica_of("http-b")
    assert {ra, rb} == {0, 1}
    stats = client.get("/v1/kvcmas/stats").json()
    assert stats["alive"] == 2 and len(stats["replicas"]) == 2
    for session, replica in (("http-a", ra), ("http-b", rb)):
        agents = stats["replicas"][replica]["agents"]
        assert all(agents[f"{session}-{a}"]["requests"] == 1 for a in AGENTS)
        assert agents[f"{session}-reviewer"]["reused_tokens"] > 0            # cross-agent reuse held
        assert not any(name.startswith(session) for name in stats["replicas"][1 - replica]["agents"])
    metrics = client.get("/metrics").text
    assert "kvcmas_engine_requests_total 6" in metrics                         # summed over replicas


def test_a_replica_killed_mid_stream_ends_it_with_a_503_event_its_session_moves_and_it_is_replaced(gateway):
    backend, client = gateway
    dead = backend.replica_of("http-a")
    body = {"model": "smollm2-135m-instruct", "stream": True, "max_tokens": 400,
            "messages": [{"role": "system", "content": "You are the coder."}, {"role": "user", "content": TASK}]}
    headers = {SESSION_HEADER: "http-a", AGENT_HEADER: "http-a-long"}
    with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert '"choices"' in first
        ray.kill(backend.actor(dead))
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][len("data: "):])["error"]
    assert error["code"] == "replica_unavailable" and f"replica {dead}" in error["message"]
    history = [{"role": "user", "content": TASK}]
    turn(client, "http-a", "planner", history)                    # the session's next request
    assert backend.replica_of("http-a") == 1 - dead
    stats = client.get("/v1/kvcmas/stats").json()                # the fresh replica loading, or up
    assert (stats["alive"], stats["replacing"], stats["replaced"]) in ((1, 1, 0), (2, 0, 1))
    assert stats["replicas"][dead]["state"] in ("replacing", "alive")


def test_replica_unavailable_is_a_503():
    err = from_exception(ReplicaUnavailableError("engine replica 1 failed"))
    assert err.status == 503 and err.code == "replica_unavailable"
    assert err.body()["error"]["type"] == "service_unavailable"


def test_the_scale_out_options():
    args = build_parser().parse_args(["serve", "--replicas", "3", "--ray-address", "auto", "--cpus-per-replica", "0.5"])
    assert (args.replicas, args.ray_address, args.cpus_per_replica) == (3, "auto", 0.5)
    plain = build_parser().parse_args(["serve"])
    assert (plain.replicas, plain.ray_address) == (1, None)          # one engine in-process, no Ray
    with pytest.raises(SystemExit, match="--replicas must be >= 1"):
        build_backend(build_parser().parse_args(["serve", "--replicas", "0"]))
