"""`megamoe bench fused` on the CPU: the routing of its cases, its variant list, its command line (the run itself
needs a GPU: bench tier, not a test)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from megamoe.bench import fused as bf  # noqa: E402
from megamoe.cli import bench_options, parse_args  # noqa: E402


def test_routed_inputs_are_topk_of_randn() -> None:
    x, x_sf, idx, w = bf.routed_inputs(64, 32, 6, 256, seed=1, device=torch.device("cpu"))
    assert x.shape == (64, 256) and x.dtype == torch.float8_e4m3fn and x_sf.shape == (64, 2)
    assert idx.shape == (64, 6) and idx.dtype == torch.int64
    scores = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    assert torch.equal(idx, scores.topk(6, dim=1).indices)
    assert torch.allclose(w.sum(dim=1), torch.ones(64)) and bool((w > 0).all())
    # distinct experts per token, a different routing per seed
    assert all(len(set(row)) == 6 for row in idx.tolist())
    assert not torch.equal(idx, bf.routed_inputs(64, 32, 6, 256, seed=2, device=torch.device("cpu"))[2])


def test_variants_and_cli() -> None:
    configs = bf.fused_kernel_configs()
    assert [getattr(c, "serial", None) for c in configs[:2]] == [True, False]
    assert configs[2].block_m == configs[0].block_m
    assert bench_options(parse_args(["bench", "fused", "--compile-only"])) == {}
    assert bench_options(parse_args(["bench", "fused", "--tokens", "8,128", "--wave-fill", "1,2,0"])) == {
        "tokens": [8, 128], "wave_fills": [1, 2, 0]}
    with pytest.raises(ValueError, match="only apply to `megamoe bench comm`"):
        bench_options(parse_args(["bench", "fused", "--iters", "8"]))
    with pytest.raises(ValueError, match="only apply to `megamoe bench fused`"):
        bench_options(parse_args(["bench", "comm", "--wave-fill", "1"]))
    with pytest.raises(ValueError, match="only apply to `megamoe bench fused`"):
        bench_options(parse_args(["bench", "comm", "--phases"]))
    assert bench_options(parse_args(["bench", "fused", "--phases"])) == {"phases": True}
    assert bench_options(parse_args(["bench", "fused", "--shape", "pro", "--tokens", "8"])) == {
        "shape": "pro", "tokens": [8]}
    assert bench_options(parse_args(["bench", "fused", "--shape", "e256", "--compile-only"])) == {"shape": "e256"}
    with pytest.raises(ValueError, match="only apply to `megamoe bench fused`"):
        bench_options(parse_args(["bench", "comm", "--shape", "pro"]))
    assert {c.layout.num_experts for c in bf.fused_kernel_configs("e256") if hasattr(c, "layout")} == {256}
    with pytest.raises(ValueError, match=">= 0"):
        bench_options(parse_args(["bench", "fused", "--wave-fill", "-1"]))
    # the chain's dispatch/combine unit kernel runs at the fused kernel's BLOCK_M
    assert configs[3].block_m == configs[0].block_m and type(configs[3]).__name__ == "DispatchCombineConfig"


def test_phases_table() -> None:
    """The --phases table from recorded marks: the overlap column says whether the first L1 tile started before
    the last pool block arrived."""
    from rich.console import Console

    from megamoe.fused.launch import PHASES

    def case(first_l1: float) -> bf.FusedCaseResult:
        marks = {"start": (0, 0), "head": (10, 12), "pull": (15, 80), "l1_start": (first_l1, 90),
                 "l2_start": (40, 150), "l2_done": (60, 158), "reduce": (160, 170), "end": (175, 180)}
        return bf.FusedCaseResult(case=f"T 1024 seed {first_l1}", shape="flash", tokens=1024, seed=0,
                                  experts_touched=32, max_rows=200, rows=6144, floor_us=184.7, block_m=128,
                                  y_rel_l2=4e-3, serial_equals_overlapped=True, warmup=1, iters=1,
                                  phases=[(n, *marks[n]) for n in PHASES])

    console = Console(width=240, record=True)
    console.print(bf.phases_table([case(20.0), case(85.0)]))
    text = console.export_text()
    assert "first L1 before last arrival" in text and "20.0 / 90.0" in text
    rows = [line for line in text.splitlines() if "T 1024 seed" in line]
    assert rows[0].rstrip(" │").endswith("yes") and rows[1].rstrip(" │").endswith("no")
    assert bf.phases_table([]) is None

    # The call's config, where it differs from the default, gets its own row right after the case's
    fitted = case(20.0)
    fitted.fitted_phases = [(n, lo + 1.0, hi + 1.0) for n, lo, hi in fitted.phases]
    console = Console(width=240, record=True)
    console.print(bf.phases_table([fitted, case(85.0)]))
    rows = [line for line in console.export_text().splitlines() if "T 1024 seed" in line]
    assert len(rows) == 3 and "call's config" in rows[1] and "21.0 / 91.0" in rows[1]
    assert "call's config" not in rows[0] + rows[2]

    # The main table (it runs after every GPU case: a name error in it lost a whole device run)
    # (an untimed baseline first, as when cuBLAS fails: the caption still counts the rounds of the timed rows)
    fitted.record(bf.FusedMeasurement(impl="cuBLAS", time_us=None, cold=False, note="NOT TIMED: no scaled_mm"))
    fitted.record(bf.FusedMeasurement(impl="fused", time_us=400.0, cold=True, x_floor=400.0 / 184.7,
                                      rounds_us=[401.0, 400.0, 399.0], note="rounds 399.0..401.0"))
    fields, table = bf.fused_report([fitted])
    console = Console(width=300, record=True)
    console.print(table)
    text = console.export_text()
    assert "E 32 H 4096 I 2048 top-6" in text and "400.0" in text and "rounds 399.0..401.0" in text
    assert "median over 3 rounds" in fields["formula"]


def test_targets(tmp_path: Path) -> None:
    """Issue 15's targets judged on one run: the seeds' median of the call's config where the bench timed it (else
    the default), against the unit kernel of the same rounds; cases without a target (Pro) and warm rows ignored."""
    def case(shape: str, tokens: int, seed: int, call_us: float, unit_us: float, floor: float = 184.7,
             fitted: bool = True, flops: float = 1e9) -> bf.FusedCaseResult:
        r = bf.FusedCaseResult(case=f"T {tokens} seed {seed}", shape=shape, tokens=tokens, seed=seed,
                               experts_touched=32, max_rows=4, rows=48, floor_us=floor, block_m=128, y_rel_l2=4e-3,
                               serial_equals_overlapped=True, warmup=1, iters=1)

        def row(impl: str, us: float, cold: bool = True) -> None:
            r.record(bf.FusedMeasurement(impl=impl, time_us=us, cold=cold, x_floor=us / floor,
                                         tflops=flops / us / 1e6))
        row("fused, overlapped", call_us + 50.0)  # the default: slower, judged only without the call's config
        if fitted:
            row("fused, overlapped, config for the call's load (BLOCK_M 32, 8 stages)", call_us)
            row("fused, overlapped, config for the call's load (BLOCK_M 32, 8 stages)", 1.0, cold=False)
        row("expert-FFN unit kernel, same rows (+ counter memset)", unit_us)
        return r

    results = [case("flash", 8, s, us, 180.0, floor=150.0) for s, us in enumerate((167.0, 170.0, 168.0))]
    results += [case("flash", 128, s, us, 215.0) for s, us in enumerate((220.0, 226.0, 221.0))]
    flops_4096 = 950e6 * 1300.0  # 950 TFLOP/s at 1300 us
    results += [case("flash", 4096, s, us, 1150.0, fitted=False, flops=flops_4096)
                for s, us in enumerate((1250.0, 1260.0, 1240.0))]  # default rows: +50 us each
    results += [case("pro", 8, 0, 500.0, 520.0)]
    targets = {t["target"]: t for t in bf.fused_targets(results)}
    assert set(targets) == {"flash T 8 x floor", "flash T 8 us", "flash T 128 x floor", "flash T 128 us - unit kernel",
                            "flash T 4096 TFLOP/s", "flash T 4096 unit kernel / fused"}
    assert targets["flash T 8 x floor"]["value"] == pytest.approx(168.0 / 150.0) and targets["flash T 8 x floor"]["met"]
    assert targets["flash T 8 us"]["met"] and targets["flash T 8 us"]["seeds"] == 3
    assert targets["flash T 128 x floor"]["value"] == pytest.approx(221.0 / 184.7)
    assert targets["flash T 128 x floor"]["met"]
    assert targets["flash T 128 us - unit kernel"]["value"] == pytest.approx(6.0)
    assert targets["flash T 128 us - unit kernel"]["met"]
    # T 4096 has no call's-config row: the default's 1300 / 1310 / 1290 us
    assert targets["flash T 4096 TFLOP/s"]["value"] == pytest.approx(950.0)
    assert targets["flash T 4096 TFLOP/s"]["met"]
    assert targets["flash T 4096 unit kernel / fused"]["value"] == pytest.approx(1150.0 / 1300.0)
    assert not targets["flash T 4096 unit kernel / fused"]["met"]
    caption = bf.targets_caption(list(targets.values()), "NVIDIA H100 80GB HBM3")
    assert "the targets assume an H200" in caption and "flash T 4096 unit kernel / fused 0.8846 (>= 0.9: [red]NO[/])" in caption
    assert "assume" not in bf.targets_caption(list(targets.values()), "NVIDIA H200")
    # the report carries them in its JSON fields and its caption
    fields, _ = bf.fused_report(results[:3])
    assert [t["target"] for t in fields["targets"]] == ["flash T 8 x floor", "flash T 8 us"]
    # a run's JSON reads back (scripts/fused_tables.py assembles a note's tables from several)
    assert [bf.FusedCaseResult.from_json(json.loads(json.dumps(r.as_json())), bf.FusedMeasurement)
            for r in results] == results
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"bench": "fused", **fields, "results": [r.as_json() for r in results]}))
    script = Path(__file__).resolve().parent.parent / "scripts" / "fused_tables.py"
    out = subprocess.run([sys.executable, str(script), str(path)], check=True, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(script.parent.parent / "python"))).stdout
    assert "| 8 | 167.0 / 170.0 / 168.0 (1.11-1.13x) | 180.0 / 180.0 / 180.0 |" in out
    # every fused variant's cold times per T (warm rows and the unit kernel left out)
    assert "| 8 | fused, overlapped | 217.0 / 220.0 / 218.0 |" in out
    assert "| 8 | fused, overlapped, config for the call's load (BLOCK_M 32, 8 stages) | 167.0 / 170.0 / 168.0 |" in out
    assert "| 8 | expert-FFN" not in out and "| 1.0" not in out
    assert "flash T 4096 unit kernel / fused 0.8846 (>= 0.9: NO)" in out and "pro:" in out


def test_routed_cublas_matches_the_reference() -> None:
    """The cuBLAS unfused baseline on a routing with masked slots and an empty expert, with a CPU stand-in for
    `torch._scaled_mm` (tests/test_bench_ffn_cublas.py): y within the bench's tolerance of reference.moe, and a
    second run (a graph replay's situation) gives the same y."""
    from test_bench_ffn_cublas import FakeScaledMm

    from megamoe import reference

    t, e, k, h, i = 24, 4, 2, 512, 512  # K / 128 a multiple of 4: the blockwise scale_b layout torch requires
    rc = reference.random_case(t, h, i, e, k, mask_prob=0.2, generator=torch.Generator().manual_seed(3))
    idx = rc.topk_idx[0].clone()
    idx[idx == 3] = -1  # expert 3 receives nothing
    natural = (rc.l1_weights[0], rc.l2_weights[0])  # ([E, 2I, H] e4m3, SF), ([E, H, I] e4m3, SF)
    y_ref = reference.moe(rc.x[0], rc.x_sf[0], idx, rc.topk_weights[0], natural[0], natural[1], fast_math=True)
    pipeline = bf.RoutedCublas(rc.x[0], rc.x_sf[0], idx, rc.topk_weights[0], natural, e, out_dtype=torch.float32,
                               scaled_mm=FakeScaledMm())
    y = pipeline.run().clone()
    err = reference.rel_l2(y.float(), y_ref.float())
    assert err < 1e-3, err
    assert torch.equal(pipeline.run(), y)
