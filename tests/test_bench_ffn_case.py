"""One `megamoe bench ffn` case on the CPU (megamoe.bench.ffn.bench_ffn_case, bench_ffn): stand-ins for cuBLAS,
the kernel launch, CUDA graphs and the timer; the baseline checked before it is timed, the BF16 fallback, a wrong
kernel output never timed."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from rich.console import Console  # noqa: E402

from megamoe.bench import ffn as bench_ffn  # noqa: E402

from test_bench_ffn_cublas import SMALL, FakeScaledMm  # noqa: E402


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
    json.dumps(result.as_json())


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

