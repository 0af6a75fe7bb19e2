"""Run one multi-agent workflow on one engine and print its figures as JSON (``kvcmas peers``' worker).

Standalone: only the standard library at import, so a peer's own virtualenv runs this file by path
(``.venv-vllm/bin/python driver.py vllm trace.json``). Each engine runs in its own process, so peak
memory is its own (the process and its children, sampled from /proc).

The workflow: agents with their own system prompts take turns over one growing history; each turn
decodes exactly ``reply_tokens`` greedy tokens (end of turn suppressed) and its text joins the history
as ``"<agent>: <reply>"``. Timed from the first turn (the model is loaded and warmed up before).
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any, Callable, Iterator


class MemorySampler:
    """Peak resident memory (bytes) of this process and its descendants, sampled every ``interval`` s."""

    def __init__(self, interval: float = 0.05):
        self.peak, self._stop, self.interval = 0, threading.Event(), interval
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "MemorySampler":
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        self.peak = max(self.peak, sum(_rss(p) for p in _tree(os.getpid())))


def _tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# A chat engine: (agent, messages, reply_tokens) -> an iterator of text pieces, the first piece when
# the first token is out.
Chat = Callable[[str, list, int], Iterator[str]]


def run_workflow(chat: Chat, trace: dict) -> dict:
    """Play the trace through ``chat``: wall time, per-turn TTFT and decode rate."""
    history = [{"role": "user", "content": trace["task"]}]
    turns = []
    t_start = time.perf_counter()
    for _ in range(trace["rounds"]):
        for agent, system in trace["agents"]:
            messages = [{"role": "system", "content": system}] + history
            t0 = time.perf_counter()
            first, pieces = None, []
            for piece in chat(agent, messages, trace["reply_tokens"]):
                if first is None:
                    first = time.perf_counter()
                pieces.append(piece)
            end = time.perf_counter()
            reply = "".join(pieces)
            turns.append({"agent": agent, "s": end - t0, "ttft_s": (first or end) - t0,
                          "decode_s": end - (first or end)})
            history.append({"role": "user", "content": f"{agent}: {reply}"})
    wall = time.perf_counter() - t_start
    later = [t["ttft_s"] for t in turns[1:]]
    decode_s = sum(t["decode_s"] for t in turns)
    after_first = (trace["reply_tokens"] - 1) * len(turns)
    return {"wall_s": wall, "turns": turns, "later_ttft_s": sum(later) / max(len(later), 1),
            "decode_tok_s": after_first / decode_s if decode_s > 0 else None}


SOLO = [{"role": "user", "content": "Write a long story about a dragon who learns to cook."}]


def solo_decode(chat: Chat, tokens: int) -> float | None:
    """One agent alone on a short prompt: tok/s after the first of ``tokens`` greedy tokens (the decode
    rate with the least context; None when the engine gives the whole reply at once)."""
    first, pieces = None, 0
    for _ in chat("solo", SOLO, tokens):
        pieces += 1
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return (tokens - 1) / (end - first) if first is not None and pieces > 1 and end > first else None


# --- the engines -------------------------------------------------------------------------------
def kvcmas_chat(mode: str, trace: dict, variant: str = "") -> tuple[Chat, Callable[[], dict]]:
    import asyncio

    from kvcmas_agents import Engine, EngineConfig, KVCMASConfig, SamplingParams
    from kvcmas_agents.switches import SWITCHES

    SWITCHES.rope_write = variant != "ops"

    engine = Engine(EngineConfig(reuse=mode, weights=variant if variant in ("dense", "int8") else "auto",
                                 methods={"kvcmas": KVCMASConfig(decode_copy="auto" if variant == "copy" else "off",
                                                                 prefetch="off" if variant == "inline" else "decode",
                                                                 recompute_dtype="bfloat16" if variant == "bf16" else "model")}))
    names = [a for a, _ in trace["agents"]]
    if mode == "kvcmas" and trace.get("edges", True):         # what a registered LangGraph graph gives
        engine.set_edges(list(zip(names, names[1:] + names[:1])))
    loop = asyncio.new_event_loop()

    def chat(agent: str, messages: list, n: int) -> Iterator[str]:
        sampling = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        stream = engine.stream(messages, agent=agent, sampling=sampling).__aiter__()
        while True:
            try:
                delta = loop.run_until_complete(stream.__anext__())
            except StopAsyncIteration:
                return
            if delta.token_ids:
                yield delta.text

    def extra() -> dict:
        stats = engine.stats()
        engine.close()
        label = {"dense": ", dense weights", "int8": ", int8 rows", "copy": ", decode_copy=auto",
                 "inline": ", prefetch=off", "bf16": ", bf16 recompute",
                 "ops": ", decode layers as separate ops"}.get(variant, "")
        kv = stats["reuse"].get("kvcmas", {})
        return {"engine": f"kvcmas reuse={mode}{label}", "weights": stats["engine"]["weights"],
                "reuse_fallbacks": stats["counters"]["reuse_fallbacks"],
                "prefetch": kv.get("settings", {}).get("prefetch"),
                "recompute_products": kv.get("recompute_products"),
                "prefetched": (kv.get("prefetch") or {}).get("corrections", 0)}
    return chat, extra


def llama_chat(trace: dict) -> tuple[Chat, Callable[[], dict]]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=trace["gguf"], n_ctx=trace["n_ctx"], n_threads=trace["threads"],
                          n_batch=512, verbose=False)
    llm.set_cache(llama_cpp.LlamaRAMCache(capacity_bytes=2 << 30))     # per-agent prompt states, by prefix
    stops = {llm.token_eos()} | set(llm.tokenize(b"<|im_end|>", add_bos=False, special=True))
    bias = {t: -1e9 for t in stops}

    def chat(agent: str, messages: list, n: int) -> Iterator[str]:
        for chunk in llm.create_chat_completion(messages, max_tokens=n, temperature=0.0, stream=True,
                                                logit_bias=bias):
            text = chunk["choices"][0]["delta"].get("content")
            if text:
                yield text
    return chat, lambda: {"engine": f"llama.cpp {llama_cpp.__version__} (GGUF, LlamaRAMCache)"}


def vllm_chat(trace: dict) -> tuple[Chat, Callable[[], dict]]:
    import vllm

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    llm = vllm.LLM(model=trace["checkpoint"], dtype="float32", enable_prefix_caching=True,
                   max_model_len=trace["n_ctx"])

    def chat(agent: str, messages: list, n: int) -> Iterator[str]:
        sampling = vllm.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        out = llm.chat(messages, sampling, use_tqdm=False)
        yield out[0].outputs[0].text          # offline API: the whole reply at once (no TTFT)
    return chat, lambda: {"engine": f"vLLM {vllm.__version__} (fp32, prefix caching)", "ttft": "n/a"}


def main(argv: list[str]) -> int:
    name, path = argv[0], argv[1]
    with open(path) as f:
        trace = json.load(f)
    if name.startswith("kvcmas-"):
        parts = name.split("-")
        chat, extra = kvcmas_chat(parts[1], trace, parts[2] if len(parts) > 2 else "")
    elif name == "llama.cpp":
        chat, extra = llama_chat(trace)
    elif name == "vllm":
        chat, extra = vllm_chat(trace)
    else:
        raise SystemExit(f"unknown engine {name!r}")
    for _ in chat("warmup", [{"role": "user", "content": "Hello."}], 4):     # lazy setup, off the clock
        pass
    with MemorySampler() as mem:
        result = run_workflow(chat, trace)
    result["solo_tok_s"] = solo_decode(chat, trace.get("solo_tokens", 128))
    result.update(extra())
    if result.get("ttft") == "n/a":         # a whole reply at once: no first token, so no decode rate either
        result["later_ttft_s"] = result["decode_tok_s"] = result["solo_tok_s"] = None
    result["peak_rss_bytes"] = mem.peak
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":                  # vLLM's LLM spawns processes: keep the work under this guard
    sys.exit(main(sys.argv[1:]))
