"""The fast gather path equals the query-side view attention (the kernel's math) on random views."""
from __future__ import annotations

import pytest
import torch

from kvcmas_agents.engine.lowrank import compress
from kvcmas_agents.engine.realign import Realigner
from kvcmas_agents.engine.rope import inv_frequencies
from kvcmas_agents.engine.view_attention import OwnPiece, SegmentPiece, view_attention
from kvcmas_agents.engine.view_gather import build_view, gathered_attention


@pytest.mark.parametrize("head_dim, group, kv_heads, rank, tq", [
    (64, 3, 3, 16, 1), (64, 1, 2, 4, 5), (128, 4, 1, 0, 3), (64, 3, 3, 64, 7)])
def test_gather_path_matches_view_attention(head_dim, group, kv_heads, rank, tq):
    torch.manual_seed(0)
    layers, slots_total = 2, 400
    k_cache = torch.randn(slots_total, kv_heads, head_dim)
    v_cache = torch.randn(slots_total, kv_heads, head_dim)
    inv, _ = inv_frequencies(head_dim, 10000.0, None, 4096)
    realigner = Realigner(inv.float())
    perm = torch.randperm(slots_total)
    # own prefix [0,10), segment A [10,40) delta 7 with a chain of 2, segment B [40,60) delta -3 naive,
    # own tail [60, 60 + tq).
    def seg(start, n, delta, ndeltas):
        deltas = []
        for i in range(ndeltas):
            rows = torch.sort(torch.randperm(n)[: n // 3]).values
            dk = torch.randn(layers, kv_heads, rows.numel(), head_dim) * 0.1
            deltas.append(compress(dk, dk.flip(-1), rows, rank))
        return SegmentPiece(perm[100 + start:100 + start + n], torch.arange(start, start + n), delta, deltas)
    pieces = [OwnPiece(perm[:10], torch.arange(10)), seg(10, 30, 7, 2), seg(40, 20, -3, 0),
              OwnPiece(perm[60:60 + tq], torch.arange(60, 60 + tq))]
    q = torch.randn(tq, kv_heads * group, head_dim)
    view = build_view(pieces, realigner, torch.device("cpu"), torch.float32)
    for layer in range(layers):
        ref = view_attention(q, torch.arange(60, 60 + tq), pieces, k_cache, v_cache, layer, head_dim ** -0.5,
                             realigner)
        out = gathered_attention(q, view, k_cache, v_cache, layer, head_dim ** -0.5)
        assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()
    # Not vacuous: without realignment the result differs.
    plain = build_view([OwnPiece(p.slots, p.positions) for p in pieces], realigner, torch.device("cpu"),
                       torch.float32)
    assert not torch.allclose(gathered_attention(q, plain, k_cache, v_cache, 0, head_dim ** -0.5),
                              view_attention(q, torch.arange(60, 60 + tq), pieces, k_cache, v_cache, 0,
                                             head_dim ** -0.5, realigner), atol=1e-3)
