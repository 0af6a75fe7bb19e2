"""Attention over a corrected view against a materialized oracle, and against sdpa on the real model."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvcmas_agents.model.attention import sdpa
from kvcmas_agents.cache.kv_store import KVStore
from kvcmas_agents.model.loader import load_model
from kvcmas_agents.reuse.storage.codec import compress
from kvcmas_agents.reuse.storage.compose import apply_to
from kvcmas_agents.reuse.storage.delta import LowRankDelta
from kvcmas_agents.model.llama import LlamaModel
from kvcmas_agents.reuse.realign import Realigner
from kvcmas_agents.model.rope import inv_frequencies
from kvcmas_agents.reuse.views.reference import OwnPiece, SegmentPiece, view_attention
from kvcmas_agents.reuse.storage.codec import Format

CPU = torch.device("cpu")
LAYERS = 2
CHECKED_LAYERS = 8


def oracle(q, q_positions, pieces, k_cache, v_cache, layer, scale, realigner):
    """Materialize every piece's K/V (realigned + corrected), then masked SDPA; also per-key mass."""
    ks, vs, pos = [], [], []
    for p in pieces:
        k, v = k_cache[p.slots], v_cache[p.slots]
        if isinstance(p, SegmentPiece):
            k = realigner.rotate_keys(k, p.delta)
            k, v = apply_to(k, v, p.deltas, layer)
        ks.append(k)
        vs.append(v)
        pos.append(p.positions)
    k, v, pos = torch.cat(ks), torch.cat(vs), torch.cat(pos)
    mask = pos.unsqueeze(0) <= q_positions.unsqueeze(1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale, enable_gqa=True).transpose(0, 1)
    group = q.shape[1] // k.shape[1]
    scores = torch.einsum("thd,shd->hts", q, k.repeat_interleave(group, dim=1)) * scale
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return out, probs.sum(dim=(0, 1))


def _state(nrows_seg: int, rows: torch.Tensor, rank: int, kv_heads: int, dim: int, g) -> LowRankDelta:
    dk = 0.5 * torch.randn(LAYERS, kv_heads, rows.numel(), dim, generator=g)
    dv = 0.5 * torch.randn(LAYERS, kv_heads, rows.numel(), dim, generator=g)
    assert rows.numel() == 0 or rows.max() < nrows_seg
    if rank == "rows4":                     # low-rank keys, values as 4-bit quantized rows (identity basis)
        return compress(dk, dv, rows, 16, Format(torch.int8, value_bits=4))
    return compress(dk, dv, rows, rank)


def _scenario(dim, group, kv_heads, rank, rows_mode, chain, tq, seed):
    """Prefix (own) + two reused segments at shifted positions + own tail; queries at the tail's end."""
    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    slots_total = 200
    k_cache = torch.randn(slots_total, kv_heads, dim, generator=g)
    v_cache = torch.randn(slots_total, kv_heads, dim, generator=g)
    perm = torch.randperm(slots_total, generator=g)         # scattered slots, like a paged store
    lengths = [6, 11, 9, 5 + tq]                            # prefix, seg A, seg B, own tail (incl. queries)
    cuts = torch.tensor([0] + lengths).cumsum(0).tolist()
    slots = [perm[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    positions = [torch.arange(a, b) for a, b in zip(cuts[:-1], cuts[1:])]
    seg_deltas = [13, -4]                                   # home positions differ from these positions
    pieces = [OwnPiece(slots[0], positions[0])]
    for i, delta in enumerate(seg_deltas):
        n = lengths[1 + i]
        if rows_mode == "none":
            rows = torch.zeros(0, dtype=torch.long)
        elif rows_mode == "all":
            rows = torch.randperm(n, generator=g)
        else:
            rows = torch.randperm(n, generator=g)[: n // 3 + 1]
        chain_states = [_state(n, rows, rank, kv_heads, dim, g)]
        if chain:
            rows2 = torch.randperm(n, generator=g)[: n // 2]      # overlaps the first state's rows
            chain_states.append(_state(n, rows2, rank, kv_heads, dim, g))
        pieces.append(SegmentPiece(slots[1 + i], positions[1 + i], delta, chain_states))
    pieces.append(OwnPiece(slots[3], positions[3]))
    q_positions = positions[3][-tq:]
    q = torch.randn(tq, heads, dim, generator=g)
    inv, _ = inv_frequencies(dim, 10000.0, None, 4096)
    return q, q_positions, pieces, k_cache, v_cache, dim ** -0.5, Realigner(inv.float())


@pytest.mark.parametrize("dim,group,kv_heads", [(64, 1, 2), (128, 3, 2), (64, 4, 1)])
@pytest.mark.parametrize("rank", [0, 4, 16, "rows4"])
@pytest.mark.parametrize("rows_mode", ["none", "some", "all"])
@pytest.mark.parametrize("tq", [1, 4])
def test_matches_materialized_oracle(dim, group, kv_heads, rank, rows_mode, tq):
    args = _scenario(dim, group, kv_heads, rank, rows_mode, chain=False, tq=tq,
                     seed=dim + group + (rank if isinstance(rank, int) else 99) + tq)
    for layer in range(LAYERS):
        out, mass = view_attention(*args[:5], layer, *args[5:], return_mass=True)
        ref_out, ref_mass = oracle(*args[:5], layer, *args[5:])
        assert out.shape == args[0].shape
        torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.cat(mass), ref_mass, rtol=0, atol=1e-5)
        assert [m.numel() for m in mass] == [p.slots.numel() for p in args[2]]
        # Every query's probabilities sum to one, so the total mass is heads * queries.
        assert torch.cat(mass).sum().item() == pytest.approx(args[0].shape[0] * args[0].shape[1], rel=1e-5)


@pytest.mark.parametrize("tq", [1, 3])
@pytest.mark.parametrize("rank", [4, 16])
def test_chain_of_two_deltas(tq, rank):
    args = _scenario(64, 3, 2, rank, "some", chain=True, tq=tq, seed=7 + tq)
    out = view_attention(*args[:5], 1, *args[5:])
    ref, _ = oracle(*args[:5], 1, *args[5:])
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    # The second state matters: dropping it changes the result.
    q, qp, pieces, kc, vc, scale, realigner = args
    first_only = [SegmentPiece(p.slots, p.positions, p.delta, p.deltas[:1]) if isinstance(p, SegmentPiece)
                  else p for p in pieces]
    assert not torch.allclose(view_attention(q, qp, first_only, kc, vc, 1, scale, realigner), out, atol=1e-3)


def test_corrections_and_realignment_change_the_output():
    """Guards against a vacuous oracle match: naive reuse and unrotated keys really differ."""
    q, qp, pieces, kc, vc, scale, realigner = _scenario(64, 3, 2, 16, "all", False, 4, seed=1)
    out = view_attention(q, qp, pieces, kc, vc, 0, scale, realigner)
    naive = [SegmentPiece(p.slots, p.positions, p.delta) if isinstance(p, SegmentPiece) else p for p in pieces]
    unrotated = [SegmentPiece(p.slots, p.positions, 0, p.deltas) if isinstance(p, SegmentPiece) else p
                 for p in pieces]
    assert not torch.allclose(view_attention(q, qp, naive, kc, vc, 0, scale, realigner), out, atol=1e-3)
    assert not torch.allclose(view_attention(q, qp, unrotated, kc, vc, 0, scale, realigner), out, atol=1e-3)


def test_causal_mask_by_logical_position():
    """A prefill query sees its own piece only up to itself; later keys get exactly zero mass."""
    q, qp, pieces, kc, vc, scale, realigner = _scenario(64, 1, 2, 4, "some", False, 4, seed=2)
    _, mass = view_attention(q, qp, pieces, kc, vc, 0, scale, realigner, return_mass=True)
    tail = pieces[-1]
    assert (mass[-1][tail.positions > qp[-1]] == 0).all()
    # Query positions are the last four of the tail: the last key is seen by one query only.
    first_q_only = view_attention(q[:1], qp[:1], pieces, kc, vc, 0, scale, realigner)
    full = view_attention(q, qp, pieces, kc, vc, 0, scale, realigner)
    torch.testing.assert_close(first_q_only, full[:1], rtol=0, atol=1e-6)
    # A query before every key sees nothing and gets zeros, not NaN.
    early = view_attention(q[:1], torch.tensor([-1]), pieces, kc, vc, 0, scale, realigner)
    assert torch.equal(early, torch.zeros_like(early))


def test_missing_realigner_and_bad_heads_raise():
    q, qp, pieces, kc, vc, scale, _ = _scenario(64, 1, 2, 4, "some", False, 1, seed=3)
    with pytest.raises(ValueError, match="realigner"):
        view_attention(q, qp, pieces, kc, vc, 0, scale)
    with pytest.raises(ValueError, match="multiple"):
        view_attention(q[:, :1], qp, pieces, kc, vc, 0, scale, Realigner(torch.ones(32)))


# ------------------------------------------------------------------------------------ real model


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    loaded = load_model(None, device="cpu", dtype="float32")
    return LlamaModel(loaded.args, loaded.weights, max_positions=512)


class CheckedAttention:
    """Writes K/V to a paged store, answers with sdpa, and records view_attention's deviation per layer."""

    def __init__(self, store: KVStore, slots: torch.Tensor, start: int, split: int, scale: float):
        self.store, self.slots, self.start, self.split, self.scale = store, slots, start, split, scale
        self.max_diff: list[float] = []

    def __call__(self, layer, q, k, v):
        end = self.start + q.shape[0]
        self.store.write(layer, self.slots[self.start:end], k, v)
        kc, vc = self.store.k[layer], self.store.v[layer]
        gather = self.slots[:end]
        ref = sdpa(q, kc[gather], vc[gather], self.scale)
        positions = torch.arange(end)
        pieces = [SegmentPiece(gather[:self.split], positions[:self.split], 0, []),
                  OwnPiece(gather[self.split:], positions[self.split:])]
        out = view_attention(q, positions[self.start:end], pieces, kc, vc, layer, self.scale, None)
        self.max_diff.append((out - ref).abs().max().item())
        return ref


def _run_layers(model: LlamaModel, ids: torch.Tensor, positions: torch.Tensor, attn, layers: int) -> None:
    h = model.embed(ids)
    for i in range(layers):
        h = model.layer(i, h, positions, attn)


def test_segment_at_same_positions_equals_sdpa_on_real_model(model):
    """delta 0 and no corrections over the sequence's own KV: same as exact attention, layer by layer.

    The first CHECKED_LAYERS layers keep the test fast (weights page in lazily) while covering
    context-dependent K/V from layer 1 on.
    """
    a = model.args
    store = KVStore(a.num_layers, a.num_kv_heads, a.head_dim, 16, 8 << 20, CPU, torch.float32)
    blocks = [store.allocate() for _ in range(3)][::-1]      # out-of-order blocks: scattered slots
    slots = store.slots(blocks, 0, 40)
    torch.manual_seed(0)
    ids = torch.randint(0, a.vocab_size, (31,))
    with torch.inference_mode():
        prefill = CheckedAttention(store, slots, 0, 18, model.scale)
        _run_layers(model, ids[:30], torch.arange(30), prefill, CHECKED_LAYERS)
        decode = CheckedAttention(store, slots, 30, 18, model.scale)
        _run_layers(model, ids[30:], torch.tensor([30]), decode, CHECKED_LAYERS)
    assert len(prefill.max_diff) == len(decode.max_diff) == CHECKED_LAYERS
    assert max(prefill.max_diff) < 1e-5, prefill.max_diff
    assert max(decode.max_diff) < 1e-5, decode.max_diff


def test_realigned_segment_on_real_model_layer_0(model):
    """Home KV computed at other positions, reused with its delta, equals exact attention at layer 0."""
    torch.manual_seed(1)
    ids = torch.randint(0, model.args.vocab_size, (20,))
    h = model.embed(ids)
    home_start, seg = 50, slice(4, 14)
    positions = torch.arange(20)
    with torch.inference_mode():
        q, k, v = model.qkv(0, h, positions)
        _, k_home, v_home = model.qkv(0, h[seg], torch.arange(home_start, home_start + 10))
    # Cache: the sequence's own rows, then the home view of the segment in separate slots.
    k_cache, v_cache = torch.cat([k, k_home]), torch.cat([v, v_home])
    pieces = [OwnPiece(torch.arange(0, 4), positions[:4]),
              SegmentPiece(torch.arange(20, 30), positions[seg], 4 - home_start),
              OwnPiece(torch.arange(14, 20), positions[14:])]
    realigner = Realigner.from_rope(model.rope)
    out = view_attention(q[14:], positions[14:], pieces, k_cache, v_cache, 0, model.scale, realigner)
    ref = sdpa(q[14:], k, v, model.scale)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-4)
    naive = [pieces[0], SegmentPiece(torch.arange(20, 30), positions[seg], 0), pieces[2]]
    assert (view_attention(q[14:], positions[14:], naive, k_cache, v_cache, 0, model.scale) - ref).abs().max() > 1e-3
