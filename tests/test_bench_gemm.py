"""`megamoe bench gemm` without a GPU: the cases are the GEMM issue's loads, and the targets are judged right from
fake timings (met and missed on each side of every threshold)."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")

from megamoe.bench import gemm as bench_gemm  # noqa: E402
from megamoe.bench import timing  # noqa: E402


def _results(ours_us: dict[str, float], cublas_us: dict[str, float]) -> list[bench_gemm.GemmCaseResult]:
    results = []
    for case in bench_gemm.GEMM_CASES:
        flops = 2.0 * case.num_groups * case.rows * case.n * case.k
        result = bench_gemm.GemmCaseResult(case=case.name, flops=flops,
                                           weight_bytes=float(case.num_groups * case.n * case.k))
        result.add("megamoe", ours_us[case.name])
        result.add("cuBLAS blockwise loop (graphed)", cublas_us[case.name])
        results.append(result)
    return results


def _us_for(tflops: float, case: bench_gemm.GemmCase) -> float:
    return 2.0 * case.num_groups * case.rows * case.n * case.k / tflops / 1e6


def test_cases_are_the_issue_loads() -> None:
    shapes = {(c.num_groups, c.rows, c.n, c.k, c.mode) for c in bench_gemm.GEMM_CASES}
    assert {(32, 24, 4096, 4096, "l1"), (32, 1536, 4096, 4096, "l1"), (4, 8192, 4096, 7168, "l1"),
            (32, 1536, 4096, 2048, "l2"), (32, 1536, 4096, 2048, "l1"), (32, 768, 4096, 4096, "l1"),
            (32, 768, 4096, 2048, "l2")} == shapes


@pytest.mark.parametrize("good", [True, False])
def test_targets_judged_from_timings(good: bool) -> None:
    cases = {c.name: c for c in bench_gemm.GEMM_CASES}
    scale = 1.0 if good else 0.9  # 10% slower than the thresholds below allow
    ours = {
        "decode 32x24": cases["decode 32x24"].num_groups * 4096 * 4096 / (3.5e3 * scale) / 1e3,
        "prefill 32x1536": _us_for(1100 * scale, cases["prefill 32x1536"]),
        "4x8192 K7168": _us_for(1150 * scale, cases["4x8192 K7168"]),
        "L1 32x1536 K2048": _us_for(1100, cases["L1 32x1536 K2048"]),
        "L2 32x1536 K2048": _us_for(1100 * 0.85 * scale * scale, cases["L2 32x1536 K2048"]),
        # the 32 x 768 rows (the T = 4096 per-rank load) are reported, not judged yet
        "prefill 32x768": _us_for(1100, cases["prefill 32x768"]),
        "L2 32x768 K2048": _us_for(900, cases["L2 32x768 K2048"]),
    }
    cublas = {name: 1e4 for name in ours}
    cublas["prefill 32x1536"] = 1.05 * _us_for(1100, cases["prefill 32x1536"])
    targets = {t["target"]: t for t in bench_gemm.gemm_targets(_results(ours, cublas))}
    assert len(targets) == 5
    for target in targets.values():
        assert target["met"] is good, target
    assert targets["prefill / cuBLAS loop (speedup)"]["value"] == pytest.approx(1.05 * scale)
    assert targets["L2 / L1 same shape (K2048)"]["value"] == pytest.approx(0.85 * scale * scale)


def test_time_rounds_times_every_runner_once_per_round_in_shuffled_orders(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    runners = {name: (lambda name=name: calls.append(name)) for name in "abcdef"}
    monkeypatch.setattr(timing, "time_us", lambda fn, iters: (fn(), float(len(calls)))[1])
    times = timing.time_rounds(runners, rounds=4, iters=3)
    assert list(times) == list(runners)
    assert all(len(ts) == 4 for ts in times.values())
    rounds = [calls[i:i + 6] for i in range(0, 24, 6)]
    assert rounds[0] == list("abcdef")  # the first round in the given order
    assert all(sorted(r) == list("abcdef") for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1  # later rounds reordered
    assert timing.time_rounds(runners, rounds=4, iters=3) == {k: [v + 24 for v in ts] for k, ts in times.items()}


def test_shuffled_rounds_keeps_each_timers_results_in_round_order() -> None:
    """The fused bench's form: any key (here (runner, cold)), any result type (here time_queued_us's dicts)."""
    calls: list[tuple[str, bool]] = []
    timers = {(name, cold): (lambda key=(name, cold): (calls.append(key), {"median_us": float(len(calls))})[1])
              for name in "abc" for cold in (False, True)}
    results = timing.shuffled_rounds(timers, rounds=3)
    assert list(results) == list(timers) and all(len(r) == 3 for r in results.values())
    assert calls[:6] == list(timers)  # the first round in the given order
    for key, rs in results.items():  # each result is the one its own call returned, in round order
        positions = [i + 1 for i, c in enumerate(calls) if c == key]
        assert [r["median_us"] for r in rs] == positions
