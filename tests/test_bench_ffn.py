"""`megamoe bench ffn` without a GPU: the cases and their kernel variants, weight-byte / floor accounting, targets,
the table and JSON from fake timings, argument handling, the pool packing of the inputs, and the cuBLAS
baseline's torch pipeline (per-64 as two zero-padded stacks) against the exact reference, with a CPU stand-in for
`torch._scaled_mm` that enforces the blockwise layouts torch checks on the GPU."""
from __future__ import annotations

import json
from dataclasses import asdict

import pytest

torch = pytest.importorskip("torch")

from rich.console import Console  # noqa: E402

from megamoe import bench, bench_ffn, cli, quant  # noqa: E402
from megamoe import reference as ref  # noqa: E402
from megamoe.kernels import catalog  # noqa: E402

DECODE, PREFILL = bench_ffn.FFN_CASES


# ---------------------------------------------------------------------------------------------------------------
# Cases, accounting, targets
# ---------------------------------------------------------------------------------------------------------------


def test_cases_are_the_issue_loads() -> None:
    for case in (DECODE, PREFILL):
        assert (case.num_experts, case.hidden, case.intermediate) == (32, 4096, 2048)
    assert (DECODE.rows, DECODE.block_m, PREFILL.rows, PREFILL.block_m) == (24, 64, 1536, 128)
    assert DECODE.target.max_floor_ratio == 1.3 and PREFILL.target.max_floor_ratio is None
    for case in (DECODE, PREFILL):
        config = case.config
        assert (config.clamp, config.fast_math, config.debug_l1_acc, config.num_experts) == (False, True, False, 32)


def test_kernel_variants_are_in_the_catalog() -> None:
    """`megamoe jit warm` compiles every variant the bench launches (so the device runs from the carried cache)."""
    names = {name for name, _, _ in catalog.all_variants()}
    configs = bench_ffn.ffn_kernel_configs()
    assert [c.name for c in configs] == [c.name for c in catalog.FFN_BENCH_CONFIGS]
    assert all(c.name in names for c in configs)


def test_weight_bytes_and_floor() -> None:
    assert bench_ffn.ffn_weight_bytes(32, 4096, 2048) == 805_306_368  # the issue's 805 MB
    assert DECODE.weight_bytes == PREFILL.weight_bytes == 805_306_368
    assert DECODE.floor_us == pytest.approx(184.7, abs=0.05)  # the issue's 185 us at 4.36 TB/s
    assert bench_ffn.weight_floor_us(4.36e6) == pytest.approx(1.0)
    assert bench_ffn.ffn_flops(32, 24, 4096, 2048) == 6.0 * 32 * 24 * 4096 * 2048
    assert PREFILL.flops == pytest.approx(2.474e12, rel=1e-3)


def test_targets() -> None:
    floor = DECODE.floor_us
    t = DECODE.target
    assert "faster than cuBLAS unfused" in t.describe(floor) and "<= 1.3x floor (240 us)" in t.describe(floor)
    assert t.met(200.0, 700.0, floor) is True
    assert t.met(241.0, 700.0, floor) is False       # slower than 1.3x the floor
    assert t.met(200.0, 190.0, floor) is False       # not faster than cuBLAS
    assert t.met(200.0, None, floor) is None         # no baseline: cannot say
    assert t.met(300.0, None, floor) is False        # ... unless a checkable part fails
    assert t.met(None, 700.0, floor) is None
    p = PREFILL.target
    assert p.describe(PREFILL.floor_us) == "faster than cuBLAS unfused"
    assert p.met(3000.0, 5000.0, PREFILL.floor_us) is True
    assert p.met(5000.0, 5000.0, PREFILL.floor_us) is False


# ---------------------------------------------------------------------------------------------------------------
# Table and JSON from fake timings
# ---------------------------------------------------------------------------------------------------------------


def _result(case, base, approx, ours, note="") -> bench_ffn.FfnCaseResult:
    result = bench_ffn.FfnCaseResult.of(case, device="NVIDIA H200", warmup=5, iters=30, seed=0)
    result.add("cuBLAS unfused", base, "fp32 out", baseline_us=base)
    result.add("cuBLAS approx", approx, "", baseline_us=base)
    result.add("megamoe", ours, note, baseline_us=base, target=case.target)
    return result


def test_table_and_json(tmp_path) -> None:
    results = [_result(DECODE, 740.0, 700.0, 220.0, "rel-L2 4.1e-03"), _result(PREFILL, 6000.0, 4800.0, 2900.0)]
    base, approx, ours = results[0].measurements
    assert base.speedup == pytest.approx(1.0) and approx.speedup == pytest.approx(740 / 700)
    assert ours.speedup == pytest.approx(740 / 220)
    assert ours.floor_ratio == pytest.approx(220 / 184.71, rel=1e-3)
    assert ours.weight_gbps == pytest.approx(805.306368e6 / 220 / 1e3)
    assert ours.tflops == pytest.approx(DECODE.flops / 220e-6 / 1e12)
    assert ours.met is True and base.met is None and base.target == "-"
    assert results[1].measurements[2].met is True

    console = Console(record=True, width=300)
    console.print(bench_ffn.ffn_results_table("megamoe bench ffn", results))
    text = console.export_text()
    for needle in ("decode 32x24 (floor 185 us)", "prefill 32x1536", "x of weight floor",
                   "speedup vs cuBLAS unfused", "3.36x", "1.19", "yes", "rel-L2 4.1e-03", "4.36 TB/s",
                   "<= 1.3x floor (240 us)"):
        assert needle in text, needle

    path = tmp_path / "ffn.json"
    path.write_text(json.dumps({"results": [asdict(r) for r in results]}))
    loaded = json.loads(path.read_text())["results"]
    assert loaded[0]["measurements"][2]["met"] is True and loaded[0]["floor_us"] == pytest.approx(184.71, rel=1e-3)


def test_table_missed_target_and_untimed_rows() -> None:
    results = [_result(DECODE, 700.0, None, 260.0), _result(PREFILL, None, None, None, "NOT TIMED")]
    assert results[0].measurements[2].met is False  # 260 us > 1.3 x 184.7 us
    assert results[1].measurements[2].met is None
    assert results[1].measurements[2].speedup is None and results[1].measurements[2].floor_ratio is None
    console = Console(record=True, width=300)
    console.print(bench_ffn.ffn_results_table("t", results))
    text = console.export_text()
    assert "NO" in text and "n/a" in text and "NOT TIMED" in text


# ---------------------------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------------------------


def test_cli_accepts_ffn() -> None:
    args = cli.parse_args(["bench", "ffn"])
    assert args.name == "ffn" and cli.bench_options(args) == {}
    assert cli.bench_options(cli.parse_args(["bench", "ffn", "--json", "x.json"])) == {}
    assert bench.resolve(bench.BENCHES["ffn"]) is bench_ffn.bench_ffn


@pytest.mark.parametrize("argv", [["ffn", "--tokens", "8"], ["ffn", "--compile-only"], ["ffn", "--iters", "3"]])
def test_cli_rejects_comm_options(argv: list[str]) -> None:
    with pytest.raises(ValueError, match="only apply to `megamoe bench comm`"):
        cli.bench_options(cli.parse_args(["bench"] + argv))
    with pytest.raises(SystemExit, match="only apply"):
        cli._cmd_bench(cli.parse_args(["bench"] + argv))


def test_main_needs_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main("ffn")


def test_bench_rejects_no_cases() -> None:
    with pytest.raises(ValueError, match="no ffn cases"):
        bench_ffn.bench_ffn(())


# ---------------------------------------------------------------------------------------------------------------
# Inputs and the cuBLAS pipeline on the CPU
# ---------------------------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------------------------
# The whole case on the CPU: stand-ins for cuBLAS, the kernel launch, CUDA graphs and the timer
# ---------------------------------------------------------------------------------------------------------------
class _FakeGpu:
    """Patches what bench_ffn_case needs from a GPU. The kernel stand-in writes the exact reference into the
    valid pool rows (times `ours_scale`: 1 is a correct kernel); times come from `times` in call order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, times: list[float], *, ours_scale: float = 1.0,
                 fail_fp32: bool = False) -> None:
        from megamoe.kernels import expert_ffn

        self.times = list(times)
        self.launches = 0
        self.fake_mm = FakeScaledMm()

        def scaled_mm(a, b, scale_a, scale_b, *, out_dtype, out):
            if fail_fp32 and out_dtype == torch.float32:
                raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul\nmore")
            return self.fake_mm(a, b, scale_a, scale_b, out_dtype=out_dtype, out=out)

        def run(config, pool, outputs, **kwargs):
            assert int(outputs.l1_done_count.abs().sum()) == 0  # zeroed before every launch
            self.launches += 1
            case = self.case
            rows = bench_ffn.ffn_pool_rows(case)
            expected = torch.cat([bench_ffn.ffn_reference_expert(case, self.inputs, e) for e in range(case.num_experts)])
            outputs.out[rows] = (expected.float() * ours_scale).to(torch.bfloat16)
            outputs.l1_done_count.fill_(config.num_l1_n_blocks)

        def fake_time(fn, *, warmup=5, iters=30):
            fn()
            return self.times.pop(0)

        monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
        monkeypatch.setattr(expert_ffn, "run", run)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "fake H200")
        monkeypatch.setattr(bench_ffn, "graphed", lambda fn, capture_error_mode="global": fn)
        monkeypatch.setattr(bench_ffn, "time_us", fake_time)

    def bench_case(self, case, seed: int = 0) -> bench_ffn.FfnCaseResult:
        self.case, self.inputs = case, bench_ffn.ffn_random_inputs(case, seed=seed, device="cpu")
        return bench_ffn.bench_ffn_case(case, self.inputs, warmup=1, iters=2)


def test_case_on_cpu_times_and_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeGpu(monkeypatch, [300.0, 250.0, 100.0])
    result = fake.bench_case(SMALL)
    base, approx, ours = result.measurements
    assert (base.time_us, approx.time_us, ours.time_us) == (300.0, 250.0, 100.0)
    assert ours.speedup == pytest.approx(3.0) and approx.speedup == pytest.approx(1.2)
    assert ours.met is True and ours.target == "faster than cuBLAS unfused"
    assert "out fp32" in base.note and "rel-L2 vs reference (expert 0)" in base.note
    assert "APPROXIMATION" in approx.note and "L2 out BF16" in approx.note
    assert "BLOCK_M 32" in ours.note and "after timing" in ours.note and "2.50x vs the per-128" in ours.note
    assert fake.launches == 2  # the checked eager launch, then the timed one
    assert result.device == "fake H200" and (result.warmup, result.iters) == (1, 2)
    json.dumps(asdict(result))


def test_case_on_cpu_bf16_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeGpu(monkeypatch, [300.0, 250.0, 100.0], fail_fp32=True)
    base, approx, ours = fake.bench_case(SMALL).measurements
    assert base.time_us == 300.0 and "out BF16" in base.note
    assert "fp32 out: RuntimeError: CUBLAS_STATUS_NOT_SUPPORTED" in base.note and "more" not in base.note
    assert ours.time_us == 100.0 and ours.met is True


def test_case_on_cpu_never_times_garbage(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeGpu(monkeypatch, [300.0, 250.0], ours_scale=1.1)  # 10% off: a broken kernel
    base, approx, ours = fake.bench_case(SMALL).measurements
    assert ours.time_us is None and ours.met is None and ours.note.startswith("NOT TIMED")
    assert fake.launches == 1 and base.time_us == 300.0
    console = Console(record=True, width=300)
    console.print(bench_ffn.ffn_results_table("t", [bench_ffn.FfnCaseResult.of(SMALL)]))  # an empty case renders too


def test_bench_ffn_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeGpu(monkeypatch, [300.0, 250.0, 100.0, 30.0, 20.0, 10.0])
    other = bench_ffn.FfnBenchCase("small 9", 3, 9, 512, 512, bench_ffn.FfnTarget(max_floor_ratio=1e9))
    cases = (SMALL, other)
    original = bench_ffn.bench_ffn_case

    def tracked(case, inputs, **kwargs):
        fake.case, fake.inputs = case, inputs
        return original(case, inputs, **kwargs)

    monkeypatch.setattr(bench_ffn, "bench_ffn_case", tracked)
    results = bench_ffn.bench_ffn(cases, warmup=1, iters=2, device="cpu")
    assert [r.case for r in results] == ["small", "small 9"] and [r.rows_per_expert for r in results] == [5, 9]
    assert results[1].measurements[2].met is True and "<= 1e+09x floor" in results[1].measurements[2].target
    with pytest.raises(ValueError, match="iters must be >= 1"):
        bench_ffn.bench_ffn(cases, iters=0, device="cpu")
