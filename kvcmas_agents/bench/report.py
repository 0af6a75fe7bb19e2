"""Write a bench result as JSON, a markdown report and PNG plots."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MIB = 2 ** 20


def _x(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def _kl(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.1e}" if 0 < x < 1e-3 else f"{x:.4f}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def headline_table(entry: dict[str, Any]) -> str:
    """What a user feels, by method: the whole trace's replay time, the decode rate, and TTFT with the
    agents declared (edges and system prompts registered, as the adapters do) and without (a user who
    registers nothing), next to peak memory and fidelity. Ratios are against prefix in the same run."""
    decode = {t["method"]: t["sequential_tok_s"] for t in entry.get("throughput", [])}
    plain = entry.get("undeclared", {})
    lines = ["| method | replay of the trace s (vs prefix) | sequential decode tok/s (vs prefix) | TTFT ms declared "
             "(vs prefix) | at >= 1,400 shared | TTFT ms undeclared (vs prefix) | at >= 1,400 shared | "
             "peak KV+state MiB (less than kvcomm / prefix) | first-token KL / agreement |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, m in entry["methods"].items():
        r, f, u = m["ratios"], m["fidelity"], plain.get(name)
        rate = decode.get(name)
        rate_ratio = rate / decode["prefix"] if rate and decode.get("prefix") else None
        ur = u["ratios"] if u else {}
        lines.append(
            f"| {m['label']} | {m['wall_s']:.0f} ({_x(r.get('replay_time_vs_prefix'))}) | "
            f"{'-' if rate is None else f'{rate:.1f}'} ({_x(rate_ratio)}) | {_ms(m['ttft_mean'])} "
            f"({_x(r.get('ttft_speedup_vs_prefix'))}) | {_ms(m.get('ttft_long_mean'))} "
            f"({_x(r.get('ttft_long_speedup_vs_prefix'))}) | {_ms(u['ttft_mean']) if u else '-'} "
            f"({_x(ur.get('ttft_speedup_vs_prefix'))}) | {_ms(u.get('ttft_long_mean')) if u else '-'} "
            f"({_x(ur.get('ttft_long_speedup_vs_prefix'))}) | {m['memory']['kv_bytes_total_peak'] / MIB:.1f} "
            f"({_x(r.get('memory_reduction_vs_kvcomm'))} / {_x(r.get('memory_reduction_vs_prefix'))}) | "
            f"{_kl(f.get('first_token_kl_mean'))} / {f.get('agreement_mean', 0):.2f} |")
    return "\n".join(lines)


def replay_work(m: dict[str, Any]) -> dict[str, float]:
    """What one replay computed and where its time went: tokens its turns prefilled under their own
    prefix and recomputed in corrections at turn time, tokens its ahead-of-time corrections recomputed,
    the seconds of each, and the rest of the replay (decode, and what neither counts); and the turns'
    decode as it ran in the replay (tokens after each first token over the seconds from first to last,
    ahead-of-time work run between the steps included)."""
    turns = m["turns"]
    own = sum(t["prompt_tokens"] - t["cached_tokens"] - t["reused_tokens"] for t in turns)
    recomputed = sum(t["recomputed_tokens"] for t in turns)
    pf = (m.get("engine") or {}).get("prefetch") or {}
    ahead_tok, ahead_s = pf.get("recomputed_tokens", 0), pf.get("seconds", 0.0)
    decoded, decode_s = sum(t.get("decoded_tokens", 0) for t in turns), sum(t.get("decode_s", 0.0) for t in turns)
    return {"prefilled": own, "recomputed_at_turn": recomputed, "recomputed_ahead": ahead_tok,
            "computed": own + recomputed + ahead_tok, "ttft_s": m["ttft_total"], "ahead_s": ahead_s,
            "rest_s": m["wall_s"] - m["ttft_total"] - ahead_s, "wall_s": m["wall_s"],
            "decoded_tokens": decoded, "decode_s": decode_s, "decode_tok_s": decoded / decode_s if decode_s else None}


def work_table(entry: dict[str, Any]) -> str:
    """Where each replay's time went, with the prompt tokens it computed: on a CPU ahead-of-time work
    shares the cores with decode, so the replay is faster than prefix's only if its turns and its
    ahead-of-time corrections together compute less than prefix prefills."""
    rows = _replays(entry)
    lines = ["| method | replay s | tokens computed (prefilled + recomputed at turn time + ahead of time) | "
             "first tokens s | ahead-of-time s | decode and the rest s | decode in the replay: tokens after the "
             "first, s, tok/s |", "|---|---|---|---|---|---|---|"]
    for label, m in rows:
        w = replay_work(m)
        rate = f"{w['decode_tok_s']:.1f}" if w["decode_tok_s"] else "-"
        lines.append(f"| {label} | {w['wall_s']:.0f} | {w['computed']} ({w['prefilled']} + {w['recomputed_at_turn']} + "
                     f"{w['recomputed_ahead']}) | {w['ttft_s']:.1f} | {w['ahead_s']:.1f} | {w['rest_s']:.1f} | "
                     f"{w['decoded_tokens']}, {w['decode_s']:.1f}, {rate} |")
    return "\n".join(lines)


def _replays(entry: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(label, replay) of every method's declared replay, then of its undeclared one."""
    return ([(m["label"], m) for m in entry["methods"].values()]
            + [(f"{m['label']}, undeclared", m) for m in entry.get("undeclared", {}).values()])


PHASE_COLUMNS = ("queue", "ahead", "plan", "select", "recompute", "compress", "correct", "forward", "other")


def phase_table(entry: dict[str, Any]) -> str:
    """Where a later turn's TTFT goes, mean ms by phase (RequestOutput.timings): queue (waiting for
    admission), ahead (queued ahead-of-time work run before admission), plan, the correction's select /
    recompute / compress and the rest of it, forward (engine steps carrying the request), other."""
    rows = _replays(entry)
    lines = ["| method | TTFT ms | " + " | ".join(PHASE_COLUMNS) + " |", "|---" * (len(PHASE_COLUMNS) + 2) + "|"]
    for label, m in rows:
        ph = m.get("ttft_phases", {})
        lines.append(f"| {label} | {_ms(m['ttft_mean'])} | " + " | ".join(_ms(ph.get(p)) for p in PHASE_COLUMNS) + " |")
    return "\n".join(lines)


def method_table(name: str, entry: dict[str, Any]) -> str:
    """One row per method: TTFT (later turns), peak memory, fidelity, and ratios to the baselines."""
    lines = [f"Trace `{name}`: {len(entry['turns'])} turns, agents {', '.join(entry['agents'])}; shared history "
             f"up to {entry['shared_tokens_max']} tokens, longest prompt {entry['prompt_tokens_max']}.", "",
             "| method | TTFT mean / p50 / p95 ms | speedup vs prefix | vs none | peak KV+state MiB | "
             "less than kvcomm | less than prefix | first-token KL | TF KL | agreement | not prefilled | served |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in entry["methods"].values():
        f, r, mem = m["fidelity"], m["ratios"], m["memory"]
        lines.append(
            f"| {m['label']} | {m['ttft_mean'] * 1e3:.0f} / {m['ttft_p50'] * 1e3:.0f} / {m['ttft_p95'] * 1e3:.0f} | "
            f"{_x(r.get('ttft_speedup_vs_prefix'))} | {_x(r.get('ttft_speedup_vs_none'))} | "
            f"{mem['kv_bytes_total_peak'] / MIB:.1f} | {_x(r.get('memory_reduction_vs_kvcomm'))} | "
            f"{_x(r.get('memory_reduction_vs_prefix'))} | {_kl(f.get('first_token_kl_mean'))} | "
            f"{_kl(f.get('tf_kl_mean'))} | {f.get('agreement_mean', 0):.2f} | "
            f"{100 * f.get('not_prefilled_frac_mean', 0):.0f}% | {','.join(m['served'])} |")
    return "\n".join(lines)


def memory_table(name: str, entry: dict[str, Any]) -> str:
    """Where each method's peak memory sits (engine accounting; CUDA allocator when on a GPU)."""
    cuda = any("cuda_peak_over_pool_bytes" in m["memory"] for m in entry["methods"].values())
    head = ("| method | KV blocks peak MiB | home views MiB | corrections MiB (of which bases) | anchors MiB | anchor hits / misses | "
            "ahead-of-time corrections | faint rows not stored |" + (" CUDA peak over pool |" if cuda else ""))
    lines = [head, "|---" * (8 + cuda) + "|"]
    for m in entry["methods"].values():
        mem, eng = m["memory"], m.get("engine", {})
        pf = eng.get("prefetch") or {}
        hits = f"{eng.get('anchor_hits') or 0} / {eng.get('anchor_misses') or 0}" if m["reuse"] == "kvcomm" else "-"
        ahead = f"{pf.get('corrections', 0)} ({pf.get('recomputed_tokens', 0)} tok)" if pf and m["reuse"] == "kvcmas" else "-"
        dropped = eng.get("correction_rows_dropped") if m["reuse"] == "kvcmas" else None
        row = (f"| {m['label']} | {mem['kv_bytes_peak'] / MIB:.1f} | {mem['home_view_bytes'] / MIB:.1f} | "
               f"{mem['correction_bytes'] / MIB:.1f} ({mem.get('correction_basis_bytes', 0) / MIB:.1f}) | "
               f"{mem['anchor_bytes'] / MIB:.1f} | {hits} | {ahead} | {'-' if dropped is None else dropped} |")
        if cuda:
            row += f" {mem.get('cuda_peak_over_pool_bytes', 0) / MIB:.1f} |"
        lines.append(row)
    return "\n".join(lines)


def sweep_table(entry: dict[str, Any]) -> str:
    """One row per swept knob setting, its replay time and peak memory against the same run's baselines
    included."""
    lines = ["| kvcmas knobs | replay s (vs prefix) | TTFT mean ms | first-token KL | TF KL | agreement | recomputed | "
             "corrections MiB | peak KV+state MiB | less than kvcomm | less than prefix |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in entry.get("sweep", []):
        f, mem, r = m["fidelity"], m["memory"], m.get("ratios", {})
        lines.append(f"| {m['label']} | {m['wall_s']:.0f} ({_x(r.get('replay_time_vs_prefix'))}) | "
                     f"{m['ttft_mean'] * 1e3:.0f} | {_kl(f.get('first_token_kl_mean'))} | "
                     f"{_kl(f.get('tf_kl_mean'))} | {f.get('agreement_mean', 0):.2f} | "
                     f"{100 * f.get('recomputed_frac_mean', 0):.0f}% | {mem['correction_bytes'] / MIB:.1f} | "
                     f"{mem['kv_bytes_total_peak'] / MIB:.1f} | {_x(r.get('memory_reduction_vs_kvcomm'))} | "
                     f"{_x(r.get('memory_reduction_vs_prefix'))} |")
    return "\n".join(lines)


def throughput_table(entry: dict[str, Any]) -> str:
    lines = ["| engine reuse | agents | tokens each | sequential tok/s | of which after the first token | "
             "concurrent tok/s | speedup | max batch |",
             "|---|---|---|---|---|---|---|---|"]
    for t in entry.get("throughput", []):
        only = t.get("sequential_decode_only_tok_s")
        lines.append(f"| {t['method']} | {len(t['agents'])} | {t['tokens_per_agent']} | {t['sequential_tok_s']:.1f} | "
                     f"{'-' if only is None else f'{only:.1f}'} | "
                     f"{t['concurrent_tok_s']:.1f} | {t['speedup']:.2f}x | {t['max_batch_seqs']} |")
    return "\n".join(lines)


def concurrent_memory_table(entry: dict[str, Any]) -> str:
    lines = ["| method | agents decoding at once | peak KV+state MiB | of which added while they ran | tok/s |",
             "|---|---|---|---|---|"]
    for r in entry.get("concurrent_memory", []):
        lines.append(f"| {r['label']} | {r['agents']} | {r['peak_bytes'] / MIB:.1f} | "
                     f"{r['peak_over_start_bytes'] / MIB:.1f} | {r['tok_s']:.1f} |")
    return "\n".join(lines)


def markdown(result: dict[str, Any], command: str = "") -> str:
    c = result["config"]
    out = ["# kvcmas bench", "",
           f"Model `{c['model_name']}` on `{c['device_used']}` ({c['dtype']}, {c['torch_threads']} torch threads); "
           f"fidelity scored on {c['eval_tokens']} teacher-forced tokens per turn; replayed turns decode "
           f"{'the whole exact reply' if c.get('full_decode') else 'only that window'}; total {result['timing']['total_s']:.0f} s.",
           *([f"Command: `{command}`"] if command else []), "",
           "TTFT and fidelity are over the later turns (every turn after the first turn group, i.e. those that "
           "can reuse another agent's KV). Peak memory is the engine's accounting of KV blocks in use or cached, "
           "plus correction states and anchors, over the whole replay. Ratios come from one run."]
    for name, entry in result["traces"].items():
        out += ["", f"## {name}", "", "What a user feels (replay time and decode rate against prefix's, TTFT "
                "with the agents declared and without):", "", headline_table(entry), "",
                method_table(name, entry), "", memory_table(name, entry), "",
                "Where a later turn's TTFT goes (mean ms by phase):", "", phase_table(entry), "",
                "Where the replay's time goes, and the prompt tokens each replay computed:", "", work_table(entry)]
        if entry.get("sweep"):
            out += ["", "Knob sweep (kvcmas):", "", sweep_table(entry)]
        if entry.get("throughput"):
            out += ["", "Concurrent decode (the last turn of each of the last agents, run together vs in turn):", "",
                    throughput_table(entry)]
        if entry.get("concurrent_memory"):
            out += ["", "Agents decoding at once (the trace's last turns, each its own agent):", "",
                    concurrent_memory_table(entry)]
    return "\n".join(out) + "\n"


def plot(result: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """ttft_per_turn.png, peak_memory.png and frontier.png (when a sweep ran: first-token KL against TTFT
    and against peak memory)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: dict[str, Path] = {}
    traces = result["traces"]
    fig, axes = plt.subplots(1, len(traces), figsize=(6 * len(traces), 4), squeeze=False)
    for ax, (name, entry) in zip(axes[0], traces.items()):
        for m in entry["methods"].values():
            ax.plot([t["index"] for t in m["turns"]], [1e3 * t["ttft_s"] for t in m["turns"]], marker=".",
                    label=m["label"])
        ax.set(title=name, xlabel="turn", ylabel="TTFT ms")
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths["ttft"] = out_dir / "ttft_per_turn.png"
    fig.savefig(paths["ttft"], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(traces), figsize=(6 * len(traces), 4), squeeze=False)
    for ax, (name, entry) in zip(axes[0], traces.items()):
        ms = list(entry["methods"].values())
        ax.bar([m["label"] for m in ms], [m["memory"]["kv_bytes_total_peak"] / MIB for m in ms])
        ax.set(title=name, ylabel="peak KV + state MiB")
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    paths["memory"] = out_dir / "peak_memory.png"
    fig.savefig(paths["memory"], dpi=110)
    plt.close(fig)

    swept = [(n, e) for n, e in traces.items() if e.get("sweep")]
    if swept:
        name, entry = swept[0]
        kl = lambda m: max(m["fidelity"].get("first_token_kl_mean", 0), 1e-7)  # noqa: E731  (log axis)
        axes_of = (("TTFT mean ms (later turns)", lambda m: 1e3 * m["ttft_mean"]),
                   ("peak KV + state MiB", lambda m: m["memory"]["kv_bytes_total_peak"] / MIB))
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
        for ax, (xlabel, x) in zip(axes, axes_of):
            for m in entry["sweep"]:
                ax.scatter(x(m), kl(m), c="tab:blue")
                ax.annotate(m["label"].removeprefix("kvcmas"), (x(m), kl(m)), fontsize=7)
            for m in entry["methods"].values():
                ax.scatter(x(m), kl(m), marker="s")
                ax.annotate(m["label"], (x(m), kl(m)), fontsize=8)
            ax.set(yscale="log", xlabel=xlabel, ylabel="first-token KL vs exact (nats)")
        axes[0].set_title(f"fidelity / speed frontier ({name})")
        axes[1].set_title(f"fidelity / memory frontier ({name})")
        fig.tight_layout()
        paths["frontier"] = out_dir / "frontier.png"
        fig.savefig(paths["frontier"], dpi=110)
        plt.close(fig)
    return paths


def write_report(result: dict[str, Any], out_dir: str | Path, command: str = "") -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench.json", "markdown": out / "bench.md"}
    paths["json"].write_text(json.dumps(result, indent=1))
    paths["markdown"].write_text(markdown(result, command))
    paths.update(plot(result, out))
    return paths
