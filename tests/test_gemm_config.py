"""cpu: the GEMM unit kernel's configs (megamoe.kernels.gemm.GemmConfig) and the schedule knobs they compile in."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")

from megamoe.kernels import catalog, gemm  # noqa: E402


def test_names_unique_and_knobs_in_source() -> None:
    configs = (catalog.GEMM_EXACT_CONFIGS + catalog.GEMM_SCHEDULE_CONFIGS + catalog.GEMM_CLUSTER_CONFIGS
               + catalog.GEMM_RANDOM_CONFIGS + catalog.GEMM_BENCH_CONFIGS)
    distinct = {(c.block_m, c.mode, c.n, c.k, c.num_experts, c.band_m, c.prefetch, c.cluster_n) for c in configs}
    assert len({c.name for c in configs}) == len(distinct)
    default = gemm.GemmConfig(128, "l2", 4096, 2048, 32)
    assert default.band_m == 16 and default.prefetch
    assert default.name == f"megamoe_gemm_l2_m128_n4096_k2048_e32_s{default.num_stages}_b16"
    assert "grouped_gemm_impl<Traits, 32, 16, true,\n" in gemm.source(default)
    knobs = gemm.GemmConfig(64, "l1", 1024, 1024, 6, band_m=1, prefetch=False)
    assert knobs.name.endswith("_b1_nopf") and "grouped_gemm_impl<Traits, 6, 1, false,\n" in gemm.source(knobs)
    with pytest.raises(ValueError, match="band_m"):
        gemm.GemmConfig(128, "l1", 1024, 1024, 2, band_m=0)


def test_cluster_knob() -> None:
    multicast = gemm.GemmConfig(128, "l1", 1024, 2048, 6, cluster_n=2)
    assert multicast.name.endswith("_b16_c2") and "1024, 2048, 2>;" in gemm.source(multicast)
    assert "1024, 2048, 1>;" in gemm.source(gemm.GemmConfig(128, "l1", 1024, 2048, 6))
    for bad in (dict(block_m=64, n=1024), dict(block_m=128, n=1152), dict(block_m=128, n=1024, cluster_n=4)):
        with pytest.raises(ValueError, match="cluster_n"):
            gemm.GemmConfig(bad["block_m"], "l2", bad["n"], 1024, 2, cluster_n=bad.get("cluster_n", 2))
    # the bench's L1 prefill rows run A-multicast, and each bench case's config is in the catalog (compiled ahead)
    from megamoe.bench.gemm import GEMM_CASES

    bench_names = {c.name for c in catalog.GEMM_BENCH_CONFIGS}
    for case in GEMM_CASES:
        config = gemm.GemmConfig(case.block_m, case.mode, case.n, case.k, case.num_groups, cluster_n=case.cluster_n)
        assert config.name in bench_names, case


def test_schedule_cases_cover_the_consumer_paths() -> None:
    # K-block counts: one block, the smallest pair, L2 mode's fully peeled counts (up to 7), odd counts past them
    # (the extra block after the pair loop)
    k_blocks = {c.k // 128 for c in catalog.GEMM_SCHEDULE_CONFIGS}
    assert set(range(1, 8)) | {9, 11} <= k_blocks
    for mode in ("l1", "l2"):
        assert {c.k // 128 for c in catalog.GEMM_SCHEDULE_CONFIGS if c.mode == mode} == k_blocks
    # bands shorter than an expert's m-blocks, and cut short at its end
    banded = [c for c in catalog.GEMM_SCHEDULE_CONFIGS if c.band_m > 1 and c.band_m != 16]
    assert banded and all(max(-(-n // c.block_m) for n in catalog.GEMM_EXACT_COUNTS) % c.band_m for c in banded)


def test_output_staging_whole_tile() -> None:
    # the whole BF16 output tile is staged for the TMA store, next to as many ring stages as fit
    for block_m, num_stages in ((32, 8), (64, 8), (128, 5)):
        config = gemm.GemmConfig(block_m, "l2", 4096, 2048, 32)
        assert config.staging_bytes == block_m * 128 * 2
        assert config.num_stages == num_stages and config.smem_bytes <= gemm.SMEM_LIMIT
        assert "OutputStaging<Traits>::kKernelSmemBytes == " + str(config.smem_bytes) in gemm.source(config)


def test_store_box_rows() -> None:
    # the output's TMA store box is one math warpgroup's rows (StoreGroups)
    configs = [gemm.GemmConfig(block_m, "l1", 1024, 2048, 6) for block_m in (32, 64, 128)]
    assert [c.store_rows for c in configs] == [32, 64, 64]
    # ... which the generated source checks against the device's StoreGroups
    assert all(f"StoreGroups<Traits>::kNumRows == {c.store_rows}," in gemm.source(c) for c in configs)
