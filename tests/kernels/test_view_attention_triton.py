"""The Triton view-attention kernel against the torch oracle ``view_attention`` on random views.

Tolerances (max abs error, outputs are O(1)): fp32 1e-4; bf16 3e-2 (inputs and factors in bf16, the
oracle upcasts the same bf16 tensors to fp32; on a GPU the kernel's dots take bf16 operands).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvcmas_agents.reuse.storage.codec import compress  # noqa: E402
from kvcmas_agents.reuse.realign import Realigner  # noqa: E402
from kvcmas_agents.model.rope import inv_frequencies  # noqa: E402
from kvcmas_agents.reuse.views.reference import OwnPiece, SegmentPiece, view_attention  # noqa: E402
from kvcmas_agents.reuse.views.pack import pack_view, packed_attention  # noqa: E402
from kvcmas_agents.kernels.view_attention import view_attention_fwd  # noqa: E402
from kvcmas_agents.reuse.storage.codec import Format

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LAYERS = 2
ATOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def _scenario(dim, group, kv_heads, rank, rows_mode, chain, tq, dtype, seed, lengths=(6, 37, 23), factors=None,
              int8_basis=False, value_bits=0, key_bits=0, small_rows=False, u8=None):
    """Own prefix + two reused segments (deltas 13 and -4) + own tail whose last tq tokens query."""
    g = torch.Generator().manual_seed(seed)
    slots_total = 400
    k_cache = torch.randn(slots_total, kv_heads, dim, generator=g)
    v_cache = torch.randn(slots_total, kv_heads, dim, generator=g)
    perm = torch.randperm(slots_total, generator=g)             # scattered slots, like a paged store
    sizes = list(lengths) + [5 + tq]
    cuts = torch.tensor([0] + sizes).cumsum(0).tolist()
    slots = [perm[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    pos = [torch.arange(a, b) for a, b in zip(cuts[:-1], cuts[1:])]

    def state(n):
        rows = {"none": torch.zeros(0, dtype=torch.long), "all": torch.randperm(n, generator=g),
                "some": torch.randperm(n, generator=g)[: n // 3 + 1]}[rows_mode]
        dk = 0.5 * torch.randn(LAYERS, kv_heads, rows.numel(), dim, generator=g)
        dv = 0.5 * torch.randn(LAYERS, kv_heads, rows.numel(), dim, generator=g)
        return compress(dk, dv, rows, rank, Format(factors or dtype, int8_basis=int8_basis, value_bits=value_bits,
                                                   key_bits=key_bits, small_rows=small_rows, u8=u8))

    pieces = [OwnPiece(slots[0], pos[0])]
    for i, delta in enumerate((13, -4)):
        n = sizes[1 + i]
        pieces.append(SegmentPiece(slots[1 + i], pos[1 + i], delta, [state(n) for _ in range(chain)]))
    pieces.append(OwnPiece(slots[3], pos[3]))
    q = torch.randn(tq, kv_heads * group, dim, generator=g)
    inv, _ = inv_frequencies(dim, 10000.0, None, 4096)
    realigner = Realigner(inv.float())
    to = lambda t: t.to(DEV, dtype)  # noqa: E731
    pieces = [_to_device(p) for p in pieces]
    return to(q), pos[3][-tq:].to(DEV), pieces, to(k_cache), to(v_cache), dim ** -0.5, realigner


def _to_device(p):
    if isinstance(p, OwnPiece):
        return OwnPiece(p.slots.to(DEV), p.positions.to(DEV))
    return SegmentPiece(p.slots.to(DEV), p.positions.to(DEV), p.delta, [d.to(DEV) for d in p.deltas])


def _check(args, dtype, block_n, num_splits=None):
    q, qp, pieces, kc, vc, scale, realigner = args
    desc = pack_view(pieces, realigner, DEV, block_n=block_n)
    for layer in range(LAYERS):
        ref = view_attention(q, qp, pieces, kc, vc, layer, scale, realigner)
        out = view_attention_fwd(q, qp, kc, vc, desc, layer, scale, num_splits=num_splits)
        assert out.dtype == q.dtype and out.shape == q.shape
        err = (out.float() - ref.float()).abs().max().item()
        assert err <= ATOL[dtype], f"layer {layer}: max abs error {err}"
    return out


# Sparse cover: head_dim 64/128, GQA 1/3/4/8, ranks 0/4/16/32, rows none/some/all, chains 0..2,
# decode (tq=1) and prefill, block sizes that the lengths are not multiples of, fp32 and bf16.
CASES = [
    # dim, group, kv_heads, rank, rows, chain, tq, dtype, block_n
    (64, 1, 2, 0, "some", 1, 1, torch.float32, 16),
    (64, 3, 2, 4, "some", 2, 5, torch.float32, 16),
    (128, 4, 1, 16, "all", 1, 1, torch.float32, 32),
    (64, 8, 1, 32, "some", 2, 9, torch.float32, 16),
    (128, 3, 1, 4, "none", 2, 33, torch.float32, 64),
    (64, 1, 1, 16, "all", 2, 20, torch.float32, 16),
    (128, 1, 2, 16, "all", 2, 17, torch.bfloat16, 32),
    (64, 4, 2, 32, "some", 2, 1, torch.bfloat16, 16),
]


@pytest.mark.parametrize("dim,group,kv_heads,rank,rows,chain,tq,dtype,block_n", CASES)
def test_kernel_matches_oracle(dim, group, kv_heads, rank, rows, chain, tq, dtype, block_n):
    args = _scenario(dim, group, kv_heads, rank, rows, chain, tq, dtype, seed=dim + group + rank + tq)
    _check(args, dtype, block_n)


def test_split_kv_decode_matches_oracle():
    """Key tiles spread over several programs, merged by log-sum-exp (the GPU decode layout)."""
    args = _scenario(64, 4, 2, 16, "some", 2, 1, torch.float32, seed=3, lengths=(20, 70, 41))
    _check(args, torch.float32, 16, num_splits=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("int8_basis, u8", [(False, None), (True, None), (True, 4)])
def test_int8_factors_match_oracle(dtype, int8_basis, u8):
    """int8 correction storage: U in int8 with a bf16 B, or B in int8 too (with per-component scales),
    and with u8 U's last components as 4-bit codes (the default); the chain's first state owes a
    pending shift, as a predecessor's state moved here does."""
    q, qp, pieces, kc, vc, scale, realigner = _scenario(64, 3, 2, 16, "some", 2, 5, dtype, seed=11,
                                                        factors=torch.int8, int8_basis=int8_basis, u8=u8)
    seg = pieces[1]
    assert seg.deltas[0].k.u.dtype == torch.int8 and seg.deltas[0].k.tail4 == (8 if u8 else 0)
    assert seg.deltas[0].k.b.dtype == (torch.int8 if int8_basis else torch.bfloat16)
    pieces[1] = SegmentPiece(seg.slots, seg.positions, seg.delta,
                             [realigner.rotate_delta(seg.deltas[0], 9)] + seg.deltas[1:])
    _check((q, qp, pieces, kc, vc, scale, realigner), dtype, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
def test_value_rows_match_oracle(dtype, bits):
    """The default storage: int8 low-rank keys, values kept full rank as rows quantized per row (an
    identity B_v, read by the kernel as a rank-head_dim factor); the chain's first state owes a shift."""
    q, qp, pieces, kc, vc, scale, realigner = _scenario(64, 3, 2, 16, "some", 2, 5, dtype, seed=13,
                                                        factors=torch.int8, value_bits=bits)
    seg = pieces[1]
    assert seg.deltas[0].v.b is None and seg.deltas[0].value_coeffs().bits == bits
    pieces[1] = SegmentPiece(seg.slots, seg.positions, seg.delta,
                             [realigner.rotate_delta(seg.deltas[0], 9)] + seg.deltas[1:])
    _check((q, qp, pieces, kc, vc, scale, realigner), dtype, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_key_and_value_rows_match_oracle(dtype):
    """key_bits and value_bits: both sides full rank as 4-bit rows (keys with channel scales), read by
    the kernel as rank-head_dim factors of identity bases; the chain's first state owes a shift."""
    q, qp, pieces, kc, vc, scale, realigner = _scenario(64, 3, 2, 16, "some", 2, 5, dtype, seed=17,
                                                        factors=torch.int8, value_bits=4, key_bits=4)
    seg = pieces[1]
    keys = seg.deltas[0].k
    assert keys.b is None and seg.deltas[0].key_coeffs().bits == 4 and keys.channel_scale is not None
    pieces[1] = SegmentPiece(seg.slots, seg.positions, seg.delta,
                             [realigner.rotate_delta(seg.deltas[0], 9)] + seg.deltas[1:])
    _check((q, qp, pieces, kc, vc, scale, realigner), dtype, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_row_states_beside_factored_ones_match_oracle(dtype):
    """small_rows: a small correction's keys and values kept as 8-bit rows (keys with channel scales),
    chained before a factored state in the same view and owing a shift; the kernel pads both to one rank."""
    q, qp, pieces, kc, vc, scale, realigner = _scenario(64, 3, 2, 16, "some", 1, 5, dtype, seed=19,
                                                        factors=torch.int8, small_rows=True)
    small = pieces[1].deltas[0]
    assert small.k.b is None and small.v.b is None
    assert small.key_coeffs().bits == 8 and small.k.channel_scale is not None
    g = torch.Generator().manual_seed(3)
    rows = torch.arange(0, 37, 2)
    dk, dv = (0.5 * torch.randn(LAYERS, 2, rows.numel(), 64, generator=g) for _ in range(2))
    factored = compress(dk, dv, rows, 8, Format(torch.int8)).to(DEV)
    assert factored.k.b is not None
    seg = pieces[1]
    pieces[1] = SegmentPiece(seg.slots, seg.positions, seg.delta, [realigner.rotate_delta(small, 9), factored])
    _check((q, qp, pieces, kc, vc, scale, realigner), dtype, 16)


def test_corrections_and_realignment_matter():
    """Not vacuous: dropping the second correction or the realignment changes the kernel's output."""
    q, qp, pieces, kc, vc, scale, realigner = _scenario(64, 3, 2, 16, "some", 2, 4, torch.float32, seed=5)
    out = packed_attention(q, qp, pack_view(pieces, realigner, DEV, 16), kc, vc, 0, scale)
    variants = {
        "first correction only": [SegmentPiece(p.slots, p.positions, p.delta, p.deltas[:1])
                                  if isinstance(p, SegmentPiece) else p for p in pieces],
        "unrotated": [SegmentPiece(p.slots, p.positions, 0, p.deltas) if isinstance(p, SegmentPiece) else p
                      for p in pieces],
    }
    for name, other in variants.items():
        alt = packed_attention(q, qp, pack_view(other, realigner, DEV, 16), kc, vc, 0, scale)
        assert (alt - out).abs().max() > 1e-2, name


def test_query_before_every_key_gets_zeros():
    q, qp, pieces, kc, vc, scale, realigner = _scenario(64, 1, 2, 4, "some", 1, 2, torch.float32, seed=2)
    desc = pack_view(pieces, realigner, DEV, 16)
    early = view_attention_fwd(q, torch.tensor([-1, qp[-1].item()], device=DEV), kc, vc, desc, 0, scale)
    assert torch.equal(early[0], torch.zeros_like(early[0]))
    assert torch.isfinite(early).all()


def test_self_check_passes_and_catches_a_wrong_kernel(monkeypatch):
    import kvcmas_agents.reuse.views.pack as vp
    realigner = Realigner(inv_frequencies(64, 10000.0, None, 4096)[0])
    assert vp.self_check(realigner, 2, 6, 64, torch.device("cpu"), torch.float32) is None
    monkeypatch.setattr(vp, "packed_attention", lambda q, *a, **k: torch.zeros_like(q))
    assert "disagrees" in vp.self_check(realigner, 2, 6, 64, torch.device("cpu"), torch.float32)

    def boom(*a, **k):
        raise RuntimeError("no compiler")
    monkeypatch.setattr(vp, "packed_attention", boom)
    assert "kernel failed" in vp.self_check(realigner, 2, 6, 64, torch.device("cpu"), torch.float32)


def test_auto_falls_back_to_torch_and_says_why_when_the_self_check_fails(monkeypatch):
    import kvcmas_agents.reuse.views as views
    monkeypatch.setattr(views, "resolve_view_path", lambda path, device: "triton")   # as on a GPU
    monkeypatch.setattr(views, "self_check", lambda *a, **k: "kernel failed: RuntimeError('no ptxas')")
    cpu = torch.device("cpu")
    path, why = views.choose_view_path("auto", None, 2, 6, 64, cpu, torch.bfloat16)
    assert path == "gather" and "no ptxas" in why
    path, why = views.choose_view_path("triton", None, 2, 6, 64, cpu, torch.bfloat16)   # asked for: no check
    assert path == "triton" and why is None
