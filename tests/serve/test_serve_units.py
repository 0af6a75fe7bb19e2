"""The gateway's pure parts, no model: request parsing, naming, error mapping, metrics text."""
from __future__ import annotations

import pytest

from kvcmas_agents.engine import RequestOutput
from kvcmas_agents.engine.outputs import Usage
from kvcmas_agents.errors import ContextLengthError, EngineClosedError, EngineError, InvalidRequestError
from kvcmas_agents.serve.errors import APIError, from_exception
from kvcmas_agents.serve.metrics import Metrics
from kvcmas_agents.serve.naming import agent_name, derived_agent, session_key
from kvcmas_agents.serve.protocol import completion_json, parse_chat_request

MSGS = [{"role": "system", "content": "You plan."}, {"role": "user", "content": "hi"}]


def test_parse_maps_openai_params_to_sampling():
    req = parse_chat_request({"model": "m", "messages": MSGS, "max_completion_tokens": 7, "max_tokens": 99,
                              "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": "END", "stream": True,
                              "stream_options": {"include_usage": True}}, default_max_tokens=16)
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, s.stop) == (7, 0.5, 0.9, 3, ["END"])
    assert req.stream and req.include_usage
    assert parse_chat_request({"messages": MSGS}, 16).sampling.max_tokens == 16
    # tool_choice "none"/"auto" without tools means nothing; "text" response_format is free text
    req = parse_chat_request({"messages": MSGS, "tool_choice": "auto", "response_format": {"type": "text"}}, 16)
    assert req.tool_choice is None and req.sampling.response_format is None
    req = parse_chat_request({"messages": MSGS, "frequency_penalty": -2, "presence_penalty": 1.5,
                              "logit_bias": {"42": -100, "7": 3.5}, "logprobs": True, "top_logprobs": 20,
                              "parallel_tool_calls": False, "user": "john doe", "prompt_cache_key": "k 1",
                              "modalities": ["text"], "store": False, "service_tier": "auto"}, 16)
    s = req.sampling
    assert (s.frequency_penalty, s.presence_penalty, s.logit_bias) == (-2.0, 1.5, {42: -100.0, 7: 3.5})
    assert (s.logprobs, s.top_logprobs, req.parallel_tool_calls, req.user) == (True, 20, False, "john doe")


@pytest.mark.parametrize("extra, param", [
    ({"n": 2}, "n"), ({"max_tokens": -1}, "max_tokens"), ({"temperature": "hot"}, "temperature"),
    ({"stream": "yes"}, "stream"), ({"tools": {}}, "tools"), ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"), ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"logit_bias": {"a": 1}}, "logit_bias"), ({"logit_bias": {"²": 1}}, "logit_bias"), ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"logprobs": "yes"}, "logprobs"), ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"tool_choice": "required"}, "tool_choice"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"), ({"modalities": ["text", "audio"]}, "modalities"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"), ({"functions": []}, "functions"),
    ({"function_call": "auto"}, "function_call"), ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"web_search_options": {}}, "web_search_options"), ({"store": True}, "store"),
    ({"service_tier": "flex"}, "service_tier"), ({"verbosity": "low"}, "verbosity"),
    ({"safety_identifier": "u1"}, "safety_identifier"), ({"min_p": 0.1}, "min_p"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options"),
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls"), ({"user": 5}, "user"),
])
def test_parse_rejects_bad_or_unsupported_params(extra, param):
    with pytest.raises(APIError) as info:
        parse_chat_request({"messages": MSGS, **extra}, 16)
    assert info.value.status == 400 and info.value.param == param, info.value


def test_agent_naming_order_and_stability():
    assert agent_name({"x-kvcmas-agent": "coder"}, "u1", {"agent": "m"}, MSGS) == "coder"
    assert agent_name({}, "u1", {"agent": "m"}, MSGS) == "u1"
    assert agent_name({}, None, {"agent": "m"}, MSGS) == "m"
    derived = agent_name({}, None, {}, MSGS)
    assert derived == derived_agent([{"role": "system", "content": [{"type": "text", "text": "You plan."}]}])
    assert derived.startswith("sys-") and derived != derived_agent([{"role": "system", "content": "You code."}])
    assert derived_agent([{"role": "user", "content": "hi"}]) == "default"
    with pytest.raises(APIError):
        agent_name({"x-kvcmas-agent": "bad name with spaces"}, None, {}, MSGS)
    # OpenAI's user is any string: never rejected, one valid name per user
    for user in ("john doe", "a+b@x.com", "é" * 200, "!!!"):
        name = agent_name({}, user, {}, MSGS)
        assert name == agent_name({}, user, {}, MSGS) and agent_name({"x-kvcmas-agent": name}, None, {}, MSGS)
    assert agent_name({}, "john doe", {}, MSGS) != agent_name({}, "john  doe", {}, MSGS)
    assert agent_name({}, "john doe", {}, MSGS).startswith("john-doe-")
    assert session_key({}, {}, "cache key") == session_key({}, {}, "cache key") != session_key({}, {}, "other")
    assert session_key({"x-kvcmas-session": "s1"}, {"session": "s2"}) == "s1"
    assert session_key({}, {"session": "s2"}) == "s2" and session_key({}, {}) is None


def test_engine_errors_map_to_statuses():
    assert (from_exception(ContextLengthError("x")).code, from_exception(ContextLengthError("x")).status) == \
        ("context_length_exceeded", 400)
    assert from_exception(InvalidRequestError("messages[1] has unknown role")).param == "messages"
    assert from_exception(EngineClosedError("closed")).status == 503
    assert from_exception(EngineError("boom")).status == 500
    assert from_exception(RuntimeError("?")).status == 500


def test_completion_json_usage_and_tool_calls():
    from kvcmas_agents.chat.tools import ToolCall
    out = RequestOutput(request_id="r", agent="coder", text="", token_ids=[1], finish_reason="tool_calls",
                        ttft_s=0.1, latency_s=0.2, reuse="kvcmas",
                        usage=Usage(prompt_tokens=100, completion_tokens=5, cached_tokens=10, reused_tokens=60,
                                    recomputed_tokens=15, kept_tokens=55),
                        tool_calls=[ToolCall("call_1", "f", {"a": 1})])
    body = completion_json("chatcmpl-x", "m", out)
    msg, usage = body["choices"][0]["message"], body["usage"]
    assert msg["content"] is None and msg["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert usage["prompt_tokens_details"]["cached_tokens"] == 55
    assert usage["kvcmas"]["reused_tokens"] == 60 and usage["kvcmas"]["recomputed_tokens"] == 15


def test_metrics_histogram_is_cumulative_and_replicas_sum():
    m = Metrics()
    for ttft in (0.02, 0.3, 50.0):
        m.finished(RequestOutput(request_id="r", agent="a", text="", token_ids=[], finish_reason="stop",
                                 ttft_s=ttft, latency_s=ttft, usage=Usage(prompt_tokens=3, reused_tokens=1)))
    text = m.render({"replicas": [{"memory": {"kv_bytes": 10}}, {"memory": {"kv_bytes": 5}}]})
    assert 'kvcmas_ttft_seconds_bucket{le="0.025"} 1' in text and 'kvcmas_ttft_seconds_bucket{le="0.5"} 2' in text
    assert 'kvcmas_ttft_seconds_bucket{le="+Inf"} 3' in text and "kvcmas_ttft_seconds_count 3" in text
    assert "kvcmas_kv_bytes 15" in text and "kvcmas_reuse_requests_total 3" in text
    assert 'kvcmas_tokens_total{kind="prompt"} 9' in text


def test_serve_command_options(monkeypatch):
    from kvcmas_agents.cli import build_parser
    from kvcmas_agents.serve.cli import serve_config

    monkeypatch.setenv("KVCMAS_API_KEY", "from-env")
    args = build_parser().parse_args(["serve", "--port", "9001", "--max-body-mib", "1"])
    cfg = serve_config(args)
    assert (cfg.host, cfg.port, cfg.api_key, cfg.max_body_bytes) == ("127.0.0.1", 9001, "from-env", 1024 ** 2)
    assert args.reuse == "kvcmas"
    assert serve_config(build_parser().parse_args(["serve", "--api-key", "k"])).api_key == "k"
    monkeypatch.delenv("KVCMAS_API_KEY")
    assert serve_config(build_parser().parse_args(["serve"])).api_key is None


def test_logprobs_json_floors_minus_infinity_and_parallel_tool_calls_false_keeps_one_call():
    from kvcmas_agents.chat.tools import ToolCall
    from kvcmas_agents.engine.logprobs import Logprob, TopLogprob
    from kvcmas_agents.serve.protocol import logprobs_json

    entry = Logprob(5, "a", -0.5, [97], [TopLogprob(5, "a", -0.5, [97]), TopLogprob(6, "b", float("-inf"), [98])])
    body = logprobs_json([entry])
    assert body["content"][0]["top_logprobs"][1]["logprob"] == -9999.0 and body["content"][0]["bytes"] == [97]
    out = RequestOutput(request_id="r", agent="a", text="", token_ids=[1], finish_reason="tool_calls", ttft_s=0,
                        latency_s=0, usage=Usage(), tool_calls=[ToolCall("c1", "f", {}), ToolCall("c2", "g", {})])
    assert len(completion_json("x", "m", out)["choices"][0]["message"]["tool_calls"]) == 2
    assert [c["id"] for c in completion_json("x", "m", out, False)["choices"][0]["message"]["tool_calls"]] == ["c1"]


def test_model_ids_and_aliases():
    from kvcmas_agents.serve.models import check_model, model_ids

    ids = model_ids("served", "smollm2-135m-instruct", ("gpt-4o-mini",))
    assert ids == ("served", "smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", "gpt-4o-mini")
    assert model_ids("ckpt", "ckpt") == ("ckpt",)
    for name in ids:
        check_model(name, ids)
    with pytest.raises(APIError) as info:
        check_model("gpt-4o", ids)
    assert (info.value.status, info.value.code) == (404, "model_not_found")
    with pytest.raises(APIError) as info:
        check_model(None, ids)
    assert info.value.status == 400 and info.value.param == "model"
