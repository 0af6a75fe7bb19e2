"""The fast gather path equals the query-side view attention (the kernel's math) on random views."""
from __future__ import annotations

import pytest
import torch

from kvcmas_agents.reuse.storage.codec import compress, compress_joint
from kvcmas_agents.reuse.storage.readers import Coeffs
from kvcmas_agents.reuse.realign import Realigner
from kvcmas_agents.model.rope import inv_frequencies
from kvcmas_agents.reuse.views.reference import OwnPiece, SegmentPiece, view_attention
from kvcmas_agents.reuse.views.dense import gathered_kv, gathered_mass_attention
from kvcmas_agents.reuse.views.gather import build_gathered, gathered_attention
from kvcmas_agents.reuse.storage.codec import Format


@pytest.mark.parametrize("head_dim, group, kv_heads, rank, tq", [
    (64, 3, 3, 16, 1), (64, 1, 2, 4, 5), (128, 4, 1, 0, 3), (64, 3, 3, 64, 7), (64, 3, 3, 16, 12),
    (64, 3, 3, "rows4", 1), (64, 3, 3, "rows4", 12), (128, 4, 1, "rows8", 3),
    (64, 3, 3, "keyrows4", 1), (64, 3, 3, "keyrows4", 12), (128, 4, 1, "keyrows8", 3)])
def test_gather_path_matches_view_attention(head_dim, group, kv_heads, rank, tq):
    torch.manual_seed(0)
    layers, slots_total = 2, 400
    k_cache = torch.randn(slots_total, kv_heads, head_dim)
    v_cache = torch.randn(slots_total, kv_heads, head_dim)
    inv, _ = inv_frequencies(head_dim, 10000.0, None, 4096)
    realigner = Realigner(inv.float())
    perm = torch.randperm(slots_total)
    # own prefix [0,10), segment A [10,40) delta 7 with a chain of 2 (an int8 state, then a state moved by
    # a pending shift), segment B [40,60) delta -3 naive, own tail [60, 60 + tq).
    def seg(start, n, delta, ndeltas):
        deltas = []
        for i in range(ndeltas):
            rows = torch.sort(torch.randperm(n)[: n // 3]).values
            dk = torch.randn(layers, kv_heads, rows.numel(), head_dim) * 0.1
            if isinstance(rank, str):        # values (and with "keyrows", keys) as quantized rows
                bits = int(rank[-1])
                state = compress(dk, dk.flip(-1), rows, 16, Format(torch.int8, value_bits=bits,
                                                                   key_bits=bits if rank.startswith("key") else 0))
            else:
                state = compress(dk, dk.flip(-1), rows, rank, Format(torch.int8 if i == 0 else None, int8_basis=True))
            deltas.append(realigner.rotate_delta(state, 11) if i == 1 else state)
        return SegmentPiece(perm[100 + start:100 + start + n], torch.arange(start, start + n), delta, deltas)
    pieces = [OwnPiece(perm[:10], torch.arange(10)), seg(10, 30, 7, 2), seg(40, 20, -3, 0),
              OwnPiece(perm[60:60 + tq], torch.arange(60, 60 + tq))]
    q = torch.randn(tq, kv_heads * group, head_dim)
    view = build_gathered(pieces, realigner, torch.device("cpu"), torch.float32)
    for layer in range(layers):
        ref = view_attention(q, torch.arange(60, 60 + tq), pieces, k_cache, v_cache, layer, head_dim ** -0.5,
                             realigner)
        out = gathered_attention(q, view, k_cache, v_cache, layer, head_dim ** -0.5)
        assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()
        settled = [SegmentPiece(p.slots, p.positions, p.delta, [realigner.settle(d) for d in p.deltas])
                   if isinstance(p, SegmentPiece) else p for p in pieces]      # shifts applied eagerly
        eager = view_attention(q, torch.arange(60, 60 + tq), settled, k_cache, v_cache, layer, head_dim ** -0.5,
                               realigner)
        assert torch.allclose(ref, eager, atol=1e-5), (ref - eager).abs().max()
    # Not vacuous: without realignment the result differs.
    plain = build_gathered([OwnPiece(p.slots, p.positions) for p in pieces], realigner, torch.device("cpu"),
                       torch.float32)
    assert not torch.allclose(gathered_attention(q, plain, k_cache, v_cache, 0, head_dim ** -0.5),
                              view_attention(q, torch.arange(60, 60 + tq), pieces, k_cache, v_cache, 0,
                                             head_dim ** -0.5, realigner), atol=1e-3)


def test_mass_attention_matches_view_attention_with_gaps_and_inner_queries():
    """The selection pass's backend: same output and per-key mass as view_attention, with a gap in the
    key positions (new text not computed yet) and queries that sit inside a reused segment."""
    torch.manual_seed(1)
    head_dim, kv_heads, group, layers = 64, 3, 3, 2
    k_cache, v_cache = torch.randn(300, kv_heads, head_dim), torch.randn(300, kv_heads, head_dim)
    inv, _ = inv_frequencies(head_dim, 10000.0, None, 4096)
    realigner = Realigner(inv.float())
    rows = torch.tensor([1, 4, 9, 20])
    dk = torch.randn(layers, kv_heads, rows.numel(), head_dim) * 0.1
    seg = SegmentPiece(torch.arange(100, 130), torch.arange(10, 40), 5, [compress(dk, dk * 0.5, rows, 4)])
    # positions [40, 50) are a gap; the own tail is [50, 56); queries from 35 (inside the segment).
    pieces = [OwnPiece(torch.arange(0, 10), torch.arange(10)), seg,
              OwnPiece(torch.arange(200, 206), torch.arange(50, 56))]
    q_pos = torch.cat([torch.arange(35, 40), torch.arange(50, 56)])
    q = torch.randn(q_pos.numel(), kv_heads * group, head_dim)
    view = build_gathered(pieces, realigner, torch.device("cpu"), torch.float32)
    key_pos = torch.cat([p.positions for p in pieces])
    for layer in range(layers):
        ref, ref_mass = view_attention(q, q_pos, pieces, k_cache, v_cache, layer, head_dim ** -0.5, realigner,
                                       return_mass=True)
        out, mass = gathered_mass_attention(q, q_pos, key_pos, view, k_cache, v_cache, layer, head_dim ** -0.5)
        assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()
        assert torch.allclose(mass, torch.cat(ref_mass), atol=1e-5)
        # Every query's probabilities sum to one over the keys it sees: H heads x Tq queries in all.
        assert mass.sum().item() == pytest.approx(q.shape[0] * q.shape[1], rel=1e-5)


def _three_segments(seed: int, head_dim: int, kv_heads: int, layers: int):
    """A random KV cache, a realigner, and three segments' corrected rows with their key deviations."""
    torch.manual_seed(seed)
    k_cache, v_cache = torch.randn(300, kv_heads, head_dim), torch.randn(300, kv_heads, head_dim)
    inv, _ = inv_frequencies(head_dim, 10000.0, None, 4096)
    rows = [torch.tensor([0, 3, 7, 11]), torch.tensor([2, 5, 9]), torch.tensor([1, 4, 6, 8, 19])]
    dks = [torch.randn(layers, kv_heads, r.numel(), head_dim) * 0.2 for r in rows]
    return k_cache, v_cache, Realigner(inv.float()), rows, dks


@pytest.mark.parametrize("tq, u8", [(1, None), (12, None), (1, 4), (12, 4)])
def test_joint_states_without_layer_zero(tq, u8):
    """States of one joint basis (one group, their int8 U joined before one cast) that leave out layer 0:
    both gather paths match view_attention in every layer, and layer 0 reads the home keys as they are.
    With u8, U's last components are 4-bit codes and B is int8 (the engine's default storage)."""
    head_dim, kv_heads, group, layers = 64, 3, 3, 3
    k_cache, v_cache, realigner, rows, dks = _three_segments(2, head_dim, kv_heads, layers)
    states = compress_joint(dks, [d.flip(-1) for d in dks], rows, 8, Format(torch.int8, int8_basis=u8 is not None,
                                                                            u8=u8), first_layer=1)
    assert len({id(s.k.b) for s in states}) == 1 and all(s.first_layer == 1 for s in states)
    assert all(s.k.tail4 == s.v.tail4 == (4 if u8 else 0) for s in states)
    pieces = [OwnPiece(torch.arange(0, 8), torch.arange(8))]
    for i, state in enumerate(states):
        pieces.append(SegmentPiece(torch.arange(100 + 20 * i, 120 + 20 * i), torch.arange(8 + 20 * i, 28 + 20 * i),
                                   5 - 4 * i, [state]))
    pieces.append(OwnPiece(torch.arange(250, 250 + tq), torch.arange(68, 68 + tq)))
    q = torch.randn(tq, kv_heads * group, head_dim)
    view = build_gathered(pieces, realigner, torch.device("cpu"), torch.float32)
    assert view.first_layer == 1 and [len(st.groups) for st in view.stacks] == [1]
    assert len(view.stacks[0].groups[0][0]) == 3
    joined = Coeffs.joined(view.stacks[0].groups[0][0], 2, torch.float32)
    assert torch.equal(joined, torch.cat([s.key_coeffs().at(2) for s in states], dim=1))
    for layer in range(layers):
        ref = view_attention(q, torch.arange(68, 68 + tq), pieces, k_cache, v_cache, layer, head_dim ** -0.5,
                             realigner)
        out = gathered_attention(q, view, k_cache, v_cache, layer, head_dim ** -0.5)
        assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()
    k0, _ = gathered_kv(view, k_cache, v_cache, 0)
    assert torch.equal(k0, gathered_kv(view, k_cache, v_cache, 0, corrected=False)[0])
    k2, _ = gathered_kv(view, k_cache, v_cache, 2)
    assert not torch.allclose(k2, gathered_kv(view, k_cache, v_cache, 2, corrected=False)[0], atol=1e-3)


@pytest.mark.parametrize("ndeltas, corrected", [(3, True), (3, False), (12, True)])
def test_query_side_realignment_matches_key_rotation(monkeypatch, ndeltas, corrected):
    """Few queries over a view with few distinct deltas rotate the queries, not the keys (with more
    deltas than QUERY_ROTATIONS, the keys): same attention as view_attention either way, naive or not."""
    import kvcmas_agents.reuse.views.lowrank as vg
    torch.manual_seed(3)
    head_dim, kv_heads, group, layers, n = 64, 3, 3, 2, 12
    k_cache, v_cache = torch.randn(400, kv_heads, head_dim), torch.randn(400, kv_heads, head_dim)
    inv, _ = inv_frequencies(head_dim, 10000.0, None, 4096)
    realigner = Realigner(inv.float())
    pieces = [OwnPiece(torch.arange(0, 5), torch.arange(5))]
    for i in range(12):
        rows = torch.tensor([0, 4, 9])
        dk = torch.randn(layers, kv_heads, 3, head_dim) * 0.2
        deltas = [compress(dk, dk.flip(-1), rows, 2, Format(torch.int8))] if corrected else []
        pieces.append(SegmentPiece(torch.arange(20 + n * i, 20 + n * (i + 1)), torch.arange(5 + n * i, 5 + n * (i + 1)),
                                   (-1) ** i * (3 + i % ndeltas), deltas))
    pieces.append(OwnPiece(torch.arange(300, 302), torch.arange(5 + 12 * n, 7 + 12 * n)))
    q = torch.randn(2, kv_heads * group, head_dim)
    view = build_gathered(pieces, realigner, torch.device("cpu"), torch.float32)
    assert view.q_cos.shape[0] == 1 + min(2 * ndeltas, 12)
    assert vg._query_side(view, 1) == (ndeltas == 3) and not vg._query_side(view, 2)
    monkeypatch.setattr(vg, "QUERY_ROTATIONS", 2 * view.q_cos.shape[0])          # both queries rotated
    q_pos = torch.arange(5 + 12 * n, 7 + 12 * n)
    for layer in range(layers):
        ref = view_attention(q, q_pos, pieces, k_cache, v_cache, layer, head_dim ** -0.5, realigner)
        out = gathered_attention(q, view, k_cache, v_cache, layer, head_dim ** -0.5)
        assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()
        monkeypatch.setattr(vg, "QUERY_ROTATIONS", 0)             # the key-rotating path on the same view
        keyside = gathered_attention(q, view, k_cache, v_cache, layer, head_dim ** -0.5)
        monkeypatch.setattr(vg, "QUERY_ROTATIONS", 2 * view.q_cos.shape[0])
        assert torch.allclose(keyside, ref, atol=1e-5)
    # Not vacuous: the deltas matter.
    wrong = build_gathered([SegmentPiece(p.slots, p.positions, 0, p.deltas) if isinstance(p, SegmentPiece) else p
                        for p in pieces], realigner, torch.device("cpu"), torch.float32)
    assert not torch.allclose(gathered_attention(q, wrong, k_cache, v_cache, layer, head_dim ** -0.5), ref, atol=1e-3)


@pytest.mark.parametrize("tq", [1, 12])
def test_row_states_of_several_requests_are_joined_in_one_group(tq):
    """Small corrections kept as 8-bit rows (small_rows), from two requests with their own channel
    scales, share the identity group: their rows are dequantized together, each with its own channel
    scales, equal to reading them one by one; mixed with 4-bit rows they are read one by one. Both
    gather paths match view_attention."""
    head_dim, kv_heads, group, layers = 64, 3, 3, 3
    k_cache, v_cache, realigner, rows, dks = _three_segments(4, head_dim, kv_heads, layers)
    for d in dks:
        d[..., :3] *= 20.0                                   # large key channels
    first = compress_joint(dks[:2], [d.flip(-1) for d in dks[:2]], rows[:2], 40, Format(torch.int8, small_rows=True),
                           first_layer=1)
    second = compress(dks[2], dks[2].flip(-1), rows[2], 40, Format(torch.int8, small_rows=True), first_layer=1)
    states = first + [second]
    assert all(s.k.b is None and s.k.channel_scale is not None and s.v.row_scale is not None for s in states)
    assert first[0].k.channel_scale is first[1].k.channel_scale is not second.k.channel_scale
    pieces = [OwnPiece(torch.arange(0, 8), torch.arange(8))]
    for i, state in enumerate(states):
        pieces.append(SegmentPiece(torch.arange(100 + 20 * i, 120 + 20 * i), torch.arange(8 + 20 * i, 28 + 20 * i),
                                   5 - 4 * i, [state]))
    pieces.append(OwnPiece(torch.arange(250, 250 + tq), torch.arange(68, 68 + tq)))
    view = build_gathered(pieces, realigner, torch.device("cpu"), torch.float32)
    assert [len(st.groups) for st in view.stacks] == [1] and len(view.stacks[0].groups[0][0]) == 3
    for layer in range(layers):
        for side in (0, 2):
            us = view.stacks[0].groups[0][side]
            assert torch.equal(Coeffs.joined(us, layer), torch.cat([u.at(layer) for u in us], dim=1))
    q = torch.randn(tq, kv_heads * group, head_dim)
    for layer in range(layers):
        ref = view_attention(q, torch.arange(68, 68 + tq), pieces, k_cache, v_cache, layer, head_dim ** -0.5,
                             realigner)
        out = gathered_attention(q, view, k_cache, v_cache, layer, head_dim ** -0.5)
        assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()
    four = compress(dks[2], dks[2].flip(-1), rows[2], 40, Format(torch.int8, value_bits=4, key_bits=4), first_layer=1)
    mixed = [first[0].key_coeffs(), four.key_coeffs()]
    assert torch.equal(Coeffs.joined(mixed, 2), torch.cat([u.at(2) for u in mixed], dim=1))


@pytest.mark.parametrize("tq", [1, 12])
def test_row_states_starting_at_different_layers_keep_their_own_groups(tq):
    """Full-rank row states (identity bases) of two requests that leave out different leading layers
    (``uncorrected_energy``): each keeps its own group, so a layer only the later-starting state leaves
    out still gets the other one's rows. Before, they shared one group dated by its first member's
    first layer: that layer's corrections were dropped, and with no group active the gather of many
    queries failed (``torch.cat`` of no rows), the reproduction of a workflow whose replies repeat."""
    head_dim, kv_heads, group, layers = 64, 3, 3, 4
    k_cache, v_cache, realigner, rows, dks = _three_segments(6, head_dim, kv_heads, layers)
    later = compress(dks[0], dks[0].flip(-1), rows[0], 40, Format(torch.int8, small_rows=True), first_layer=2)
    earlier = compress(dks[1], dks[1].flip(-1), rows[1], 40, Format(torch.int8, small_rows=True), first_layer=1)
    assert later.k.b is None and earlier.k.b is None
    pieces = [OwnPiece(torch.arange(0, 8), torch.arange(8))]
    for i, state in enumerate([later, earlier]):
        pieces.append(SegmentPiece(torch.arange(100 + 20 * i, 120 + 20 * i), torch.arange(8 + 20 * i, 28 + 20 * i),
                                   3 - 2 * i, [state]))
    pieces.append(OwnPiece(torch.arange(250, 250 + tq), torch.arange(48, 48 + tq)))
    view = build_gathered(pieces, realigner, torch.device("cpu"), torch.float32)
    assert view.first_layer == 1
    assert sorted(f for st in view.stacks for f in st.firsts) == [1, 2]
    q = torch.randn(tq, kv_heads * group, head_dim)
    for layer in range(layers):
        ref = view_attention(q, torch.arange(48, 48 + tq), pieces, k_cache, v_cache, layer, head_dim ** -0.5,
                             realigner)
        out = gathered_attention(q, view, k_cache, v_cache, layer, head_dim ** -0.5)
        assert torch.allclose(out, ref, atol=1e-5), (layer, (out - ref).abs().max())
    k1, _ = gathered_kv(view, k_cache, v_cache, 1)        # only the earlier state stores layer 1
    plain1, _ = gathered_kv(view, k_cache, v_cache, 1, corrected=False)
    moved = (k1 - plain1).abs().sum((1, 2)) > 0
    assert moved.nonzero().flatten().tolist() == (rows[1] + 28).tolist()


@pytest.mark.parametrize("tq", [1, 5, 12])
def test_groups_stored_alike_are_read_together(tq):
    """Groups of a view that are stored alike are read together (one unpack of U, one read of the bases
    per layer), by few queries (low-rank terms) and by many (gathered rows): the engine's default
    factored storage over five requests' bases, starting at different layers, some moved by a pending
    shift, plus two groups of quantized rows. Same attention as view_attention in every layer."""
    torch.manual_seed(5)
    head_dim, kv_heads, group, layers = 64, 3, 3, 4
    k_cache, v_cache = torch.randn(600, kv_heads, head_dim), torch.randn(600, kv_heads, head_dim)
    inv, _ = inv_frequencies(head_dim, 10000.0, None, 4096)
    realigner = Realigner(inv.float())
    pieces, pos = [OwnPiece(torch.arange(0, 8), torch.arange(8))], 8
    storages = [(Format(torch.int8, int8_basis=True, u8=4, head_bits=6), f) for f in (1, 3, 1, 2, 1)]
    storages += [(Format(torch.int8, key_bits=6, value_bits=6), 1)] * 2
    for i, (fmt, first) in enumerate(storages):
        rows = [torch.sort(torch.randperm(20)[:12]).values, torch.sort(torch.randperm(16)[:9]).values]
        dks = [torch.randn(layers, kv_heads, r.numel(), head_dim) * 0.1 for r in rows]
        states = compress_joint(dks, [d.flip(-1) * 0.5 for d in dks], rows, 8, fmt, first_layer=first)
        if i % 2:
            states = [realigner.rotate_delta(s, 3 + i) for s in states]
        for s, n in zip(states, (20, 16)):
            pieces.append(SegmentPiece(torch.arange(100 + pos, 100 + pos + n), torch.arange(pos, pos + n),
                                       i - 2, [s]))
            pos += n
    pieces.append(OwnPiece(torch.arange(550, 550 + tq), torch.arange(pos, pos + tq)))
    q = torch.randn(tq, kv_heads * group, head_dim)
    view = build_gathered(pieces, realigner, torch.device("cpu"), torch.float32)
    assert sorted(len(st.groups) for st in view.stacks) == [2, 5]
    factored = next(st for st in view.stacks if len(st.groups) == 5)
    assert factored.firsts == [1, 1, 1, 2, 3] and factored.active(2) == 4 and factored.active(0) == 0
    for layer in range(layers):
        ref = view_attention(q, torch.arange(pos, pos + tq), pieces, k_cache, v_cache, layer, head_dim ** -0.5,
                             realigner)
        out = gathered_attention(q, view, k_cache, v_cache, layer, head_dim ** -0.5)
        assert torch.allclose(out, ref, atol=1e-5), (layer, (out - ref).abs().max())
    # Not vacuous: the corrections change the attention.
    plain = build_gathered([OwnPiece(p.slots, p.positions) if isinstance(p, OwnPiece) else
                        SegmentPiece(p.slots, p.positions, p.delta, []) for p in pieces], realigner,
                       torch.device("cpu"), torch.float32)
    assert not torch.allclose(gathered_attention(q, plain, k_cache, v_cache, 3, head_dim ** -0.5),
                              gathered_attention(q, view, k_cache, v_cache, 3, head_dim ** -0.5), atol=1e-4)


@pytest.mark.parametrize("rows_format", [False, True])
def test_a_kept_view_unpacks_each_layers_codes_once_and_reads_the_same(monkeypatch, rows_format):
    """A view kept for a request's decode (``keep``) unpacks its codes once per layer and side and keeps
    them as int8 (plain factors' codes, or quantized rows' codes with their scales); later decode steps
    read them back and give the same attention as a view that unpacks every time. The kept bytes are
    reported."""
    from dataclasses import replace

    from kvcmas_agents.reuse.storage import readers

    head_dim, kv_heads, group, layers = 64, 3, 3, 3
    k_cache, v_cache, realigner, rows, dks = _three_segments(4, head_dim, kv_heads, layers)
    if rows_format:           # keys and values as 4-bit rows (StorageSpec.key_bits / value_bits)
        states = [compress(dk, dk.flip(-1), r, 8, Format(torch.int8, value_bits=4, key_bits=4))
                  for dk, r in zip(dks, rows)]
    else:
        states = compress_joint(dks, [d.flip(-1) for d in dks], rows, 8, Format(torch.int8, int8_basis=True, u8=4))
    pieces = [OwnPiece(torch.arange(0, 8), torch.arange(8))]
    for i, state in enumerate(states):
        pieces.append(SegmentPiece(torch.arange(100 + 20 * i, 120 + 20 * i), torch.arange(8 + 20 * i, 28 + 20 * i),
                                   5 - 4 * i, [state]))
    once = build_gathered(pieces, realigner, torch.device("cpu"), torch.float32)
    kept = replace(build_gathered(pieces, realigner, torch.device("cpu"), torch.float32), keep=True)
    unpacks = []
    real = readers.Coeffs.exact_codes
    monkeypatch.setattr(readers.Coeffs, "exact_codes",
                        staticmethod(lambda us, layer: unpacks.append(layer) or real(us, layer)))
    for step in range(3):                       # three decode steps: the tail grows by one key each
        tail = OwnPiece(torch.arange(250, 251 + step), torch.arange(68, 69 + step))
        q = torch.randn(1, kv_heads * group, head_dim)
        for layer in range(layers):
            ref = view_attention(q, torch.tensor([68 + step]), pieces + [tail], k_cache, v_cache, layer,
                                 head_dim ** -0.5, realigner)
            a = gathered_attention(q, once.extend(tail.slots), k_cache, v_cache, layer, head_dim ** -0.5)
            b = gathered_attention(q, kept.extend(tail.slots), k_cache, v_cache, layer, head_dim ** -0.5)
            assert torch.allclose(a, ref, atol=1e-5) and torch.allclose(b, ref, atol=1e-5), (b - ref).abs().max()
        if step == 0:
            first = len(unpacks)
    # every layer unpacked in the first step, none again later
    assert set(unpacks) == set(range(layers)) and len(unpacks) == first == sum(len(st.unpacked) for st in kept.stacks)
    # a tail longer than LOWRANK_QUERY (the request's prefill) builds dense rows from the same kept codes,
    # bitwise what unpacking gives, and unpacks nothing again
    tail = OwnPiece(torch.arange(250, 262), torch.arange(68, 80))
    q = torch.randn(12, kv_heads * group, head_dim)
    joins: list[str] = []
    joined = readers.Coeffs.joined
    monkeypatch.setattr(readers.Coeffs, "joined", staticmethod(lambda *a, **kw: joins.append("") or joined(*a, **kw)))
    for layer in range(layers):
        a = gathered_attention(q, once.extend(tail.slots), k_cache, v_cache, layer, head_dim ** -0.5)
        unpacked_once, joins[:] = len(joins), []
        b = gathered_attention(q, kept.extend(tail.slots), k_cache, v_cache, layer, head_dim ** -0.5)
        assert torch.equal(a, b) and unpacked_once > 0 and not joins
    assert len(unpacks) == first
    values = [k.codes for st in kept.stacks for k in st.unpacked.values()]
    assert values and all(c.dtype == torch.int8 for c in values)
    assert all((k.scale is not None) == rows_format for st in kept.stacks for k in st.unpacked.values())
    assert kept.kept_bytes() >= sum(c.numel() for c in values) > 0 and once.kept_bytes() == 0
