"""The inputs and the cuBLAS baseline of `megamoe bench ffn` (megamoe.bench.ffn) on the CPU: fresh random inputs,
their pool packing for the unit kernel, and the baseline's torch pipeline (per-64 as two zero-padded stacks)
against the exact reference, with a CPU stand-in for `torch._scaled_mm` that enforces the blockwise layouts torch
checks on the GPU."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from megamoe import quant  # noqa: E402
from megamoe import reference as ref  # noqa: E402
from megamoe.bench import ffn as bench_ffn  # noqa: E402


# BLOCK_M 32: pool rows 0-4, 32-36, 64-68 (+ a spare block). K / 128 a multiple of 4 for both GEMMs: torch sizes
# scale_b (round_up(K/128, 4), N/128), so the weight SFs are used as they are only there (true of H 4096, I 2048)
SMALL = bench_ffn.FfnBenchCase("small", 3, 5, 512, 512)


def _small_inputs(seed: int = 0) -> bench_ffn.FfnBenchInputs:
    return bench_ffn.ffn_random_inputs(SMALL, seed=seed, device="cpu")


def test_random_inputs_are_fresh_and_shaped() -> None:
    a, b = _small_inputs(1), _small_inputs(2)
    e, c, h, i = SMALL.num_experts, SMALL.rows, SMALL.hidden, SMALL.intermediate
    assert a.x.shape == (e * c, h) and a.x_sf.shape == (e * c, h // 128) and a.topk_weights.shape == (e * c,)
    assert a.w1.shape == (e, 2 * i, h) and a.w1_sf.shape == (e, 2 * i // 128, h // 128)
    assert a.w2.shape == (e, h, i) and a.w2_sf.shape == (e, h // 128, i // 128)
    assert a.x.dtype == a.w1.dtype == a.w2.dtype == torch.float8_e4m3fn
    assert not torch.equal(a.x.view(torch.uint8), b.x.view(torch.uint8))
    assert a.x.float().abs().sum() > 0 and a.w1.float().abs().sum() > 0
    assert float(a.topk_weights.min()) >= 0.05 and float(a.topk_weights.max()) < 0.35


def test_pool_packing() -> None:
    from megamoe.weights import inverse_transform_weights

    inputs = _small_inputs()
    pool = bench_ffn.ffn_pool_inputs(SMALL, inputs)
    rows = bench_ffn.ffn_pool_rows(SMALL)
    assert rows.tolist() == [0, 1, 2, 3, 4, 32, 33, 34, 35, 36, 64, 65, 66, 67, 68]
    assert pool.num_pool_rows == SMALL.config.num_pool_rows(SMALL.counts) == 128
    assert torch.equal(pool.l1_acts.view(torch.uint8)[rows], inputs.x.view(torch.uint8))
    assert torch.equal(pool.l1_acts_sf[:, rows], inputs.x_sf.t())
    assert torch.equal(pool.topk_weights[rows], inputs.topk_weights)
    padding = torch.ones(pool.num_pool_rows, dtype=torch.bool)
    padding[rows] = False
    assert not bool(pool.l1_acts.view(torch.uint8)[padding].any()) and not bool(pool.topk_weights[padding].any())
    assert pool.num_tokens_per_expert.tolist() == SMALL.counts
    (w1, w1_sf), (w2, w2_sf) = inverse_transform_weights((pool.w1, pool.w1_sf), (pool.w2, pool.w2_sf))
    assert torch.equal(w1.view(torch.uint8), inputs.w1.view(torch.uint8)) and torch.equal(w1_sf, inputs.w1_sf)
    assert torch.equal(w2.view(torch.uint8), inputs.w2.view(torch.uint8)) and torch.equal(w2_sf, inputs.w2_sf)


def _round_up(v: int, m: int) -> int:
    return -(-v // m) * m


class FakeScaledMm:
    """CPU stand-in for torch._scaled_mm with 1x128 A / 128x128 B scales: the layout checks torch makes on the
    GPU (A row-major, B column-major, scale_a (M, K/128) with strides (1, M), scale_b (round_up(K/128, 4),
    N/128) with strides (1, round_up(K/128, 4))), and the blockwise result computed as the reference does (each
    128-K block's dot exact in float64, rounded once to fp32, times (a_sf x b_sf), accumulated in fp32 in K
    order)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []

    def __call__(self, a, b, scale_a, scale_b, *, out_dtype, out):
        m, k = a.shape
        n = b.shape[1]
        kb = k // 128
        assert a.dtype == b.dtype == torch.float8_e4m3fn and b.shape[0] == k and k % 128 == 0 and n % 128 == 0
        assert a.stride() == (k, 1), f"A must be row-major, strides {a.stride()}"
        assert b.stride(0) == 1 and b.stride(1) >= k, f"B must be column-major, strides {b.stride()}"
        assert scale_a.dtype == scale_b.dtype == torch.float32
        assert tuple(scale_a.shape) == (m, kb) and (scale_a.stride(0) == 1 and (scale_a.stride(1) == m or kb == 1)), \
            f"scale_a {tuple(scale_a.shape)} strides {scale_a.stride()}"
        assert tuple(scale_b.shape) == (_round_up(kb, 4), n // 128), f"scale_b shape {tuple(scale_b.shape)}"
        assert scale_b.stride(0) == 1 and scale_b.stride(1) == _round_up(kb, 4), f"scale_b {scale_b.stride()}"
        assert out.dtype == out_dtype and tuple(out.shape) == (m, n) and out.is_contiguous()
        self.calls.append((m, n, k))
        a64 = a.double().view(m, kb, 128)
        b64 = b.double().t().reshape(n, kb, 128)
        acc = torch.zeros(m, n, dtype=torch.float32)
        b_scale = scale_b.repeat_interleave(128, dim=1)  # [K/128, N]
        for blk in range(kb):
            partial = (a64[:, blk] @ b64[:, blk].t()).float()
            acc += partial * (scale_a[:, blk, None] * b_scale[blk][None, :])
        out.copy_(acc.to(out_dtype))
        return out


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_unfused_pipeline_per64_matches_the_reference(out_dtype: torch.dtype) -> None:
    """The faithful baseline: with fp32 GEMM outputs every L1 accumulator, activation, code and SF equals the
    reference's, and the L2 output differs only by the fp32 order of the two stacks' sums (at most one BF16 step
    anywhere); BF16 GEMM outputs (the fallback) stay within the bench's tolerance."""
    inputs = _small_inputs(3)
    fake = FakeScaledMm()
    pipeline = bench_ffn.UnfusedCublas(inputs, SMALL.num_experts, SMALL.rows, out_dtype=out_dtype, scaled_mm=fake)
    out = pipeline.run().clone()
    e, c, h, i = SMALL.num_experts, SMALL.rows, SMALL.hidden, SMALL.intermediate
    assert fake.calls == [(c, 2 * i, h)] * e + [(2 * c, h, i)] * e
    for expert in range(e):
        expected = bench_ffn.ffn_reference_expert(SMALL, inputs, expert)
        got = out[expert]
        if out_dtype == torch.float32:
            rms = expected.float().pow(2).mean().sqrt()
            step = expected.float().abs() * 2.0**-7 + rms * 2.0**-20  # one BF16 step
            assert bool(((got.float() - expected.float()).abs() <= step).all())
            assert ref.rel_l2(got.float(), expected.float()) < 1e-3
        else:
            assert ref.rel_l2(got.float(), expected.float()) < bench_ffn.FFN_TOLERANCE_REL_L2
    # the stacks' zero halves stay zero, the live halves hold the codes
    q, _ = quant.requant_per64(ref.swiglu(pipeline.l1_out.view(e * c, 2 * i).float(), inputs.topk_weights,
                                          fast_math=True))
    stacks = pipeline.l2_a.view(e, 2, c, i // 128, 2, 64)
    codes = q.view(torch.uint8).view(e, c, i // 128, 2, 64)
    for g in range(2):
        assert torch.equal(stacks[:, g, :, :, g], codes[:, :, :, g])
        assert not bool(stacks[:, g, :, :, 1 - g].any())
    # a second run (a graph replay's situation: the buffers hold the previous run) gives the same output
    assert torch.equal(pipeline.run(), out)


def test_unfused_pipeline_per128_approximation() -> None:
    inputs = _small_inputs(4)
    fake = FakeScaledMm()
    pipeline = bench_ffn.UnfusedCublas(inputs, SMALL.num_experts, SMALL.rows, out_dtype=torch.float32, per64=False,
                                   scaled_mm=fake)
    out = pipeline.run()
    e, c, h, i = SMALL.num_experts, SMALL.rows, SMALL.hidden, SMALL.intermediate
    assert fake.calls == [(c, 2 * i, h)] * e + [(c, h, i)] * e
    for expert in range(e):
        err = ref.rel_l2(out[expert].float(), bench_ffn.ffn_reference_expert(SMALL, inputs, expert).float())
        assert 0 < err < bench_ffn.FFN_APPROX_TOLERANCE_REL_L2  # another recipe: close, not equal


@pytest.mark.parametrize("group", [64, 128])
def test_capturable_quantizer_is_bit_identical(group: int) -> None:
    """The baseline's requant (no host-to-device copy, so a CUDA graph can capture it) equals quant's bit for bit,
    all-zero groups, tiny and saturating values included."""
    g = torch.Generator().manual_seed(5)
    v = torch.randn(37, 1024, generator=g) * torch.logspace(-12, 3, 1024)[torch.randperm(1024, generator=g)]
    v[3, :256] = 0.0
    v[5, 64:192] = 1e-30
    expected = quant.requant_per64(v) if group == 64 else quant.per_token_cast_to_fp8(v)
    got = bench_ffn.quantize_groups_capturable(v, group)
    assert torch.equal(got[0].view(torch.uint8), expected[0].view(torch.uint8))
    assert torch.equal(got[1].view(torch.int32), expected[1].view(torch.int32))


@pytest.mark.parametrize("per64", [True, False])
def test_pipeline_run_has_no_host_round_trips(monkeypatch: pytest.MonkeyPatch, per64: bool) -> None:
    """run() is captured in a CUDA graph: no tensor built from host data, no value read back to the host."""
    pipeline = bench_ffn.UnfusedCublas(_small_inputs(6), SMALL.num_experts, SMALL.rows, out_dtype=torch.float32,
                                   per64=per64, scaled_mm=FakeScaledMm())

    def forbidden(*args, **kwargs):
        raise AssertionError("a host round trip inside the graphed pipeline")

    for name in ("item", "tolist", "new_tensor", "numpy", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    for name in ("tensor", "as_tensor", "from_numpy"):
        monkeypatch.setattr(torch, name, forbidden)
    pipeline.run()

