"""The compiled block products against torch on the weights the blocks define."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvcmas_agents.kernels import cbuild, cpu_quant
from kvcmas_agents.model.blocks import BlockWeight

pytestmark = pytest.mark.skipif(cpu_quant.load() is None, reason=str(cpu_quant.unavailable()))


def _weight(kind: str, n: int, k: int, seed: int) -> BlockWeight:
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half()
    if kind == "Q4_1":
        qs = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
        m = (-torch.rand(n, k // 32, generator=g) * 0.1).half()
        return BlockWeight(kind, qs, d, m, None)
    qs = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    return BlockWeight(kind, qs, d, None, None)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("k", [64, 576, 1536])
def test_products_match_the_expanded_weight(kind, rows, k):
    w = _weight(kind, 96, k, rows + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k))
    want = x.double() @ w.expand().double().t()
    got = w.product(x)
    assert got.shape == (rows, 96) and got.dtype == torch.float32
    # fp32 rounding of a sum of k products: bounded by its terms' magnitudes, not the result's
    bound = 2e-6 * (x.abs().double() @ w.expand().abs().double().t())
    assert ((got.double() - want).abs() <= bound).all(), ((got.double() - want).abs() / bound).max()


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 6])
def test_norm_and_glu_ride_along(kind, rows):
    """norm: the rows RMS-normalized and scaled first; glu: silu(gate) * up of the stacked weight."""
    w = _weight(kind, 2 * 80, 576, rows)
    g = torch.Generator().manual_seed(rows)
    x, scale = torch.randn(rows, 576, generator=g) * 3, torch.rand(576, generator=g) + 0.5
    normed = F.rms_norm(x, (576,), scale, 1e-5)
    full = normed @ w.expand().t()
    want = F.silu(full[:, :80]) * full[:, 80:]
    got = w.product(x, scale, 1e-5, glu=True)
    assert got.shape == (rows, 80)
    # to fp32 rounding of the sums, relative to the outputs' scale (silu(gate) * up cancels in places)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()
    assert (w.product(x, scale, 1e-5) - full).abs().max() <= 1e-5 * full.abs().max()


def test_the_portable_loops_give_what_the_vectorized_ones_give(monkeypatch, tmp_path):
    """The C loops a CPU without AVX-512 builds (forced here) compute the same products."""
    w, x = _weight("Q4_1", 64, 576, 7), torch.randn(3, 576, generator=torch.Generator().manual_seed(7))
    w8 = _weight("Q8_0", 64, 576, 8)
    fast, fast8 = w.product(x), w8.product(x)
    fast_int8 = [_int8(v).product(x) for v in (w, w8)]
    monkeypatch.setenv("KVCMAS_CACHE_DIR", str(tmp_path))
    portable = cbuild.CLibrary(cpu_quant.SOURCES, cpu_quant._SIGNATURES, "KVCMAS_NO_CPU_KERNEL", "CPU block kernel",
                               extra_flags=("-DKVQ_PORTABLE",))
    monkeypatch.setattr(cpu_quant, "LIB", portable)
    assert not cpu_quant.vectorized() and not cpu_quant.int8_vectorized()
    assert torch.allclose(w.product(x), fast, rtol=1e-5, atol=1e-5)
    assert torch.allclose(w8.product(x), fast8, rtol=1e-5, atol=1e-5)
    for v, want in zip((w, w8), fast_int8):      # the same integer sums; only the scaling's rounding differs
        assert torch.allclose(_int8(v).product(x), want, rtol=1e-5, atol=1e-5)


def _int8(w: BlockWeight) -> BlockWeight:
    return BlockWeight(w.kind, w.qs, w.d, w.m, w.dense, w.bias, int8=True)


def _int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 path sees it: each block of 32 rounded to int8 codes (x * 127 / max |x|, in fp32 as
    the kernel rounds them) times max |x| / 127."""
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    codes = torch.round(blocks * torch.where(amax > 0, 127 / amax, 0))
    return (codes.double() * (amax / 127).double()).view_as(x)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 4, 8])
@pytest.mark.parametrize("k", [64, 576, 1536])
def test_int8_rows_are_the_rows_rounded_to_int8_a_block(kind, rows, k):
    """The int8 path is exact but for x's rounding: x rounded a block, times the weight's d * q, plus (Q4_1)
    the minimums times x's own block sums; and within a few percent of the fp32 rows' product."""
    w = _weight(kind, 96, k, rows + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)) * 2
    expanded = w.expand().double()
    mins = torch.zeros_like(expanded) if w.m is None else w.m.double().repeat_interleave(32, dim=1)
    want = _int8_rows(x) @ (expanded - mins).t() + x.double() @ mins.t()
    got = _int8(w).product(x)
    bound = 2e-6 * (x.abs().double() @ expanded.abs().t())
    assert ((got.double() - want).abs() <= bound).all(), ((got.double() - want).abs() / bound).max()
    exact = x.double() @ expanded.t()
    assert (got.double() - exact).norm() / exact.norm() < 0.03
    assert not torch.equal(got, w.product(x))


def test_int8_takes_fp32_rows_where_blocks_do_not_pair():
    """The int8 loops take blocks two at a time; a K of an odd number of blocks keeps the fp32 rows."""
    w, x = _weight("Q4_1", 40, 96, 5), torch.randn(2, 96, generator=torch.Generator().manual_seed(5))
    assert torch.equal(_int8(w).product(x), w.product(x))


def test_an_int8_layer_tail_is_its_three_int8_products():
    g = torch.Generator().manual_seed(1)
    h, attn, scale = torch.randn(2, 576, generator=g), torch.randn(2, 576, generator=g), torch.rand(576, generator=g) + 0.5
    o, gate_up, down = (_int8(_weight("Q4_1", n, k, s)) for n, k, s in ((576, 576, 1), (2 * 1536, 576, 2), (576, 1536, 3)))
    mid = h + o.product(attn)
    want = mid + down.product(gate_up.product(mid, scale, 1e-5, glu=True))
    got = cpu_quant.layer_tail(h, attn, scale, 1e-5, o._ptrs, gate_up._ptrs, down._ptrs, 1536, int8=True)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_a_layer_tail_in_one_call_is_its_three_products():
    """o with the residual, then norm, gate/up and silu, then down with the residual: as three calls."""
    g = torch.Generator().manual_seed(0)
    h, attn, scale = torch.randn(3, 576, generator=g), torch.randn(3, 576, generator=g), torch.rand(576, generator=g) + 0.5
    o, gate_up, down = _weight("Q4_1", 576, 576, 1), _weight("Q4_1", 2 * 1536, 576, 2), _weight("Q4_1", 576, 1536, 3)
    mid = h + o.product(attn)
    want = mid + down.product(gate_up.product(mid, scale, 1e-5, glu=True))
    got = cpu_quant.layer_tail(h, attn, scale, 1e-5, o._ptrs, gate_up._ptrs, down._ptrs, 1536)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_threads_split_features_without_changing_them(monkeypatch):
    w, x = _weight("Q4_1", 200, 576, 3), torch.randn(2, 576, generator=torch.Generator().manual_seed(3))
    two = w.product(x)
    monkeypatch.setattr(cpu_quant.LIB, "threads", lambda: 1)
    assert torch.equal(w.product(x), two)        # each feature is one thread's sum, in one order
