"""Correction states and their codec: SVD reconstruction, Eckart-Young error, quantized full-rank rows, byte counts,
chaining (compose, apply_to)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvcmas_agents.reuse.storage.codec import Format, compress, compress_joint, rows_are_smaller
from kvcmas_agents.reuse.storage.compose import apply_to, compose
from kvcmas_agents.reuse.storage.delta import DeltaSide, LowRankDelta, unique_nbytes
from kvcmas_agents.reuse.storage.readers import Coeffs

L, KVH, D = 3, 2, 16


def _devs(nrows: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(L, KVH, nrows, D, generator=g, dtype=dtype),
            torch.randn(L, KVH, nrows, D, generator=g, dtype=dtype))


def _dense_all(state: LowRankDelta) -> tuple[torch.Tensor, torch.Tensor]:
    ks, vs = zip(*(state.dense(layer) for layer in range(state.k.u.shape[0])))
    return torch.stack(ks), torch.stack(vs)


@pytest.mark.parametrize("nrows,rank", [(10, 10), (10, 16), (40, 16), (40, 64), (1, 3)])
def test_full_rank_reconstructs_exactly(nrows, rank):
    dk, dv = _devs(nrows)
    rows = torch.randperm(100)[:nrows]
    state = compress(dk, dv, rows, rank)
    assert state.rank == min(rank, nrows, D)
    assert state.k.u.shape == (L, KVH, nrows, state.rank) and state.k.b.shape == (L, KVH, state.rank, D)
    assert torch.equal(state.rows, rows)
    k, v = _dense_all(state)
    torch.testing.assert_close(k, dk, rtol=0, atol=1e-5)
    torch.testing.assert_close(v, dv, rtol=0, atol=1e-5)


@pytest.mark.parametrize("rank", [0, 1, 4, 8])
def test_truncation_error_is_the_discarded_energy(rank):
    """Eckart-Young: ||D - D_r||_F^2 equals the sum of the discarded squared singular values."""
    dk, dv = _devs(24, seed=rank)
    state = compress(dk, dv, torch.arange(24), rank)
    k, v = _dense_all(state)
    for approx, exact in ((k, dk), (v, dv)):
        s2 = torch.linalg.svdvals(exact).pow(2)
        err = (exact - approx).pow(2).sum(dim=(-2, -1))
        torch.testing.assert_close(err, s2[..., rank:].sum(-1), rtol=1e-4, atol=1e-4)
        assert (err > 0).all()
        # No other rank-r matrix does better than the truncated SVD; a perturbed one is worse.
        worse = (exact - approx * 1.01).pow(2).sum(dim=(-2, -1))
        if rank:
            assert (worse > err).all()


def test_low_rank_input_is_recovered_at_its_rank():
    g = torch.Generator().manual_seed(3)
    true = torch.randn(L, KVH, 30, 4, generator=g) @ torch.randn(L, KVH, 4, D, generator=g)
    state = compress(true, true.clone(), torch.arange(30), rank=4)
    torch.testing.assert_close(_dense_all(state)[0], true, rtol=0, atol=1e-4)


def test_nbytes_is_exact():
    dk, dv = _devs(12, dtype=torch.float16)
    state = compress(dk, dv, torch.arange(12), rank=5)
    assert state.k.u.dtype == torch.float16
    expected = 12 * 8 + 2 * (L * KVH * 12 * 5 * 2) + 2 * (L * KVH * 5 * D * 2)
    assert state.nbytes == expected
    wide = compress(dk, dv, torch.arange(12), rank=5, fmt=Format(torch.float32))
    assert wide.nbytes == 12 * 8 + 2 * (expected - 12 * 8)
    assert compress(dk, dv, torch.arange(12), rank=0).nbytes == 12 * 8


def test_empty_rows_and_zero_rank():
    dk, dv = _devs(0)
    state = compress(dk, dv, torch.zeros(0, dtype=torch.long), rank=16)
    assert state.num_rows == 0 and state.rank == 0
    assert state.nbytes == 0
    k_ref, v_ref = torch.randn(7, KVH, D), torch.randn(7, KVH, D)
    k, v = apply_to(k_ref, v_ref, [state], layer=1)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    assert k is not k_ref
    dk_l, dv_l = state.dense(0)
    assert dk_l.shape == (KVH, 0, D) and dv_l.shape == (KVH, 0, D)
    empty = LowRankDelta.empty(L, KVH, D)
    assert empty.nbytes == 0 and empty.dense(2)[0].shape == (KVH, 0, D)
    # Rank 0 over real rows corrects nothing.
    dk, dv = _devs(5)
    zero = compress(dk, dv, torch.arange(5), rank=0)
    assert torch.equal(apply_to(k_ref, v_ref, [zero], 0)[0], k_ref)


def test_apply_to_adds_rows_and_leaves_the_rest():
    dk, dv = _devs(4)
    rows = torch.tensor([6, 0, 3, 5])
    state = compress(dk, dv, rows, rank=D)
    k_ref, v_ref = torch.randn(8, KVH, D), torch.randn(8, KVH, D)
    for layer in range(L):
        k, v = apply_to(k_ref, v_ref, [state], layer)
        torch.testing.assert_close(k[rows], k_ref[rows] + dk[layer].transpose(0, 1), rtol=0, atol=1e-5)
        torch.testing.assert_close(v[rows], v_ref[rows] + dv[layer].transpose(0, 1), rtol=0, atol=1e-5)
        untouched = torch.tensor([1, 2, 4, 7])
        assert torch.equal(k[untouched], k_ref[untouched]) and torch.equal(v[untouched], v_ref[untouched])


@pytest.mark.parametrize("rows_b", [[1, 2, 3], [4, 9], [9, 1, 0, 5]])
def test_compose_equals_sequential_application(rows_b):
    a = compress(*_devs(4, seed=1), torch.tensor([0, 1, 5, 7]), rank=3)
    b = compress(*_devs(len(rows_b), seed=2), torch.tensor(rows_b), rank=2)
    k_ref, v_ref = torch.randn(10, KVH, D), torch.randn(10, KVH, D)
    both = compose([a, b])
    assert torch.equal(both.rows, torch.tensor(sorted(set([0, 1, 5, 7] + rows_b))))
    assert both.rank == a.rank + b.rank
    for layer in range(L):
        k1, v1 = apply_to(*apply_to(k_ref, v_ref, [a], layer), [b], layer)
        kc, vc = apply_to(k_ref, v_ref, [both], layer)
        kl, vl = apply_to(k_ref, v_ref, [a, b], layer)
        torch.testing.assert_close(kc, k1, rtol=0, atol=1e-5)
        torch.testing.assert_close(vc, v1, rtol=0, atol=1e-5)
        torch.testing.assert_close(kl, k1, rtol=0, atol=1e-5)
        assert not torch.allclose(k1, apply_to(k_ref, v_ref, [a], layer)[0])
    # Recompressing at full rank stays exact; a low rank cap is lossy but keeps the union of rows.
    capped_full = compose([a, b], rank=D)
    torch.testing.assert_close(apply_to(k_ref, v_ref, [capped_full], 1)[0], apply_to(k_ref, v_ref, [both], 1)[0],
                               rtol=0, atol=1e-5)
    capped = compose([a, b], rank=1)
    assert capped.rank == 1 and torch.equal(capped.rows, both.rows)
    assert not torch.allclose(apply_to(k_ref, v_ref, [capped], 1)[0], apply_to(k_ref, v_ref, [both], 1)[0],
                              atol=1e-3)


def test_invalid_inputs_raise():
    dk, dv = _devs(3)
    with pytest.raises(ValueError, match="unique"):
        compress(dk, dv, torch.tensor([1, 1, 2]), rank=2)
    with pytest.raises(ValueError, match="rows"):
        compress(dk, dv, torch.tensor([1, 2]), rank=2)
    with pytest.raises(ValueError):
        compress(dk, dv[:, :, :2], torch.arange(3), rank=2)
    with pytest.raises(ValueError):
        LowRankDelta(torch.arange(2), DeltaSide(torch.zeros(L, KVH, 3, 1), torch.zeros(L, KVH, 1, D)),
                     DeltaSide(torch.zeros(L, KVH, 3, 1), torch.zeros(L, KVH, 1, D)))
    with pytest.raises(ValueError):
        compose([])


def test_joint_basis_is_shared_reconstructs_at_full_rank_and_is_counted_once():
    parts = [_devs(n) for n in (5, 3, 7)]
    rows = [torch.tensor([0, 2, 4, 6, 8]), torch.tensor([1, 2, 3]), torch.arange(7)]   # per-segment rows
    states = compress_joint([p[0] for p in parts], [p[1] for p in parts], rows, rank=D)
    assert [torch.equal(s.rows, r) for s, r in zip(states, rows)] == [True] * 3
    assert states[0].k.b is states[1].k.b is states[2].k.b                     # one basis for all
    for s, (dk, dv) in zip(states, parts):
        for layer in range(L):
            rk, rv = s.dense(layer)
            torch.testing.assert_close(rk, dk[layer], rtol=0, atol=1e-4)
            torch.testing.assert_close(rv, dv[layer], rtol=0, atol=1e-4)
    shared = states[0].k.b.numel() * 4 + states[0].v.b.numel() * 4
    assert unique_nbytes(states) == sum(s.nbytes for s in states) - 2 * shared
    assert unique_nbytes(states, bases_only=True) == shared
    # At a low rank the joint basis costs less than one basis per segment.
    low = compress_joint([p[0] for p in parts], [p[1] for p in parts], rows, rank=2)
    apart = [compress(dk, dv, r, rank=2) for (dk, dv), r in zip(parts, rows)]
    assert unique_nbytes(low) < unique_nbytes(apart)
    with pytest.raises(ValueError):
        compress_joint([], [], [], rank=2)


def test_int8_factors_quantize_u_and_b_per_component_with_one_scale():
    """int8 storage: U in one byte per entry, its per-component scales folded into a bf16 B; with
    int8_basis B is quantized too, so one fp32 scale per component is left, and U_q @ (s * B_q)
    reconstructs the float factors to within the rounding of both."""
    dk, dv = _devs(40, seed=3)
    rows = torch.arange(40)
    ref = compress(dk, dv, rows, rank=8, fmt=Format(torch.float32))
    u8 = compress(dk, dv, rows, rank=8, fmt=Format(torch.int8))
    assert u8.k.u.dtype == torch.int8 and u8.k.b.dtype == torch.bfloat16 and u8.k.basis_scale is None
    assert u8.nbytes == rows.nbytes + 2 * (u8.k.u.numel() + 2 * u8.k.b.numel())
    for layer in range(L):
        for got, want in zip(u8.dense(layer), ref.dense(layer)):
            assert 0 < (got - want).norm() / want.norm() < 0.02
    q = compress(dk, dv, rows, rank=8, fmt=Format(torch.int8, int8_basis=True))
    assert {t.dtype for t in (q.k.u, q.v.u, q.k.b, q.v.b)} == {torch.int8}
    assert q.k.basis_scale.shape == q.v.basis_scale.shape == (L, KVH, 8, 1) and q.k.basis_scale.dtype == torch.float32
    assert q.k.u.abs().amax(dim=-2).min() == 127          # every component uses the full int8 range
    assert q.k.b.abs().amax(dim=-1).min() == 127
    assert q.nbytes == rows.nbytes + 2 * (q.k.u.numel() + q.k.b.numel() + 4 * q.k.basis_scale.numel())
    assert unique_nbytes([q], bases_only=True) == 2 * (q.k.b.numel() + 4 * q.k.basis_scale.numel())
    for layer in range(L):
        for got, want in zip(q.dense(layer), ref.dense(layer)):
            err = (got.float() - want).norm() / want.norm()
            assert 0 < err < 0.02
    with pytest.raises(ValueError, match="scales"):
        LowRankDelta(q.rows, DeltaSide(q.k.u, q.k.b), q.v)      # int8 B without its scales
    # Composing int8 states at a capped rank stays int8; empty rows still work.
    assert compose([q, q], rank=4).k.u.dtype == compose([q, q], rank=4).k.b.dtype == torch.int8
    empty = compress(dk[:, :, :0], dv[:, :, :0], torch.zeros(0, dtype=torch.long), rank=8, fmt=Format(torch.int8))
    assert empty.num_rows == 0 and empty.k.u.dtype == torch.int8


@pytest.mark.parametrize("bits", [4, 8])
def test_value_rows_are_kept_full_rank_without_a_basis(bits):
    """value_bits: the keys are factored, the value rows are the deviation itself quantized per row
    (B_v is the identity and holds no bytes); a joint basis splits them per segment."""
    dk, dv = _devs(30)
    rows = torch.arange(0, 60, 2)
    state = compress(dk, dv, rows, 4, Format(torch.int8, value_bits=bits))
    assert state.v.b is None and state.value_basis().plain_identity and state.value_coeffs().bits == bits
    assert state.value_coeffs().rank == D and state.key_coeffs().rank == 4 and state.rank == D
    got_v = _dense_all(state)[1]
    rel = ((got_v - dv).norm() / dv.norm()).item()
    assert rel < (0.12 if bits == 4 else 0.006), rel
    codes = L * KVH * 30 * D * bits // 8
    k_bytes = L * KVH * 30 * 4 + L * KVH * 4 * D * 2       # int8 U_k, bf16 B_k
    assert state.nbytes == k_bytes + codes + L * KVH * 30 * 2 + rows.numel() * 8
    assert unique_nbytes([state], bases_only=True) == L * KVH * 4 * D * 2
    parts = compress_joint([dk[:, :, :10], dk[:, :, 10:]], [dv[:, :, :10], dv[:, :, 10:]], [rows[:10], rows[10:]], 4,
                           Format(torch.int8, value_bits=bits))
    assert all(p.v.b is None and p.v.row_scale.shape[2] == p.num_rows for p in parts)
    assert torch.equal(torch.cat([_dense_all(p)[1] for p in parts], 2), got_v)
    again = compose([state], rank=4)                      # recompressed in the same form
    assert again.v.b is None and again.value_coeffs().bits == bits
    with pytest.raises(ValueError, match="row scales"):
        LowRankDelta(rows, state.k, DeltaSide(state.v.u))
    with pytest.raises(ValueError, match="B factors"):
        LowRankDelta(rows, DeltaSide(state.k.u), state.v)


@pytest.mark.parametrize("bits", [4, 8])
def test_key_rows_are_kept_full_rank_with_channel_scales(bits):
    """key_bits: the key rows are the deviation itself, each channel divided by its scale (one bf16
    [L, KVH, 1, D] shared by a joint basis's segments) and each row by its own; no B_k, no SVD."""
    dk, dv = _devs(30)
    dk[..., :2] *= 30.0                                  # large channels, as keys have
    rows = torch.arange(0, 60, 2)
    state = compress(dk, dv, rows, 4, Format(torch.int8, value_bits=bits, key_bits=bits))
    assert state.k.b is None and state.v.b is None and state.key_basis().plain_identity
    assert state.key_coeffs().bits == bits and state.k.channel_scale.shape == (L, KVH, 1, D)
    assert state.v.channel_scale is None
    got_k, got_v = _dense_all(state)
    small = slice(2, None)
    rel = ((got_k - dk)[..., small].norm() / dk[..., small].norm()).item()
    assert rel < (0.2 if bits == 4 else 0.01), rel
    codes = L * KVH * 30 * D * bits // 8
    assert state.nbytes == 2 * (codes + L * KVH * 30 * 2) + L * KVH * D * 2 + rows.numel() * 8
    assert unique_nbytes([state], bases_only=True) == L * KVH * D * 2      # the channel scales
    parts = compress_joint([dk[:, :, :10], dk[:, :, 10:]], [dv[:, :, :10], dv[:, :, 10:]], [rows[:10], rows[10:]], 4,
                           Format(torch.int8, value_bits=bits, key_bits=bits))
    assert parts[0].k.channel_scale is parts[1].k.channel_scale
    assert all(p.k.row_scale.shape[2] == p.num_rows for p in parts)
    assert torch.equal(torch.cat([_dense_all(p)[0] for p in parts], 2), got_k)
    assert unique_nbytes(parts) == state.nbytes
    again = compose([state], rank=4)                      # recompressed in the same form
    assert again.k.b is None and again.key_coeffs().bits == bits and again.k.channel_scale is not None
    moved = state.to("cpu")
    assert torch.equal(moved.k.channel_scale, state.k.channel_scale)
    with pytest.raises(ValueError, match="channel scales"):
        replace(state.k, channel_scale=state.k.channel_scale[:, :, :, :4])


def test_key_rows_with_factored_values():
    """key_bits without value_bits: the values keep their rank-r factors in the requested dtype."""
    dk, dv = _devs(20)
    state = compress(dk, dv, torch.arange(20), 4, Format(torch.int8, key_bits=8))
    assert state.k.b is None and state.v.u.dtype == torch.int8 and state.v.b.dtype == torch.bfloat16
    again = compose([state], rank=4)
    assert again.v.u.dtype == torch.int8 and again.k.b is None


@pytest.mark.parametrize("knobs", [{}, {"dtype": torch.int8}, {"dtype": torch.int8, "key_bits": 8, "value_bits": 4}])
def test_a_state_without_its_first_layer_stores_less_and_reads_zeros_there(knobs):
    from kvcmas_agents.reuse.realign import Realigner

    dk, dv = _devs(12, seed=5)
    rows = torch.arange(12) * 2
    whole = compress(dk, dv, rows, 8, Format(**knobs))
    part = compress(dk, dv, rows, 8, Format(**knobs), first_layer=1)
    assert (part.first_layer, part.num_layers, part.k.u.shape[0]) == (1, L, L - 1)
    assert part.nbytes < whole.nbytes
    k0, v0 = part.dense(0)
    assert not k0.any() and not v0.any() and k0.shape == whole.dense(0)[0].shape
    for layer in range(1, L):                 # the stored layers are the same as in the whole state
        for a, b in zip(part.dense(layer), whole.dense(layer)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    for coeffs, basis in ((part.key_coeffs(), part.key_basis()), (part.value_coeffs(), part.value_basis())):
        assert coeffs.at().shape[0] == basis.at().shape[0] == L and not coeffs.at()[0].any()
        with pytest.raises(ValueError, match="one layer at a time, or whole"):
            coeffs.at(slice(1, 3))
    # Moved, settled, composed and materialized, it still corrects nothing at layer 0.
    realigner = Realigner(1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D)))
    settled = realigner.settle(realigner.rotate_delta(part, 3))
    assert settled.first_layer == 1 and settled.k.b.shape[0] == L - 1 and not settled.dense(0)[0].any()
    other = compress(*_devs(12, seed=6), rows, 8, Format(**knobs))
    exact = compose([part, other])
    lossy = compose([part, other], rank=8)
    assert lossy.first_layer == 0 and exact.first_layer == 0
    for layer in range(L):
        want = [a + b for a, b in zip(part.dense(layer), other.dense(layer))]
        for got, w in zip(exact.dense(layer), want):
            torch.testing.assert_close(got, w, rtol=0, atol=1e-4)
    k_ref, v_ref = torch.zeros(30, KVH, D), torch.zeros(30, KVH, D)
    k, v = apply_to(k_ref, v_ref, [part], 0)
    assert not k.any() and not v.any()
    with pytest.raises(ValueError, match="first_layer"):
        compress(dk, dv, rows, 8, first_layer=L)
    with pytest.raises(ValueError, match="first_layer"):
        LowRankDelta(part.rows, part.k, part.v, first_layer=-1)


def test_joint_states_drop_the_first_layer_together():
    dks, dvs = zip(*(_devs(n, seed=n) for n in (5, 7)))
    rows = [torch.arange(5), torch.arange(7)]
    states = compress_joint(list(dks), list(dvs), rows, 6, Format(torch.int8), first_layer=1)
    assert all(s.first_layer == 1 and s.k.u.shape[0] == L - 1 for s in states)
    assert states[0].k.b is states[1].k.b and states[0].k.b.shape[0] == L - 1


def test_rows_are_smaller_counts_the_bytes_of_both_storages():
    """At the engine's shape (rank 40, head_dim 64): 8-bit key rows (66 bytes a row and 128 of channel
    scales) beat int8 U plus bf16 B (40 bytes a row and 5,120) below 192 rows; value rows, without
    channel scales, below 197. The rule compares with those factors however they are stored."""
    assert rows_are_smaller(191, 64, 40, channels=True) and not rows_are_smaller(192, 64, 40, channels=True)
    assert rows_are_smaller(196, 64, 40, channels=False) and not rows_are_smaller(197, 64, 40, channels=False)
    assert rows_are_smaller(10, 64, 40, channels=True)          # r = min(rank, rows) = 10 still loses
    assert not rows_are_smaller(5000, 64, 64, channels=True)     # full rank: int8 U beats rows with scales
    dk, dv = _devs(150, seed=4)
    for storage in ({}, {"int8_basis": True, "u8": 4}):          # cheaper factors do not move the choice
        state = compress(dk, dv, torch.arange(150), 40, Format(torch.int8, small_rows=True, **storage))
        assert state.k.b is None and state.v.b is None


def test_small_rows_keep_the_rows_of_a_side_whose_factors_would_be_larger():
    """small_rows: a small deviation is stored as 8-bit rows (keys with channel scales), which take fewer
    bytes and lose far less than its SVD; a large one keeps its factors, bit for bit; only int8 factors
    are replaced, and an explicit key_bits/value_bits wins."""
    dk, dv = _devs(12)
    dk[..., :2] *= 30.0
    rows = torch.arange(12) * 3
    small = compress(dk, dv, rows, 8, Format(torch.int8, small_rows=True))
    factored = compress(dk, dv, rows, 8, Format(torch.int8))
    assert small.k.b is None and small.v.b is None
    assert small.k.channel_scale is not None and small.v.channel_scale is None
    assert small.key_coeffs().bits == small.value_coeffs().bits == 8
    assert small.nbytes < factored.nbytes
    got_k, got_v = _dense_all(small)
    fk, fv = _dense_all(factored)
    for got, ref, fac in ((got_k, dk, fk), (got_v, dv, fv)):
        err = ((got - ref).norm() / ref.norm()).item()
        assert err < 0.01 and err < ((fac - ref).norm() / ref.norm()).item() / 4, err
    big_k, big_v = _devs(40, seed=1)
    big = compress(big_k, big_v, torch.arange(40), 8, Format(torch.int8, small_rows=True))
    plain = compress(big_k, big_v, torch.arange(40), 8, Format(torch.int8))
    assert big.k.b is not None and torch.equal(big.k.u, plain.k.u) and torch.equal(big.v.b, plain.v.b)
    assert compress(dk, dv, rows, 8, Format(torch.bfloat16, small_rows=True)).k.b is not None
    assert compress(dk, dv, rows, 8, Format(torch.int8, value_bits=4, small_rows=True)).value_coeffs().bits == 4
    # A joint basis decides on all its segments' rows: two of 12 rows each are factored together
    # (24 rows: 448 bytes of factors against 464 of key rows), though either alone would be rows.
    a, b = _devs(12, seed=2), _devs(12, seed=3)
    parts = compress_joint([a[0], b[0]], [a[1], b[1]], [rows, rows + 1], 8, Format(torch.int8, small_rows=True))
    assert parts[0].k.b is parts[1].k.b is not None
    assert compress_joint([a[0]], [a[1]], [rows], 8, Format(torch.int8, small_rows=True))[0].k.b is None


def test_small_rows_in_fewer_bits_keep_the_same_sides_as_rows():
    """small_bits: the rows small_rows picks (decided against 8-bit rows) are stored in that many bits.
    6-bit rows take 50 bytes a row and head where 8-bit ones take 66, and lose a few times more of
    the deviation (still about 0.03% here)."""
    dk, dv = _devs(12, seed=5)
    dk[..., :2] *= 30.0
    rows = torch.arange(12) * 2
    by_bits = {b: compress(dk, dv, rows, 8, Format(torch.int8, small_rows=True, small_bits=b), first_layer=1)
               for b in (4, 6, 8)}
    for bits, state in by_bits.items():
        assert state.k.b is None and state.v.b is None and state.k.row_bits == state.v.row_bits == bits
        assert state.key_coeffs().bits == state.value_coeffs().bits == bits and state.rank == D
    assert by_bits[6].k.u.dtype == torch.uint8 and by_bits[6].k.u.shape[-1] == D * 3 // 4
    assert by_bits[6].k.u.nbytes * 4 == by_bits[8].k.u.nbytes * 3
    ref = (dk[1:], dv[1:])
    err = {b: _rel_err(replace(s, first_layer=0), *ref) for b, s in by_bits.items()}
    assert err[8] < err[6] < err[4] and err[6] < 0.001, err
    moved = by_bits[6].to("cpu")                             # the bits travel with the state
    assert moved.k.row_bits == moved.v.row_bits == 6
    assert torch.equal(moved.key_coeffs().at(), by_bits[6].key_coeffs().at())
    # States of different bits read together (a view joins every state of a layer).
    both = Coeffs.joined([by_bits[6].key_coeffs(), by_bits[8].key_coeffs()], 2)
    assert torch.equal(both, torch.cat([by_bits[6].key_coeffs().at(2), by_bits[8].key_coeffs().at(2)], dim=1))
    parts = compress_joint([dk], [dv], [rows], 8, Format(torch.int8, small_rows=True, small_bits=6))
    assert parts[0].k.row_bits == parts[0].v.row_bits == 6
    with pytest.raises(ValueError, match="small_bits"):
        compress(dk, dv, rows, 8, Format(torch.int8, small_rows=True, small_bits=5))
    with pytest.raises(ValueError, match="code bits"):
        replace(compress(dk, dv, rows, 8, Format(torch.int8)).k, row_bits=6)


def _rel_err(state: LowRankDelta, dk: torch.Tensor, dv: torch.Tensor) -> float:
    k, v = _dense_all(state)
    return (((k - dk).pow(2).sum() + (v - dv).pow(2).sum()) / (dk.pow(2).sum() + dv.pow(2).sum())).item()


def test_u8_components_store_the_trailing_components_as_4_bit_codes():
    """u8: U's first u8 components keep int8 codes, the rest are 4-bit codes (-7..7, each component
    with its own scale folded into B) packed two to a byte after them. At the same U bytes that
    loses less than dropping components: rank 8 with 4 of them at 4 bits (6 bytes a row) against
    rank 6 at 8 bits."""
    g = torch.Generator().manual_seed(11)
    # a decaying spectrum, as deviations have: component i scaled by 0.8^i
    basis = torch.linalg.qr(torch.randn(L, KVH, D, D, generator=g))[0]
    coef = torch.randn(L, KVH, 64, D, generator=g) * 0.8 ** torch.arange(D)
    dk, dv = coef @ basis.transpose(-1, -2), (coef @ basis.transpose(-1, -2)).flip(-1)
    rows = torch.arange(64) * 2
    full = compress(dk, dv, rows, 8, Format(torch.int8))
    tailed = compress(dk, dv, rows, 8, Format(torch.int8, u8=4))
    assert (full.k.tail4, tailed.k.tail4, tailed.v.tail4) == (0, 4, 4)
    assert tailed.k.u.shape == (L, KVH, 64, 6) and tailed.key_coeffs().rank == tailed.rank == 8
    assert tailed.nbytes == full.nbytes - 2 * L * KVH * 64 * 2
    codes = tailed.key_coeffs().at()[..., 4:]
    assert codes.abs().max() == 7 and torch.equal(codes, codes.round())
    assert codes.abs().amax(dim=-2).min() == 7                 # every 4-bit component uses its range
    assert torch.equal(tailed.k.u[..., :4], full.k.u[..., :4])   # the 8-bit components are untouched
    assert _rel_err(full, dk, dv) < _rel_err(tailed, dk, dv) < _rel_err(compress(dk, dv, rows, 6, Format(torch.int8)),
                                                                        dk, dv)
    # An odd remainder leaves one more component at 8 bits; u8 >= rank stores no 4-bit codes at all.
    odd = compress(dk, dv, rows, 7, Format(torch.int8, u8=4))
    assert odd.k.tail4 == 2 and odd.k.u.shape[-1] == 6 and odd.rank == 7
    assert torch.equal(compress(dk, dv, rows, 8, Format(torch.int8, u8=8)).k.u, full.k.u)
    assert compress(dk, dv, rows, 8, Format(torch.float32, u8=4)).k.tail4 == 0       # only int8 U has codes
    # With int8 B, in a joint basis, moved, and recompressed: the tail stays what it is.
    parts = compress_joint([dk[:, :, :30], dk[:, :, 30:]], [dv[:, :, :30], dv[:, :, 30:]], [rows[:30], rows[30:]], 8,
                           Format(torch.int8, int8_basis=True, u8=4))
    assert all(p.k.tail4 == 4 and p.k.b is parts[0].k.b and p.k.b.dtype == torch.int8 for p in parts)
    joined = Coeffs.joined([p.key_coeffs() for p in parts], 1)
    torch.testing.assert_close(joined, torch.cat([p.key_coeffs().at(1) for p in parts], dim=1), rtol=0, atol=0)
    assert parts[0].to("cpu").k.tail4 == 4 and compose([tailed], rank=8).k.tail4 == 4
    with pytest.raises(ValueError, match="pairs"):
        replace(tailed.k, tail4=3)


def test_head_bits_6_packs_the_leading_components_four_to_three_bytes():
    """head_bits=6: an int8 U's leading (not 4-bit) components are 6-bit codes (-31..31, each with its
    own scale folded into B), four in three bytes; the 4-bit tail stays as it was. Between 8-bit and
    4-bit leading codes in error; a count of leading components not divisible by four keeps 8 bits."""
    g = torch.Generator().manual_seed(12)
    basis = torch.linalg.qr(torch.randn(L, KVH, D, D, generator=g))[0]
    coef = torch.randn(L, KVH, 64, D, generator=g) * 0.8 ** torch.arange(D)
    dk, dv = coef @ basis.transpose(-1, -2), (coef @ basis.transpose(-1, -2)).flip(-1)
    rows = torch.arange(64) * 2
    eight = compress(dk, dv, rows, 12, Format(torch.int8, int8_basis=True, u8=8))
    six = compress(dk, dv, rows, 12, Format(torch.int8, int8_basis=True, u8=8, head_bits=6))
    assert (eight.k.head_bits, six.k.head_bits, six.v.head_bits, six.k.tail4) == (8, 6, 6, 4)
    assert six.k.u.shape == (L, KVH, 64, 6 + 2) and six.rank == six.key_coeffs().rank == 12
    assert eight.nbytes - six.nbytes == 2 * L * KVH * 64 * 2             # 8 -> 6 bytes a row, per side
    codes = six.key_coeffs().at()
    assert torch.equal(codes, codes.round()) and codes[..., :8].abs().amax(dim=-2).min() == 31
    assert torch.equal(codes[..., 8:], eight.key_coeffs().at()[..., 8:])  # the 4-bit tail is untouched
    four = compress(dk, dv, rows, 12, Format(torch.int8, int8_basis=True, u8=0))  # every component 4-bit
    assert _rel_err(eight, dk, dv) < _rel_err(six, dk, dv) < _rel_err(four, dk, dv)
    # Joined, moved, split over a joint basis and recompressed, the codes keep their bits.
    parts = compress_joint([dk[:, :, :30], dk[:, :, 30:]], [dv[:, :, :30], dv[:, :, 30:]], [rows[:30], rows[30:]], 12,
                           Format(torch.int8, int8_basis=True, u8=8, head_bits=6))
    assert all(p.k.head_bits == p.v.head_bits == 6 for p in parts)
    joined = Coeffs.joined([p.value_coeffs() for p in parts], 1)
    torch.testing.assert_close(joined, torch.cat([p.value_coeffs().at(1) for p in parts], dim=1), rtol=0, atol=0)
    mixed = Coeffs.joined([six.key_coeffs(), eight.key_coeffs()], 2)
    assert torch.equal(mixed, torch.cat([six.key_coeffs().at(2), eight.key_coeffs().at(2)], dim=1))
    assert six.to("cpu").k.head_bits == 6 and compose([six], rank=12).k.head_bits == 6
    # 10 leading components do not pack in whole bytes: they keep 8 bits.
    assert compress(dk, dv, rows, 14, Format(torch.int8, u8=10, head_bits=6)).k.head_bits == 8
    with pytest.raises(ValueError, match="head_bits"):
        compress(dk, dv, rows, 12, Format(torch.int8, head_bits=4))
    with pytest.raises(ValueError, match="leading components"):
        replace(eight.k, head_bits=6)                          # 8 int8 columns are not 6-bit codes
