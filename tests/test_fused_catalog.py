"""compile tier: the fused kernel's variant catalog (issue: BLOCK_M x H {4096, 7168} x top-k {6, 8} x ranks
{1, 2, 8}, 32 local experts each, I 2048), each through every compile check of DESIGN section 3: builds for
sm_90a, issues QGMMA, 0 spills, 0 stack, no LDL/STL, no warning (no C75xx note: a WGMMA pipeline ptxas
serialized, or waits it inserted). The spills were the fused issue's last open step (notes/fused.md, "Spills");
each variant's bytes are still printed so a regression shows where it starts."""
from __future__ import annotations

import pytest

RANKS = (1, 2, 8)
HIDDENS = (4096, 7168)
TOPKS = (6, 8)
# expected tokens per expert that select each BLOCK_M bucket (heuristics.block_m_for)
EXPECTED_FOR_BLOCK_M = {32: 8.0, 64: 40.0, 128: 200.0}


def catalog() -> list:
    from megamoe.fused import config_for
    from megamoe.layout import SymmLayout

    return [config_for(SymmLayout.create(ranks, 32 * ranks, 4096, topk, hidden, 2048),
                       expected_tokens_per_expert=expected)
            for ranks in RANKS for hidden in HIDDENS for topk in TOPKS
            for expected in EXPECTED_FOR_BLOCK_M.values()]


@pytest.mark.compile
@pytest.mark.parametrize("idx", range(len(RANKS) * len(HIDDENS) * len(TOPKS) * len(EXPECTED_FOR_BLOCK_M)))
def test_fused_catalog_variant_compiles(idx: int) -> None:
    from megamoe.fused import compile_fused
    from megamoe.jit import checks

    config = catalog()[idx]
    assert config.block_m == list(EXPECTED_FOR_BLOCK_M)[idx % len(EXPECTED_FOR_BLOCK_M)]
    result = compile_fused(config)
    problems = checks.violations(result, checks.CheckOptions(expect_qgmma=True))
    print(f"{config.name}: {config.num_stages} GEMM stages, spills {result.entry.spill_store_bytes} B, "
          f"stack {result.entry.stack_frame_bytes} B")
    assert not problems, problems
