"""``kvcmas bench tool-choice``: tool calls on the default model: the answer-or-call decision (docs/tool_calls.md) and forced calls.

  decide - for 36 requests (18 a tool is meant for, 18 not; 24 tuning, 12 held out), without a system
           prompt and with AutoGen's AssistantAgent default one: free decoding's calls, the score
           log p(<tool_call> | prompt), the decision at --threshold, and the reply's call;
  forced - forced calls: completion tokens, engine steps and seconds per call (jump-forward decoding).

    kvcmas bench tool-choice                 # both; --only decide|forced; --json for raw rows
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Any

from ..engine import Engine, EngineConfig, SamplingParams, ToolDecision

HELP = "the answer-or-call decision on 36 requests, and forced calls' steps and seconds"


def fn(name: str, description: str, **props: str) -> dict[str, Any]:
    types = {"s": "string", "i": "integer", "n": "number"}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {k: {"type": types[v]} for k, v in props.items()}, "required": list(props)}}}


WEATHER = fn("get_weather", "Get the weather at a location.", location="s")
ADD = fn("add", "Add two integers.", a="i", b="i")
MUL = fn("multiply", "Multiply two numbers.", a="n", b="n")
SEARCH = fn("search_web", "Search the web for a query.", query="s")
TIME = fn("get_time", "Get the current time in a city.", city="s")
EMAIL = fn("send_email", "Send an email to a recipient.", to="s", subject="s", body="s")
FX = fn("convert_currency", "Convert an amount from one currency to another.", amount="n", source="s", target="s")
STOCK = fn("get_stock_price", "Get the latest stock price of a company ticker.", ticker="s")
TRANSLATE = fn("translate", "Translate text into a target language.", text="s", language="s")
CALC = fn("calculator", "Evaluate an arithmetic expression.", expression="s")

# (set, tools, user message, the tool it is meant for or None)
CASES = [
    ("tuning", [WEATHER], "What is the weather in San Francisco, CA?", "get_weather"),
    ("tuning", [WEATHER], "Is it raining in London right now?", "get_weather"),
    ("tuning", [ADD], "What is 3 + 4?", "add"),
    ("tuning", [ADD, MUL], "Multiply 6 by 7.", "multiply"),
    ("tuning", [SEARCH], "Search the web for the latest news about Mars rovers.", "search_web"),
    ("tuning", [TIME, WEATHER], "What time is it in Tokyo?", "get_time"),
    ("tuning", [EMAIL], "Send an email to bob@example.com saying the meeting is at 3pm.", "send_email"),
    ("tuning", [FX], "Convert 100 US dollars to euros.", "convert_currency"),
    ("tuning", [STOCK], "What's the stock price of AAPL?", "get_stock_price"),
    ("tuning", [WEATHER, SEARCH], "How hot is it in Cairo today?", "get_weather"),
    ("tuning", [ADD], "Use the add tool to add 12 and 30.", "add"),
    ("tuning", [SEARCH, STOCK], "Look up who won the 2022 World Cup.", "search_web"),
    ("tuning", [WEATHER], "Hi! How are you today?", None),
    ("tuning", [WEATHER], "Write a haiku about the sea.", None),
    ("tuning", [ADD], "What is the capital of France?", None),
    ("tuning", [SEARCH], "Tell me a joke.", None),
    ("tuning", [TIME, WEATHER], "Thank you, that is all.", None),
    ("tuning", [EMAIL], "What does the word 'ephemeral' mean?", None),
    ("tuning", [FX], "Translate 'good morning' into Spanish.", None),
    ("tuning", [STOCK], "Give me three tips for sleeping better.", None),
    ("tuning", [ADD, MUL], "Who wrote Romeo and Juliet?", None),
    ("tuning", [WEATHER, SEARCH], "Say hello.", None),
    ("tuning", [ADD], "What is your name?", None),
    ("tuning", [SEARCH], "Summarize this sentence: The cat sat on the mat.", None),
    ("held_out", [WEATHER], "Will it snow in Denver tomorrow?", "get_weather"),
    ("held_out", [CALC], "Compute 17 * 23.", "calculator"),
    ("held_out", [TRANSLATE], "Translate 'thank you' into German.", "translate"),
    ("held_out", [STOCK, SEARCH], "How much is one Tesla share now?", "get_stock_price"),
    ("held_out", [TIME], "What's the time in Paris?", "get_time"),
    ("held_out", [SEARCH], "Find recent articles about quantum computing.", "search_web"),
    ("held_out", [WEATHER], "Write a short poem about autumn.", None),
    ("held_out", [CALC], "What is the meaning of life?", None),
    ("held_out", [TRANSLATE], "Hello there!", None),
    ("held_out", [STOCK], "Explain what a stock is in one sentence.", None),
    ("held_out", [TIME, WEATHER], "Good night!", None),
    ("held_out", [EMAIL], "List three fruits.", None),
]
AUTOGEN_SYSTEM = ("You are a helpful AI assistant. Solve tasks using your tools. "
                  "Reply with TERMINATE when the task has been completed.")


def decide(engine: Engine, threshold: float, max_tokens: int) -> list[dict[str, Any]]:
    decision, rows = ToolDecision(threshold), []
    sampling = SamplingParams(max_tokens=max_tokens)
    for system in (None, AUTOGEN_SYSTEM):
        for group, tools, user, want in CASES:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
            free = engine.generate_sync(messages, sampling=sampling, tools=tools)
            scored = engine.generate_sync(messages, sampling=decision.scoring(engine.call_open_ids), tools=tools)
            score = decision.score(scored, engine.call_open_ids)
            out = engine.generate_sync(messages, sampling=sampling, tools=tools, tool_decision=decision)
            rows.append({"set": group, "system": bool(system), "user": user, "want": want, "score": round(score, 2),
                         "free_call": bool(free.tool_calls), "calls": decision.calls(score),
                         "got": [(c.name, c.arguments) for c in out.tool_calls], "finish": out.finish_reason,
                         "text": out.content[:60]})
    return rows


def decide_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["set       system   free calls  meant: decided call  right call done  not meant: answered"]
    for group in ("tuning", "held_out"):
        for system in (False, True):
            rs = [r for r in rows if r["set"] == group and r["system"] == system]
            meant, other = [r for r in rs if r["want"]], [r for r in rs if not r["want"]]
            right = sum(bool(r["got"]) and r["got"][0][0] == r["want"] for r in meant)
            lines.append(f"{group:9} {'autogen' if system else 'none':8} {sum(r['free_call'] for r in rs):2}/{len(rs):<8}"
                         f" {sum(r['calls'] for r in meant):2}/{len(meant):<18} {right:2}/{len(meant):<14}"
                         f" {sum(not r['calls'] for r in other):2}/{len(other)}")
    return lines


FORCED = [([ADD], "What is 3 + 4?", "add"), ([WEATHER], "What is the weather in San Francisco, CA?", "get_weather"),
          ([ADD, MUL], "Multiply 6 by 7.", "required"), ([FX], "Convert 100 US dollars to euros.", "convert_currency"),
          ([TIME, WEATHER], "What time is it in Tokyo?", "required"),
          ([SEARCH], "Search the web for the latest news about Mars rovers.", "search_web")]


def forced(engine: Engine, max_tokens: int) -> list[dict[str, Any]]:
    rows = []
    for tools, user, choice in FORCED:
        steps = engine.stats()["counters"]["steps"]
        t0 = time.perf_counter()
        out = engine.generate_sync([{"role": "user", "content": user}], sampling=SamplingParams(max_tokens=max_tokens),
                                   tools=tools, tool_choice=choice)
        rows.append({"tool_choice": choice, "completion_tokens": out.usage.completion_tokens,
                     "steps": engine.stats()["counters"]["steps"] - steps, "s": round(time.perf_counter() - t0, 2),
                     "finish": out.finish_reason, "text": out.text})
    return rows


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", choices=("decide", "forced"))
    parser.add_argument("--threshold", type=float, default=ToolDecision().threshold)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print every row")


def run(args: argparse.Namespace) -> int:
    engine = Engine(EngineConfig(reuse="prefix", num_threads=args.threads))
    try:
        if args.only != "forced":
            rows = decide(engine, args.threshold, args.max_tokens)
            print("\n".join(json.dumps(r) for r in rows) if args.json else "\n".join(decide_table(rows)))
        if args.only != "decide":
            for row in forced(engine, 96):
                print(json.dumps(row))
    finally:
        engine.close()
    return 0
