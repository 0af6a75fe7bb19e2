"""The compiled CPU loops serve few queries over a view and agree with the torch path they replace."""
from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch

from kvcmas_agents.kernels import cbuild, cpu_view
from kvcmas_agents.model.rope import inv_frequencies
from kvcmas_agents.reuse.realign import Realigner
from kvcmas_agents.reuse.storage.codec import Format, compress, compress_joint
from kvcmas_agents.reuse.views import compiled, gather, lowrank
from kvcmas_agents.reuse.views.gather import build_gathered, gathered_attention
from kvcmas_agents.reuse.views.reference import OwnPiece, SegmentPiece, view_attention

pytestmark = pytest.mark.skipif(cpu_view.load() is None, reason=str(cpu_view.unavailable()))


def _view(kind: str, kv_heads: int, head_dim: int, layers: int, segments: int, keep: bool, chain: bool = True):
    """Pieces over a random cache: an own prefix, ``segments`` reused segments with distinct deltas and
    corrections stored as ``kind`` (int8 factors, quantized rows, float factors, joint states), the
    first one corrected by a chain of two unless not ``chain``, and the gathered view of them."""
    g = torch.Generator().manual_seed(segments)
    k_cache = torch.randn(900, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(900, kv_heads, head_dim, generator=g)
    inv, _ = inv_frequencies(head_dim, 10000.0, None, 4096)
    realigner = Realigner(inv.float())
    rows = [torch.sort(torch.randperm(30, generator=g)[:11]).values for _ in range(segments)]
    dks = [torch.randn(layers, kv_heads, 11, head_dim, generator=g) * 0.1 for _ in range(segments)]
    if kind == "joint":
        states = compress_joint(dks, [d.flip(-1) for d in dks], rows, 8, Format(torch.int8, int8_basis=True, u8=4))
    else:
        fmt = {"int8": Format(torch.int8, int8_basis=True), "rows": Format(torch.int8, value_bits=4, key_bits=4),
               "float": Format(None), "bf16": Format(torch.int8)}[kind]
        states = [compress(dk, dk.flip(-1), r, 8, fmt) for dk, r in zip(dks, rows)]
    pieces = [OwnPiece(torch.arange(0, 10), torch.arange(10))]
    for i, state in enumerate(states):
        deltas = [state, realigner.rotate_delta(state, 3)] if i == 0 and chain else [state]    # a chain of two
        pieces.append(SegmentPiece(torch.arange(200 + 30 * i, 230 + 30 * i), torch.arange(10 + 30 * i, 40 + 30 * i),
                                   7 - 5 * i, deltas))
    view = replace(build_gathered(pieces, realigner, torch.device("cpu"), torch.float32), keep=keep)
    return pieces, view, k_cache, v_cache, realigner, 10 + 30 * segments


@pytest.mark.parametrize("kind", ["int8", "rows", "float", "bf16", "joint"])
@pytest.mark.parametrize("queries", [1, 3, 8])
@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("one_call", [True, False])
@pytest.mark.parametrize("chain", [True, False])
def test_compiled_loops_match_the_torch_path_and_the_reference(monkeypatch, kind, queries, keep, one_call, chain):
    """Both ways the loops serve a layer: one call for all of it (``view_attention``), or one call per
    part where a stack's bases are not theirs to read; over the view's own key order where a chain
    corrects some keys twice, else over its ``KeyOrder`` (corrected rows first)."""
    kv_heads, head_dim, group, layers = 3, 64, 3, 2
    pieces, view, k_cache, v_cache, realigner, n = _view(kind, kv_heads, head_dim, layers, 12, keep, chain)
    assert (view.order is None) == chain
    tail = OwnPiece(torch.arange(700, 700 + queries), torch.arange(n, n + queries))
    view = view.extend(tail.slots)
    served, whole = [], []
    real, real_whole = gather._compiled_attention, cpu_view.view_attention
    monkeypatch.setattr(gather, "_compiled_attention", lambda *a: served.append(1) or real(*a))
    monkeypatch.setattr(cpu_view, "view_attention", lambda *a: whole.append(1) or real_whole(*a))
    if not one_call:
        monkeypatch.setattr(compiled, "_compiled_table", lambda *a: None)
    for layer in range(layers):
        q = torch.randn(queries, kv_heads * group, head_dim)
        out = gathered_attention(q, view, k_cache, v_cache, layer, head_dim ** -0.5)
        torch_path = lowrank._lowrank_attention(q, view, k_cache, v_cache, layer, head_dim ** -0.5)
        ref = view_attention(q, torch.arange(n, n + queries), pieces + [tail], k_cache, v_cache, layer,
                             head_dim ** -0.5, realigner)
        assert torch.allclose(out, torch_path, atol=2e-6), (out - torch_path).abs().max()
        assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()
    assert len(served) == layers            # the compiled loops served every layer (13 deltas: keys rotated)
    assert len(whole) == (layers if one_call else 0)
    # and read every stack's bases themselves, whatever their storage
    assert view.stacks and all(b is not None for st in view.stacks for b in st.bases.values())
    # Not vacuous: a view without the corrections attends differently.
    plain = replace(view, stacks=[])
    assert not torch.allclose(gathered_attention(q, plain, k_cache, v_cache, 1, head_dim ** -0.5), out, atol=1e-4)


def test_softmax_of_the_compiled_loops_is_exact_to_float_rounding():
    """Their own exp: probabilities over a wide range of scores match torch.softmax's."""
    torch.manual_seed(0)
    scores = torch.randn(2, 3, 500) * 30
    v = torch.randn(500, 2, 8)
    out = cpu_view.softmax_pv(1, scores.clone(), 0.7, v, torch.arange(500))
    probs = torch.softmax(scores * 0.7, dim=-1)
    want = torch.einsum("hxj,jhd->hxd", probs, v)
    assert torch.allclose(out, want, atol=1e-6, rtol=1e-5), (out - want).abs().max()


@pytest.mark.parametrize("codes", ["fp32", "int8", "int8-scaled"])
@pytest.mark.parametrize("query_rows", [3, 6])
@pytest.mark.parametrize("rows_are", ["consecutive", "disjoint", "chained"])
def test_low_rank_terms_over_many_rows_match_torch(codes, query_rows, rows_are):
    """Runs longer than a share of the work (several blocks, a last one cut short), groups of a few
    rows around them, rows that are consecutive keys (a view's ``KeyOrder``: whole vectors), that
    appear once (added into the scores in place) or in two groups (a chain: added in order), and query
    rows past one tile: the terms torch gives."""
    torch.manual_seed(query_rows)
    kvh, ctx, r, sizes = 3, 700, 8, [11, 300, 5]
    rows = [torch.sort(torch.randperm(ctx)[:n]).values for n in sizes]          # chained
    if rows_are == "disjoint":                         # each position in one group
        perm = torch.randperm(ctx)
        rows = [torch.sort(perm[a:a + n]).values for a, n in zip([0, 11, 311], sizes)]
    elif rows_are == "consecutive":
        rows = [torch.arange(40, 40 + sum(sizes))]
    rows = torch.cat(rows)
    group = torch.repeat_interleave(torch.arange(len(sizes), dtype=torch.int32), torch.tensor(sizes))
    u8 = torch.randint(-127, 128, (kvh, r, rows.numel()), dtype=torch.int8)
    scale = torch.rand(kvh, rows.numel()) if codes == "int8-scaled" else None
    u = torch.randn(kvh, r, rows.numel()) if codes == "fp32" else u8.float() * (1 if scale is None else scale[:, None])
    coeffs = cpu_view.Coeffs(u.contiguous()) if codes == "fp32" else cpu_view.Coeffs(u8, scale)
    qb = torch.randn(len(sizes), kvh, query_rows, r)
    scores = torch.randn(kvh, query_rows, ctx)
    want = scores.clone()
    for j in range(rows.numel()):
        want[:, :, rows[j]] += torch.einsum("hxt,ht->hx", qb[group[j]], u[:, :, j])
    cpu_view.lowrank_scores(scores, rows, group, qb, coeffs)
    assert torch.allclose(scores, want, atol=1e-3, rtol=1e-5), (scores - want).abs().max()
    probs = torch.rand(kvh, query_rows, ctx)
    pu = cpu_view.lowrank_values(probs, rows, group, len(sizes), coeffs)
    want = torch.zeros_like(pu)
    for j in range(rows.numel()):
        want[group[j]] += probs[:, :, rows[j], None] * u[:, None, :, j]
    assert torch.allclose(pu, want, atol=1e-3, rtol=1e-5), (pu - want).abs().max()


def test_without_a_compiler_the_torch_path_serves_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("KVCMAS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_view, "LIB", cbuild.CLibrary(cpu_view.SOURCES, cpu_view._SIGNATURES, "KVCMAS_NO_CPU_KERNEL",
                                                         "CPU view kernel"))
    assert cpu_view.load() is None and "no-such-cc" in (cpu_view.unavailable() or "")
    pieces, view, k_cache, v_cache, realigner, n = _view("int8", 2, 64, 1, 3, False)
    q = torch.randn(1, 4, 64)
    out = gathered_attention(q, view, k_cache, v_cache, 0, 0.125)
    ref = view_attention(q, torch.tensor([n - 1]), pieces, k_cache, v_cache, 0, 0.125, realigner)
    assert torch.allclose(out, ref, atol=1e-5)


@pytest.mark.parametrize("queries", [1, 3, 8])
def test_plain_paged_attention_by_the_loops_matches_sdpa(queries):
    from kvcmas_agents.model.attention import sdpa, ungroup
    g = torch.Generator().manual_seed(queries)
    k_cache, v_cache = torch.randn(300, 3, 64, generator=g), torch.randn(300, 3, 64, generator=g)
    slots = torch.randperm(300, generator=g)[:120]
    q = torch.randn(queries, 9, 64, generator=g)
    out = ungroup(cpu_view.attention(q, k_cache, v_cache, slots, 0.125), queries)
    want = sdpa(q, k_cache.index_select(0, slots), v_cache.index_select(0, slots), 0.125)
    assert torch.allclose(out, want, atol=2e-6), (out - want).abs().max()


@pytest.mark.parametrize("queries,keys", [(1, 7), (1, 300), (3, 37), (2, 1000)])
def test_the_wide_loops_give_what_the_portable_ones_give(monkeypatch, tmp_path, queries, keys):
    """Scores sixteen keys a sum and values in registers (AVX-512, 64-wide heads) against the portable
    loops (forced here), with and without realigned key classes (mixed, and in runs of one class), at
    key counts off a multiple of 16, and the low-rank terms' AVX-512 code conversion."""
    if not cpu_view.wide():
        pytest.skip("no AVX-512 here: the loops built are the portable ones")
    g = torch.Generator().manual_seed(keys)
    k_cache, v_cache = torch.randn(keys + 40, 3, 64, generator=g), torch.randn(keys + 40, 3, 64, generator=g)
    slots = torch.randperm(keys + 40, generator=g)[:keys]
    q = torch.randn(queries, 9, 64, generator=g)
    key_class = torch.randint(0, 3, (keys,), generator=g)
    runs = torch.sort(key_class).values                # sixteen keys of one class: one query row each
    cos, sin = torch.rand(3, 64, generator=g), torch.rand(3, 64, generator=g)
    rows = torch.arange(2, 2 + keys // 2)              # low-rank terms of consecutive rows (a KeyOrder's)
    u8 = torch.randint(-127, 128, (3, 8, rows.numel()), dtype=torch.int8, generator=g)
    coeffs, group = cpu_view.Coeffs(u8, torch.rand(3, rows.numel(), generator=g)), torch.zeros(rows.numel(), dtype=torch.int32)
    qb = torch.randn(1, 3, 3 * queries, 8, generator=g)
    probs = torch.softmax(torch.randn(3, 3 * queries, keys, generator=g), -1)

    def both():
        plain = cpu_view.attention(q, k_cache, v_cache, slots, 0.125)
        moved = cpu_view.scores(q, k_cache, slots, key_class, cos, sin)
        in_runs = cpu_view.scores(q, k_cache, slots, runs, cos, sin)
        cpu_view.lowrank_scores(in_runs, rows, group, qb, coeffs)
        return plain, moved, in_runs, cpu_view.lowrank_values(probs, rows, group, 1, coeffs)

    fast = both()
    monkeypatch.setenv("KVCMAS_CACHE_DIR", str(tmp_path))
    portable = cbuild.CLibrary(cpu_view.SOURCES, cpu_view._SIGNATURES, "KVCMAS_NO_CPU_KERNEL", "CPU view kernel",
                               extra_flags=("-DKVQ_PORTABLE",))
    monkeypatch.setattr(cpu_view, "LIB", portable)
    assert not cpu_view.wide()
    for got, want in zip(both(), fast):
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


async def test_the_engine_decodes_plain_kv_with_the_loops_and_says_so(monkeypatch):
    """Greedy decode through the loops gives the tokens torch's attention gives; stats name the loops."""
    from kvcmas_agents import Engine, EngineConfig, SamplingParams
    from kvcmas_agents.switches import SWITCHES

    messages = [{"role": "user", "content": "Count from one to ten, in words."}]
    tokens, loops = [], []
    for on in (True, False):
        monkeypatch.setattr(SWITCHES, "plain_loops", on)
        engine = Engine(EngineConfig(model=None, device="cpu", reuse="prefix", num_threads=1))
        try:
            out = await engine.generate(messages, sampling=SamplingParams(max_tokens=12, ignore_eos=True))
            tokens.append(out.token_ids)
            loops.append(engine.stats()["engine"]["attention_loops"])
        finally:
            await engine.aclose()
    assert tokens[0] == tokens[1] and len(tokens[0]) == 12
    assert loops[0] == "compiled"


def test_threads_split_the_work_without_changing_the_result(monkeypatch):
    """Two threads give what one gives, the same every time (no two threads add into one sum; a chain's
    rows appear in several runs), and the one-thread build says why it is one."""
    pieces, view, k_cache, v_cache, realigner, n = _view("joint", 3, 64, 2, 12, True)
    view = view.extend(torch.arange(700, 701))
    q = torch.randn(1, 9, 64)
    outs = {}
    for threads in (1, 2, 2, 2):
        monkeypatch.setattr(cpu_view, "threads", lambda t=threads: t)
        with torch.no_grad():
            outs.setdefault(threads, []).append(gathered_attention(q, view, k_cache, v_cache, 1, 0.125))
    assert all(torch.equal(o, outs[2][0]) for o in outs[2])
    assert torch.allclose(outs[1][0], outs[2][0], atol=1e-6)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="threads are shared with torch on Linux")
def test_a_compiler_that_is_not_gcc_builds_the_one_thread_loops(tmp_path):
    """Its OpenMP runtime would be a second one beside torch's libgomp: the loops stay on one thread."""
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'clang version 18.0.0'\n")
    fake.chmod(0o755)
    why = cbuild.threading_reason(str(fake))
    assert why is not None and "not GCC" in why
    assert cpu_view.status(torch.device("cpu"), torch.float32).startswith("compiled")


def test_a_failed_threaded_build_falls_back_to_one_thread(monkeypatch, tmp_path):
    """Where -fopenmp cannot build (no libgomp to link), the loops still build, on one thread, and say so."""
    monkeypatch.setenv("KVCMAS_CACHE_DIR", str(tmp_path))
    lib = cbuild.CLibrary(cpu_view.SOURCES, cpu_view._SIGNATURES, "KVCMAS_NO_CPU_KERNEL", "CPU view kernel")
    lib.shared, lib.threading = "-fno-such-openmp-flag", lambda cc: None
    monkeypatch.setattr(cpu_view, "LIB", lib)
    assert cpu_view.load() is not None and cpu_view.threads() == 1
    assert cpu_view.status(torch.device("cpu"), torch.float32).startswith("compiled, one thread: the -fopenmp build failed")
