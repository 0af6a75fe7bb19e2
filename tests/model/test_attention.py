import pytest
import torch
import torch.nn.functional as F

from kvcmas_agents.model.attention import SMALL_QUERY, rows_attention, sdpa


def _reference(q, k, v, scale):
    """Causal attention of the last len(q) positions, written out with expanded KV heads."""
    n, heads, _ = q.shape
    ctx, kvh, _ = k.shape
    k, v = k.repeat_interleave(heads // kvh, dim=1), v.repeat_interleave(heads // kvh, dim=1)
    mask = torch.arange(ctx) <= torch.arange(ctx - n, ctx).unsqueeze(1)
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          attn_mask=mask, scale=scale).transpose(0, 1)


@pytest.mark.parametrize("n", [1, 4, SMALL_QUERY, SMALL_QUERY + 1, 100])
@pytest.mark.parametrize("kvh", [1, 3])
def test_sdpa_matches_expanded_causal_attention_on_both_sides_of_the_small_query_path(n, kvh):
    torch.manual_seed(n + kvh)
    ctx, heads, d = 100, 9, 16
    q = torch.randn(n, heads, d)
    k, v = torch.randn(ctx, kvh, d), torch.randn(ctx, kvh, d)
    out = sdpa(q, k, v, d ** -0.5)
    assert out.shape == (n, heads, d)
    torch.testing.assert_close(out, _reference(q, k, v, d ** -0.5), atol=1e-5, rtol=1e-5)


def test_later_queries_see_more_keys():
    """A query must not see keys after its own position: changing the last key moves only the last row."""
    torch.manual_seed(0)
    q, k, v = torch.randn(4, 2, 8), torch.randn(10, 1, 8), torch.randn(10, 1, 8)
    a = sdpa(q, k, v, 0.3)
    k2, v2 = k.clone(), v.clone()
    k2[-1] += 5.0
    v2[-1] += 5.0
    b = sdpa(q, k2, v2, 0.3)
    torch.testing.assert_close(a[:3], b[:3])
    assert not torch.allclose(a[3], b[3])


@pytest.mark.parametrize("chunk", [1, 5, 256])
def test_rows_attention_matches_one_full_mask_whatever_the_chunking(chunk):
    """Rows at scattered positions see every key up to their own position, chunked or not, in any order."""
    torch.manual_seed(3)
    ctx, n = 40, 17
    q, k, v = torch.randn(n, 6, 8), torch.randn(ctx, 2, 8), torch.randn(ctx, 2, 8)
    pos = torch.randperm(ctx)[:n]
    pos[:8] = pos[:8].sort().values
    visible = torch.arange(ctx).unsqueeze(0) <= pos.unsqueeze(1)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=visible, scale=0.3, enable_gqa=True).transpose(0, 1)
    out = rows_attention(q, k, v, pos, 0.3, chunk=chunk)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert rows_attention(q[:0], k, v, pos[:0], 0.3).shape == (0, 6, 8)


def test_rows_attention_in_bf16_is_close_to_fp32_and_returns_fp32():
    """``dtype`` rounds the inputs (the kernel sums in fp32): a few parts in a thousand, not the same."""
    torch.manual_seed(4)
    ctx, n = 300, 90
    q, k, v = torch.randn(n, 9, 64), torch.randn(ctx, 3, 64), torch.randn(ctx, 3, 64)
    pos = torch.randperm(ctx)[:n].sort().values
    ref = rows_attention(q, k, v, pos, 0.125)
    out = rows_attention(q, k, v, pos, 0.125, dtype=torch.bfloat16)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert not torch.equal(out, ref)
    torch.testing.assert_close(out, ref, rtol=0, atol=3e-2)
    assert rows_attention(q, k, v, pos, 0.125, dtype=torch.float32).equal(ref)
