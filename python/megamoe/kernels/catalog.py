"""Every kernel variant the gpu tier and the benchmarks launch, in one list: the compile tier checks each of them
(DESIGN section 3) and `megamoe jit warm` compiles them ahead, so a GPU machine runs from the carried cache."""
from __future__ import annotations

from megamoe.jit import compiler
from megamoe.jit.checks import CheckOptions
from megamoe.kernels import expert_ffn, gemm, input_cast, smoke

# Per-expert row counts of the random-input GEMM tests (DESIGN / issue: 0, non-multiples of BLOCK_M, ...).
GEMM_RANDOM_COUNTS = [0, 1, 31, 32, 33, 63, 64, 65, 127, 128, 129, 1000]
GEMM_EXACT_COUNTS = [0, 1, 33, 64, 129, 200]

GEMM_EXACT_CONFIGS = [gemm.GemmConfig(block_m, mode, n, k, len(GEMM_EXACT_COUNTS))
                      for block_m in (32, 64, 128) for mode, n, k in (("l1", 1024, 2048), ("l2", 1024, 1024))]
# The consumer's schedule paths, bit-exact: K-block counts 1 to 7, 9 and 11 in both modes (it peels the first and the
# last block and loops over block pairs, with an odd count one more block after the loop; L2 mode peels every block
# up to 7), and bands of 3 m-blocks in the tile order (bands cut short at an expert's end)
GEMM_SCHEDULE_CONFIGS = [
    gemm.GemmConfig(block_m, mode, 1024, 128 * num_k_blocks, len(GEMM_EXACT_COUNTS))
    for block_m in (128, 32) for mode in ("l1", "l2") for num_k_blocks in (1, 2, 3, 4, 5, 6, 7, 9, 11)
] + [gemm.GemmConfig(block_m, mode, 1024, 1024, len(GEMM_EXACT_COUNTS), band_m=3)
     for block_m, mode in ((32, "l1"), (32, "l2"), (128, "l1"))]
# A shared by clusters of 2 CTAs along N (TMA multicast), bit-exact in both modes
GEMM_CLUSTER_CONFIGS = [gemm.GemmConfig(128, mode, 1024, k, len(GEMM_EXACT_COUNTS), cluster_n=2)
                        for mode, k in (("l1", 2048), ("l2", 1024))]
# (mode, N, K) covering K in {2048, 4096, 7168} and N in {2048, 4096, 6144}, each BLOCK_M at least once
GEMM_RANDOM_CONFIGS = [
    gemm.GemmConfig(128, "l1", 6144, 7168, len(GEMM_RANDOM_COUNTS)),
    gemm.GemmConfig(64, "l1", 4096, 4096, len(GEMM_RANDOM_COUNTS)),
    gemm.GemmConfig(32, "l1", 2048, 2048, len(GEMM_RANDOM_COUNTS)),
    gemm.GemmConfig(128, "l2", 4096, 2048, len(GEMM_RANDOM_COUNTS)),
    gemm.GemmConfig(64, "l2", 6144, 4096, len(GEMM_RANDOM_COUNTS)),
    gemm.GemmConfig(32, "l2", 2048, 7168, len(GEMM_RANDOM_COUNTS)),
]
GEMM_BENCH_CONFIGS = [
    gemm.GemmConfig(64, "l1", 4096, 4096, 32),    # decode-like: 32 groups x 24 rows
    gemm.GemmConfig(128, "l1", 4096, 4096, 32),   # prefill-like: 32 groups x 1536 rows
    gemm.GemmConfig(128, "l1", 4096, 7168, 4),    # 4 groups x 8192 rows
    gemm.GemmConfig(128, "l2", 4096, 2048, 32),   # L2 mode: 32 groups x 1536 rows
    gemm.GemmConfig(128, "l1", 4096, 2048, 32),   # the L2 row's shape in L1 mode
    gemm.GemmConfig(128, "l1", 4096, 4096, 32, cluster_n=2),  # the same two L1 rows, A shared by 2-CTA clusters
    gemm.GemmConfig(128, "l1", 4096, 7168, 4, cluster_n=2),
]
SMOKE_CONFIGS = [smoke.SmokeConfig(32, 32, True), smoke.SmokeConfig(32, 64, False)]

# Expert FFN unit kernel (epilogue component, assembler/expert_ffn_kernel.cuh). Exact tier: small-integer inputs,
# debug build (fp32 L1 accumulators), every BLOCK_M with (no clamp, exact math) and (clamp, fast math), plus the two
# issue shapes once. Random tier: BLOCK_M x clamp x math x the two shapes H x I.
FFN_EXACT_COUNTS = [0, 1, 33, 64, 129, 200]
FFN_RANDOM_COUNTS = [0, 1, 31, 32, 33, 63, 64, 65, 127, 128, 129, 1000]
FFN_SHAPES = ((4096, 2048), (7168, 3072))
FFN_EXACT_CONFIGS = [
    expert_ffn.ExpertFfnConfig(block_m, 2048, 1024, len(FFN_EXACT_COUNTS), clamp, fast, debug_l1_acc=True)
    for block_m in (32, 64, 128) for clamp, fast in ((False, False), (True, True))
] + [
    expert_ffn.ExpertFfnConfig(128, 7168, 3072, len(FFN_EXACT_COUNTS), True, False, debug_l1_acc=True),
    expert_ffn.ExpertFfnConfig(32, 4096, 2048, len(FFN_EXACT_COUNTS), False, True, debug_l1_acc=True),
]
FFN_RANDOM_CONFIGS = [
    expert_ffn.ExpertFfnConfig(block_m, hidden, intermediate, len(FFN_RANDOM_COUNTS), clamp, fast)
    for hidden, intermediate in FFN_SHAPES for clamp in (False, True) for fast in (False, True)
    for block_m in (32, 64, 128)
]
# `megamoe bench ffn` (bench.ffn.FFN_CASES): 32 experts, H 4096, I 2048, fast math, no clamp; decode-like 24 rows per
# expert (BLOCK_M 32) and prefill-like 1536 (BLOCK_M 128)
FFN_BENCH_CONFIGS = [
    expert_ffn.ExpertFfnConfig(32, 4096, 2048, 32, clamp=False, fast_math=True),
    expert_ffn.ExpertFfnConfig(128, 4096, 2048, 32, clamp=False, fast_math=True),
]
# The layer's input fill (megamoe.layer.MoELayer): the gpu tier's shapes (H 1024 / 4096 / 7168, top-6 / 8, int32 and
# int64 ids)
INPUT_CAST_CONFIGS = [input_cast.InputCastConfig(hidden, topk, idx64)
                      for hidden, topk in ((1024, 6), (4096, 6), (7168, 8)) for idx64 in (False, True)]


def all_variants() -> list[tuple[str, object, CheckOptions]]:
    """(name, config, compile checks) for every variant, deduplicated."""
    out: dict[str, tuple[str, object, CheckOptions]] = {}
    for config in SMOKE_CONFIGS:
        out[config.name] = (config.name, config, CheckOptions())
    # Every GEMM consumer promotes and awaits its next stage while a WGMMA group runs (with two K blocks or more;
    # a single block has neither a previous partial nor a next stage)
    gemm_checks = CheckOptions(expect_qgmma=True, expect_promotion_in_flight=True, expect_stage_wait_in_flight=True)
    single_block_checks = CheckOptions(expect_qgmma=True)
    for config in (GEMM_EXACT_CONFIGS + GEMM_SCHEDULE_CONFIGS + GEMM_CLUSTER_CONFIGS + GEMM_RANDOM_CONFIGS +
                   GEMM_BENCH_CONFIGS):
        out[config.name] = (config.name, config, gemm_checks if config.k > 128 else single_block_checks)
    for config in FFN_EXACT_CONFIGS + FFN_RANDOM_CONFIGS + FFN_BENCH_CONFIGS:
        out[config.name] = (config.name, config, gemm_checks)
    for config in INPUT_CAST_CONFIGS:
        out[config.name] = (config.name, config, CheckOptions())
    return list(out.values())


def compile_variant(config: object) -> compiler.CompileResult:
    if isinstance(config, smoke.SmokeConfig):
        return smoke.compile_smoke(config)
    if isinstance(config, gemm.GemmConfig):
        return gemm.compile_gemm(config)
    if isinstance(config, expert_ffn.ExpertFfnConfig):
        return expert_ffn.compile_expert_ffn(config)
    if isinstance(config, input_cast.InputCastConfig):
        return input_cast.compile_input_cast(config)
    raise TypeError(f"unknown kernel config {config!r}")
