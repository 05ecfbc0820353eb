"""`megamoe bench ffn` (megamoe.bench.ffn) without a GPU: the cases and their kernel variants, weight-byte / floor
accounting, targets, the table and JSON from fake timings, and argument handling. Its inputs and cuBLAS baseline:
test_bench_ffn_cublas.py; a whole case on the CPU: test_bench_ffn_case.py."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from rich.console import Console  # noqa: E402

from megamoe import bench, cli  # noqa: E402
from megamoe.bench import ffn as bench_ffn  # noqa: E402
from megamoe.kernels import catalog  # noqa: E402

DECODE, PREFILL_768, PREFILL = bench_ffn.FFN_CASES


# ---------------------------------------------------------------------------------------------------------------
# Cases, accounting, targets
# ---------------------------------------------------------------------------------------------------------------


def test_cases_are_the_issue_loads() -> None:
    for case in (DECODE, PREFILL):
        assert (case.num_experts, case.hidden, case.intermediate) == (32, 4096, 2048)
    assert (DECODE.rows, DECODE.block_m, PREFILL.rows, PREFILL.block_m) == (24, 32, 1536, 128)
    assert (PREFILL_768.rows, PREFILL_768.block_m) == (768, 128)
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
    path.write_text(json.dumps({"results": [r.as_json() for r in results]}))
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
    assert bench.resolve("ffn") == (bench_ffn.bench_ffn, bench_ffn.ffn_report)


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

