"""cpu tier: FP8 quantization of DESIGN section 4 and the shared random generators."""
from __future__ import annotations

import pytest
import torch

from megamoe import quant
from megamoe.quant import (
    BLOCK,
    FP8_MAX,
    REQUANT_GROUP,
    dequant_per_block,
    dequant_per_token,
    fp8_e4m3_satfinite,
    per_block_cast_to_fp8,
    per_token_cast_to_fp8,
    random_pow2_scales,
    random_routing,
    random_small_int_fp8,
    random_topk_weights,
    requant_per64,
)

FP8 = torch.float8_e4m3fn


def codes(q: torch.Tensor) -> list[int]:
    return q.view(torch.uint8).flatten().tolist()


def fp8_values(values: list[float]) -> torch.Tensor:
    """Exactly representable e4m3 values -> fp8 tensor (asserting they are exact)."""
    t = torch.tensor(values, dtype=torch.float32)
    q = t.to(FP8)
    assert torch.equal(q.float(), t)
    return q


def emulated_requant(v: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent emulation in float64 of the requant formula with one fp32 rounding per operation.

    Division and multiplication are correctly rounded in float64 and then rounded to fp32; for a single +-*/
    of fp32 operands that double rounding is innocuous (53 >= 2 * 24 + 2), so this gives IEEE fp32 results.
    """
    g = v.double().unflatten(-1, (v.shape[-1] // group, group))
    a = torch.clamp_min(g.abs().amax(-1), torch.tensor(1e-10, dtype=torch.float32).double())
    sf = (a / 448.0).float()
    inv = (448.0 / a).float()
    scaled = (g * inv.double().unsqueeze(-1)).float()  # the product of two fp32 is exact in float64
    return torch.clamp(scaled, -448.0, 448.0).to(FP8).flatten(-2), sf


# ----------------------------------------------------------------------------------------------------------------
# satfinite
# ----------------------------------------------------------------------------------------------------------------


def test_satfinite_saturates_and_keeps_nan() -> None:
    v = torch.tensor([500.0, 1e6, float("inf"), -float("inf"), -449.0, 464.0, 448.0, -448.0])
    # 464 is the tie between 448 and 480 (480 would be the NaN code 0x7F): satfinite gives 448.
    assert codes(fp8_e4m3_satfinite(v)) == [0x7E, 0x7E, 0x7E, 0xFE, 0xFE, 0x7E, 0x7E, 0xFE]
    nan = fp8_e4m3_satfinite(torch.tensor([float("nan")]))
    assert torch.isnan(nan.float()).all()


def test_satfinite_rounds_to_nearest_even() -> None:
    v = torch.tensor([1.0625, 1.1875, -1.0625, 2.0**-10, 3 * 2.0**-10, 0.0, 17.0, 19.0, 104.0])
    # ties: 1.0625 -> 1.0 (mantissa 000), 1.1875 -> 1.25 (010), 2^-10 -> 0, 3*2^-10 -> 2^-8,
    # 17 -> 16 (tie, even), 19 -> 20 (tie, 20 = 1.25*16 even), 104 -> 104 (exact: 1.625 * 64)
    assert codes(fp8_e4m3_satfinite(v)) == [0x38, 0x3A, 0xB8, 0x00, 0x02, 0x00, 0x58, 0x5A, 0x6D]


def test_satfinite_accepts_bf16_and_rejects_ints() -> None:
    assert fp8_e4m3_satfinite(torch.tensor([1000.0], dtype=torch.bfloat16)).float().item() == FP8_MAX
    with pytest.raises(TypeError, match="v must be a floating tensor"):
        fp8_e4m3_satfinite(torch.tensor([1, 2]))


# ----------------------------------------------------------------------------------------------------------------
# per-token / per-block casts
# ----------------------------------------------------------------------------------------------------------------


def _round_trip_bound(x: torch.Tensor, sf_per_elem: torch.Tensor) -> torch.Tensor:
    # e4m3 keeps 3 mantissa bits: a normal value is off by at most 2^-4 relative, a subnormal (scaled magnitude
    # below 2^-6) by at most half the smallest step 2^-9; fp32 rounding of the scaling adds a hair (1e-6).
    return torch.maximum(x.abs() * 2.0**-4, sf_per_elem * 2.0**-10) * (1 + 1e-5)


def test_per_token_round_trip_bounds() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 512, generator=g) * torch.logspace(-3, 3, 16)[:, None]
    q, sf = per_token_cast_to_fp8(x)
    assert q.dtype == FP8 and q.shape == (16, 512)
    assert sf.dtype == torch.float32 and sf.shape == (16, 4)
    amax = x.abs().unflatten(1, (4, 128)).amax(-1)
    assert torch.equal(sf, amax / FP8_MAX)
    deq = dequant_per_token(q, sf)
    assert deq.dtype == torch.float32
    assert ((deq - x).abs() <= _round_trip_bound(x, sf.repeat_interleave(128, 1))).all()
    # The amax element of every block lands on +-448.
    assert torch.equal(q.float().abs().unflatten(1, (4, 128)).amax(-1), torch.full((16, 4), FP8_MAX))
    # Measured 2.5e-2 relative L2 for this Gaussian data (3 mantissa bits).
    err = ((deq - x).norm() / x.norm()).item()
    assert 0.01 < err < 0.04


def test_per_token_blocks_independent_and_empty() -> None:
    x = torch.ones(2, 256)
    x[0, 200] = 1000.0  # only block 1 of row 0 sees the large value
    q, sf = per_token_cast_to_fp8(x)
    assert sf[0, 0].item() == pytest.approx(1 / 448) and sf[1, 1].item() == pytest.approx(1 / 448)
    assert sf[0, 1].item() == pytest.approx(1000 / 448)
    assert (q[0, :128].float() == FP8_MAX).all()
    q0, sf0 = per_token_cast_to_fp8(torch.zeros(0, 256))
    assert q0.shape == (0, 256) and sf0.shape == (0, 2)


def test_per_block_round_trip_and_block_independence() -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(3, 256, 384, generator=g)
    w[1, 130, 260] = 500.0  # block (1, 1, 2)
    q, sf = per_block_cast_to_fp8(w)
    assert q.shape == (3, 256, 384) and sf.shape == (3, 2, 3)
    expected_sf = w.abs().unflatten(2, (3, 128)).unflatten(1, (2, 128)).amax(dim=(2, 4)) / FP8_MAX
    assert torch.equal(sf, expected_sf)
    assert sf[1, 1, 2].item() == pytest.approx(500 / 448)
    assert sf[1, 1, 1].item() < 5 / 448  # neighbours unaffected
    deq = dequant_per_block(q, sf)
    sf_elem = sf.repeat_interleave(128, 1).repeat_interleave(128, 2)
    assert ((deq - w).abs() <= _round_trip_bound(w, sf_elem)).all()


def test_dequant_matches_manual() -> None:
    q = fp8_values([1.0, -2.0, 0.5, 448.0] * 64).view(2, 128)
    sf = torch.tensor([[2.0], [0.25]])
    assert torch.equal(dequant_per_token(q, sf), q.float() * sf)
    sf64 = torch.tensor([[2.0, 4.0], [0.25, 8.0]])
    expected = q.float() * sf64.repeat_interleave(64, 1)
    assert torch.equal(dequant_per_token(q, sf64, group=REQUANT_GROUP), expected)


def test_cast_validation() -> None:
    with pytest.raises(ValueError, match="hidden.*multiple of 128.*100"):
        per_token_cast_to_fp8(torch.zeros(2, 100))
    with pytest.raises(ValueError, match="x must be 2-D"):
        per_token_cast_to_fp8(torch.zeros(128))
    with pytest.raises(TypeError, match="x must be a floating tensor"):
        per_token_cast_to_fp8(torch.zeros(2, 128, dtype=torch.int32))
    with pytest.raises(ValueError, match="N.*multiple of 128"):
        per_block_cast_to_fp8(torch.zeros(64, 128))
    with pytest.raises(TypeError, match="q must be torch.float8_e4m3fn"):
        dequant_per_token(torch.zeros(1, 128), torch.ones(1, 1))
    with pytest.raises(ValueError, match="sf must have shape"):
        dequant_per_token(torch.zeros(1, 128).to(FP8), torch.ones(1, 2))
    with pytest.raises(ValueError, match="sf must have shape"):
        dequant_per_block(torch.zeros(128, 256).to(FP8), torch.ones(1, 1))


# ----------------------------------------------------------------------------------------------------------------
# L1 -> L2 requant (DESIGN section 4)
# ----------------------------------------------------------------------------------------------------------------


def test_requant_hand_made_rows() -> None:
    v = torch.zeros(4, 64)
    # amax 448: a = 448, sf = 1, 448 / a = 1: the codes are the rounded values themselves.
    v[0, :6] = torch.tensor([448.0, -448.0, 1.0625, 1.1875, 3 * 2.0**-10, -104.0])
    # amax 1: sf = fp32(1/448), 448 / a = 448 exactly: 0.5 -> 224, -0.25 -> -112, 2^-7 -> 3.5, 0.3 -> 134.4 -> 128
    v[1, :5] = torch.tensor([1.0, 0.5, -0.25, 2.0**-7, 0.3])
    # amax 3: 448 / 3 = 149.33333 (fp32); 3 -> 448, 1 -> 149.33 -> 144, -1.5 -> -224, 0.1 -> 14.93 -> 15
    v[2, :4] = torch.tensor([3.0, 1.0, -1.5, 0.1])
    # row 3 stays zero: amax 0 -> a = 1e-10, sf = 1e-10 / 448, codes 0
    q, sf = requant_per64(v)
    assert q.shape == (4, 64) and sf.shape == (4, 1)
    assert q[0, :6].float().tolist() == [448.0, -448.0, 1.0, 1.25, 2.0**-8, -104.0]
    assert q[1, :5].float().tolist() == [448.0, 224.0, -112.0, 3.5, 128.0]
    assert q[2, :4].float().tolist() == [448.0, 144.0, -224.0, 15.0]
    f32 = torch.float32
    assert sf[:, 0].tolist() == [1.0, (torch.tensor(1.0, dtype=f32) / 448).item(),
                                 (torch.tensor(3.0, dtype=f32) / 448).item(),
                                 (torch.tensor(1e-10, dtype=f32) / 448).item()]
    assert (q[3].float() == 0).all() and (q[:, 6:].float() == 0).all()


def test_requant_amax_zero_row() -> None:
    q, sf = requant_per64(torch.zeros(2, 128))
    assert codes(q) == [0] * 256
    assert torch.equal(sf, torch.full((2, 2), 1e-10, dtype=torch.float32) / 448)


def test_requant_groups_independent() -> None:
    g = torch.Generator().manual_seed(3)
    v = torch.randn(8, 256, generator=g)
    v[:, 64:128] *= 1000.0
    q, sf = requant_per64(v)
    v2 = v.clone()
    v2[:, 64:128] = torch.randn(8, 64, generator=g) * 1e-6  # change group 1 only
    q2, sf2 = requant_per64(v2)
    for grp in (0, 2, 3):
        cols = slice(grp * 64, (grp + 1) * 64)
        assert codes(q[:, cols]) == codes(q2[:, cols])
        assert torch.equal(sf[:, grp], sf2[:, grp])
    assert not torch.equal(sf[:, 1], sf2[:, 1])


def test_requant_is_ieee_division_not_reciprocal() -> None:
    g = torch.Generator().manual_seed(4)
    v = torch.randn(4096, 128, generator=g) * torch.rand(4096, 1, generator=g) * 10
    q, sf = requant_per64(v)
    q_ref, sf_ref = emulated_requant(v, REQUANT_GROUP)
    assert torch.equal(sf, sf_ref)
    assert codes(q) == codes(q_ref)
    # Random rows almost never expose the division (a 1-ulp change of 448 / a moves an FP8 code with
    # probability ~2^-21): the next test builds a row that does.


def test_requant_is_ieee_division_not_reciprocal_on_a_boundary() -> None:
    # torch's `448.0 / a` is reciprocal-then-multiply (two roundings). Find an amax a where that differs from
    # the IEEE quotient, then a value v whose scaled value straddles the FP8 rounding boundary 216 (between 208
    # and 224) under the two quotients: requant_per64 must give the code of the IEEE division.
    a_all = torch.rand(10000, generator=torch.Generator().manual_seed(10)) * 10 + 0.01
    inv_div = torch.div(torch.tensor(448.0), a_all)
    inv_recip = 448.0 / a_all
    differs = (inv_div != inv_recip).nonzero().flatten()
    assert differs.numel() > 0
    found = None
    for i in differs.tolist():
        a = a_all[i]
        v = (216.0 / inv_div[i].double()).float()
        for _ in range(8):
            v = torch.nextafter(v, torch.tensor(0.0))
        for _ in range(16):
            if (v * inv_div[i]).to(FP8).float() != (v * inv_recip[i]).to(FP8).float():
                found = (a, v)
                break
            v = torch.nextafter(v, torch.tensor(1e9))
        if found is not None:
            break
    assert found is not None
    row = torch.zeros(1, 64)
    row[0, 0], row[0, 1] = found
    q, _ = requant_per64(row)
    q_ref, _ = emulated_requant(row, REQUANT_GROUP)
    assert codes(q) == codes(q_ref)
    recip_code = (found[1] * (448.0 / found[0].reshape(1))).to(FP8)
    assert codes(q[0, 1:2]) != codes(recip_code)


def test_requant_validation() -> None:
    with pytest.raises(TypeError, match="v must be torch.float32"):
        requant_per64(torch.zeros(2, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="intermediate.*multiple of 64.*96"):
        requant_per64(torch.zeros(2, 96))


# ----------------------------------------------------------------------------------------------------------------
# random generators
# ----------------------------------------------------------------------------------------------------------------


def test_random_small_int_fp8() -> None:
    g = torch.Generator().manual_seed(5)
    q = random_small_int_fp8((64, 256), generator=g)
    assert q.dtype == FP8 and q.shape == (64, 256)
    v = q.float()
    assert torch.equal(v, v.round()) and v.abs().max() <= 4 and v.abs().max() == 4
    assert len(torch.unique(v)) == 9
    q16 = random_small_int_fp8(1000, max_abs=16, generator=g)
    assert q16.float().abs().max() <= 16 and torch.equal(q16.float(), q16.float().round())
    with pytest.raises(ValueError, match="max_abs"):
        random_small_int_fp8(4, max_abs=17)
    # Same seed, same values.
    a = random_small_int_fp8(32, generator=torch.Generator().manual_seed(9))
    b = random_small_int_fp8(32, generator=torch.Generator().manual_seed(9))
    assert codes(a) == codes(b)


def test_random_small_int_block_partials_exact_bound() -> None:
    # The documented bound: |128-K block partial| <= 128 * 4 * 4 = 2048 < 2^13, and with default scales a K=7168
    # sum stays under 2^19 in multiples of 2^-4, so fp32 (and float64) hold it exactly.
    g = torch.Generator().manual_seed(6)
    x = random_small_int_fp8((4, 7168), generator=g).float()
    w = random_small_int_fp8((8, 7168), generator=g).float()
    partials = torch.einsum("mbk,nbk->mnb", x.view(4, 56, 128).double(), w.view(8, 56, 128).double())
    assert partials.abs().max() <= 2048


def test_random_pow2_scales() -> None:
    g = torch.Generator().manual_seed(7)
    s = random_pow2_scales((1000,), generator=g)
    assert s.dtype == torch.float32
    mantissa, exponent = torch.frexp(s)
    assert (mantissa == 0.5).all()
    assert set((exponent - 1).tolist()) == {-2, -1, 0, 1}
    s2 = random_pow2_scales(100, -5, -5, generator=g)
    assert (s2 == 2.0**-5).all()
    with pytest.raises(ValueError, match="lo_exp must be <= hi_exp"):
        random_pow2_scales(4, 2, 1)


def test_random_routing() -> None:
    g = torch.Generator().manual_seed(8)
    idx = random_routing(200, 16, 6, generator=g)
    assert idx.dtype == torch.int64 and idx.shape == (200, 6)
    assert idx.min() >= 0 and idx.max() < 16
    assert all(len(set(row)) == 6 for row in idx.tolist())
    masked = random_routing(500, 16, 4, mask_prob=0.3, generator=g)
    frac = (masked == -1).float().mean().item()
    assert 0.2 < frac < 0.4
    valid = [[e for e in row if e >= 0] for row in masked.tolist()]
    assert all(len(set(row)) == len(row) for row in valid)
    assert (random_routing(10, 8, 2, mask_prob=1.0, generator=g) == -1).all()
    assert random_routing(0, 8, 2).shape == (0, 2)
    with pytest.raises(ValueError, match="num_topk"):
        random_routing(4, 4, 5)


def test_random_topk_weights() -> None:
    w = random_topk_weights(50, 8, generator=torch.Generator().manual_seed(9))
    assert w.dtype == torch.float32 and w.shape == (50, 8)
    assert (w > 0).all()
    assert torch.allclose(w.sum(1), torch.ones(50))


def test_constants() -> None:
    assert (quant.FP8_MAX, quant.BLOCK, quant.REQUANT_GROUP) == (448.0, 128, 64)
    assert BLOCK == 128
