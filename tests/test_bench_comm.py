"""`megamoe bench comm` (megamoe.bench.comm) without a GPU: argument handling, the rank count, byte accounting,
targets, the table and JSON from fake per-rank records, and the kernel variants it launches (compile tier). Its
NCCL baseline: test_bench_comm_nccl.py; its one-process-per-rank run: test_ranks.py."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from rich.console import Console  # noqa: E402

from megamoe import bench, cli, heuristics  # noqa: E402
from megamoe.bench import comm as bench_comm  # noqa: E402
from megamoe.layout import SymmLayout  # noqa: E402

H4096, H7168 = bench_comm.COMM_SHAPES


# ---------------------------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------------------------


def _options(*argv: str) -> dict:
    return cli.bench_options(cli.parse_args(["bench", *argv]))


def test_cli_defaults_and_options() -> None:
    assert _options("comm") == {"tokens": [8, 128, 4096], "warmup": 10, "iters": 50}
    assert _options("comm", "--tokens", "128,4096", "--iters", "40", "--warmup", "3") == {
        "tokens": [128, 4096], "warmup": 3, "iters": 40}
    assert _options("comm", "--compile-only") == {"tokens": [8, 128, 4096], "ranks": [2, 4, 8]}
    assert _options("comm", "--compile-only", "--ranks", "2", "--tokens", "8") == {"tokens": [8], "ranks": [2]}
    assert _options("gemm") == {}


@pytest.mark.parametrize("argv,match", [
    (["gemm", "--tokens", "8"], "only apply to `megamoe bench comm`"),
    (["gemm", "--compile-only"], "only apply"),
    (["comm", "--tokens", "8,x"], "comma-separated integers"),
    (["comm", "--tokens", ","], "comma-separated integers"),
    (["comm", "--tokens", "0,128"], "positive"),
    (["comm", "--tokens", "128,128"], "distinct"),
    (["comm", "--iters", "0"], "iters must be >= 1"),
    (["comm", "--warmup", "0"], "warmup must be >= 1"),
    (["comm", "--ranks", "2"], "--ranks only applies with --compile-only"),
])
def test_cli_rejects(argv: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cli.bench_options(cli.parse_args(["bench"] + argv))
    with pytest.raises(SystemExit, match=match):  # _cmd_bench turns it into a clean exit
        cli._cmd_bench(cli.parse_args(["bench"] + argv))


def test_cli_rejects_unknown_bench() -> None:
    with pytest.raises(SystemExit):
        cli.main(["bench", "nope"])
    with pytest.raises(ValueError, match="bench must be one of"):
        bench.main("nope")


@pytest.mark.parametrize("count,match", [(0, "at least 2 GPUs"), (1, "at least 2 GPUs"), (3, "do not divide"),
                                         (5, "do not divide"), (9, "at most 8")])
def test_rank_count_errors(count: int, match: str) -> None:
    with pytest.raises(SystemExit, match=match):
        bench_comm.comm_num_ranks(count)


def test_rank_count_from_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [bench_comm.comm_num_ranks(n) for n in (2, 4, 8)] == [2, 4, 8]
    # bench_comm takes every visible GPU and refuses fewer than two before it spawns anything
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit, match="at least 2 GPUs"):
        bench_comm.bench_comm()


# ---------------------------------------------------------------------------------------------------------------
# Byte accounting and targets
# ---------------------------------------------------------------------------------------------------------------


def test_row_bytes() -> None:
    assert bench_comm.dispatch_row_bytes(4096) == 4096 + 32 * 4 + 4 == 4228
    assert bench_comm.dispatch_row_bytes(7168) == 7168 + 56 * 4 + 4 == 7396
    assert bench_comm.combine_row_bytes(4096) == 8192 and bench_comm.combine_row_bytes(7168) == 14336


def test_count_remote_rows() -> None:
    # 4 local experts per rank; rank 1 owns experts 4..7
    idx = torch.tensor([[0, 4, 5], [7, -1, 3], [-1, -1, -1], [6, 8, 11]])
    assert bench_comm.count_remote_rows(idx, 1, 4) == 4  # 0, 3, 8, 11
    assert bench_comm.count_remote_rows(idx, 0, 4) == 6  # 4, 5, 7, 6, 8, 11
    assert bench_comm.count_remote_rows(torch.empty(0, 6, dtype=torch.int64), 0, 4) == 0


def test_remote_bytes_and_gbps() -> None:
    # 128 tokens per rank, H = 7168, topk 8, 2 ranks, uniform: half the slots are remote
    rows = bench_comm.expected_remote_rows(128, 8, 2)
    assert rows == 512
    dispatch, combine = bench_comm.remote_bytes_per_direction(2 * rows, 2, 7168)  # summed over both ranks
    assert dispatch == 512 * 7396 and combine == 512 * 14336
    us_at_copy = (dispatch + combine) / (bench_comm.NVLINK_COPY_GBPS * 1e3)
    assert 30.0 < us_at_copy < 31.5  # the "its bytes alone take ~31 us at 360 GB/s"
    assert bench_comm.gbps_per_direction(dispatch, combine, us_at_copy) == pytest.approx(bench_comm.NVLINK_COPY_GBPS)
    assert bench_comm.gbps_per_direction(dispatch, combine, None) is None
    assert bench_comm.gbps_per_direction(dispatch, combine, 0.0) is None
    # 8 ranks: 7/8 of the slots are remote
    assert bench_comm.expected_remote_rows(4096, 6, 8) == 4096 * 6 * 7 / 8


def test_targets() -> None:
    cases = {c.name: c for c in bench_comm.comm_cases()}
    assert list(cases) == [f"{s.name} T={t}" for s in (H4096, H7168) for t in (8, 128, 4096)]
    assert cases["H4096 topk6 E256 T=8"].target is None
    t40, t60 = cases["H4096 topk6 E256 T=128"].target, cases["H7168 topk8 E384 T=128"].target
    assert t40 == bench_comm.CommTarget(max_round_trip_us=40.0) and t60 == bench_comm.CommTarget(max_round_trip_us=60.0)
    bw = cases["H7168 topk8 E384 T=4096"].target
    assert bw == bench_comm.CommTarget(min_gbps=290.0) == cases["H4096 topk6 E256 T=4096"].target
    assert t40.describe() == "< 40 us" and bw.describe() == ">= 290 GB/s"
    assert t40.met(39.9, None) and not t40.met(40.0, 999.0) and t40.met(None, None) is None
    assert bw.met(1000.0, 290.0) and not bw.met(1000.0, 289.9) and not bw.met(1000.0, None)


# ---------------------------------------------------------------------------------------------------------------
# Table and JSON from fake per-rank records
# ---------------------------------------------------------------------------------------------------------------


def fake_record(remote_rows: int, eager: float, graphed: float | None, ours: float, *, captured: bool = True,
                host_bound: float = 0.0) -> dict:
    """One rank's record of one case, as _comm_case_on_rank returns it (also the harness tests' fake case)."""
    return {
        "remote_rows": remote_rows,
        "nccl_eager": {"round_trip_us": eager, "dispatch_us": eager * 0.6, "combine_us": eager * 0.3},
        "nccl_graphed": {"graphed": captured, "note": "" if captured else "rank 1: RuntimeError: no capture",
                         "median_us": graphed, "mean_us": graphed, "min_us": graphed, "max_us": graphed,
                         "host_us_per_call": 10.0, "sleep_us": 1000.0, "host_bound": host_bound},
        "ours": {"median_us": ours, "us_per_call": ours + 1, "min_us": ours, "max_us": ours,
                 "host_us_per_call": 40.0, "sleep_us": 3000.0, "host_bound": 0.0, "block_m": 32.0},
    }


def test_assemble_table_and_json(tmp_path) -> None:
    cases = [bench_comm.CommCase(H4096, 128), bench_comm.CommCase(H7168, 4096)]
    records = [  # [rank][case]
        [fake_record(380, 106.0, 60.0, 35.0), fake_record(16390, 3000.0, 2000.0, 1200.0)],
        [fake_record(388, 104.0, 61.0, 38.5),
         fake_record(16378, 3100.0, 2100.0, 1190.0, captured=False, host_bound=1.0)],
    ]
    results = bench_comm.assemble_comm_results(cases, records, 2, device="NVIDIA H200", warmup=10, iters=50)
    small, large = results
    assert small.remote_rows == 384 and small.dispatch_bytes == 384 * 4228 and small.combine_bytes == 384 * 8192
    eager, graphed, ours = small.measurements
    assert eager.round_trip_us == 106.0 and eager.per_rank_us == [106.0, 104.0]  # the slowest rank
    assert eager.dispatch_us == pytest.approx(106.0 * 0.6) and "dispatch 63.6 / combine 31.8 us" in eager.note
    assert graphed.impl == "NCCL all_to_all_single, CUDA graph" and graphed.round_trip_us == 61.0
    assert ours.round_trip_us == 38.5 and ours.target == "< 40 us" and ours.met is True
    assert ours.gbps == pytest.approx((384 * 4228 + 384 * 8192) / 38.5 / 1e3)
    assert eager.met is None and eager.target == "-"  # targets are ours
    assert "BLOCK_M 32" in ours.note
    eager, graphed, ours = large.measurements
    assert "graph capture failed (rank 1: RuntimeError: no capture)" in graphed.note and "host-bound" in graphed.note
    assert graphed.impl == "NCCL all_to_all_single, fixed splits"
    assert large.remote_rows == 16384 and ours.round_trip_us == 1200.0
    assert ours.gbps == pytest.approx(16384 * (7396 + 14336) / 1200.0 / 1e3) and ours.met is True  # ~297 GB/s

    console = Console(record=True, width=250)
    console.print(bench_comm.comm_results_table("megamoe bench comm on 2 x NVIDIA H200", results))
    text = console.export_text()
    for col in ("case", "implementation", "round trip (us)", "remote MB per direction", "GB/s per direction",
                "% of 360 GB/s", "target", "met?"):
        assert col in text
    assert "H4096 topk6 E256 T=128" in text and "< 40 us" in text and ">= 290 GB/s" in text and "yes" in text
    caption = " ".join(text.split())  # the caption wraps
    assert bench_comm.comm_formula(results) in caption
    assert "(dispatch remote bytes + combine remote bytes) / round trip" in caption and "50 iterations" in caption
    assert "4.77" in text  # remote MB per direction of the first case: 384 x (4228 + 8192) B

    # JSON the way main writes it
    payload = {"bench": "comm", "formula": bench_comm.comm_formula(results), "results": [r.as_json() for r in results]}
    path = tmp_path / "comm.json"
    path.write_text(json.dumps(payload, indent=1))
    back = json.loads(path.read_text())
    assert back["results"][0]["measurements"][2]["met"] is True
    assert back["results"][1]["target"] == {"max_round_trip_us": None, "min_gbps": 290.0}


def test_variant_rows() -> None:
    """Records with every variant: one row per variant after the NCCL rows, in COMM_VARIANTS order, each judged
    against the target."""
    case = bench_comm.CommCase(H4096, 128)
    recs = []
    for rank in range(2):
        rec = fake_record(384, 100.0, 60.0, 36.0 + rank)
        rec["ours_legacy"] = dict(rec["ours"], median_us=46.0 + rank)
        rec["ours_fused_pull"] = dict(rec["ours"], median_us=39.5)
        recs.append([rec])
    (result,) = bench_comm.assemble_comm_results([case], recs, 2)
    impls = [m.impl for m in result.measurements]
    assert impls[2:] == [label for _, _, label in bench_comm.COMM_VARIANTS]
    legacy, default, fused = result.measurements[2:]
    assert legacy.round_trip_us == 47.0 and legacy.met is False
    assert default.round_trip_us == 37.0 and default.met is True and fused.met is True


def test_missed_target_and_missing_rank() -> None:
    case = bench_comm.CommCase(H7168, 128)
    records = [[fake_record(512, 100.0, 70.0, 65.0)], [fake_record(512, 100.0, 70.0, 50.0)]]
    (result,) = bench_comm.assemble_comm_results([case], records, 2)
    assert result.measurements[2].round_trip_us == 65.0 and result.measurements[2].met is False
    console = Console(record=True, width=250)
    console.print(bench_comm.comm_results_table("t", [result]))
    assert "NO" in console.export_text()
    with pytest.raises(ValueError, match="2 ranks x 1 cases"):
        bench_comm.assemble_comm_results([case], records[:1], 2)


# ---------------------------------------------------------------------------------------------------------------
# The kernel variants the bench launches
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_kernel_configs(num_ranks: int) -> None:
    configs = bench_comm.comm_kernel_configs(num_ranks)
    n = 6 * len(bench_comm.COMM_VARIANTS)  # every case x (legacy, default, fused pull)
    assert len(configs) == n and len({c.name for _, c in configs}) == n
    assert [k for k, _, _ in bench_comm.COMM_VARIANTS] == ["ours_legacy", "ours", "ours_fused_pull"]
    assert sum(c.is_legacy for _, c in configs) == 6 and sum(c.pull_warps == 2 for _, c in configs) == 6
    for case, config in configs:
        s = case.shape
        # the launch's BLOCK_M is the buffer's own (SymmBuffer.config() on an H200)
        expected = heuristics.select_config(num_ranks, s.num_experts, case.tokens, s.num_topk, s.hidden,
                                            s.intermediate, num_sms=heuristics.DEFAULT_NUM_SMS).block_m
        assert config.block_m == expected and config.bulk_pull
        assert config.layout == SymmLayout.create(num_ranks, s.num_experts, case.tokens, s.num_topk, s.hidden,
                                                  s.intermediate)
        assert f"_r{num_ranks}_" in config.name and f"_t{case.tokens}_" in config.name
        assert config.smem_bytes <= heuristics.SMEM_CAPACITY_BYTES


@pytest.mark.compile
def test_two_rank_variants_compile_clean() -> None:
    from megamoe.jit import checks

    results = bench_comm.precompile_comm([2])
    assert len(results) == 6 * len(bench_comm.COMM_VARIANTS)
    for result in results:
        assert checks.violations(result) == [], result.ptxas_log
