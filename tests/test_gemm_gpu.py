"""gpu tier: the GEMM component's grouped FP8 GEMM against the reference of DESIGN section 4.

Bit-exact on small-integer inputs with power-of-two scales (check 0), in all three BLOCK_M modes and both SF modes
(L1: distinct gate/up weight scales; L2: per-64 activation scales); within measured tolerance on random inputs.
Output poisoned before every run; padding rows must stay poisoned."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from megamoe.kernels import catalog, gemm  # noqa: E402
from megamoe.reference import rel_l2  # noqa: E402

pytestmark = pytest.mark.gpu


def _poisoned_output(problem: gemm.GemmProblem) -> torch.Tensor:
    return torch.full((problem.num_pool_rows, problem.config.n), float("nan"), dtype=torch.bfloat16, device="cuda")


def _check_padding_untouched(problem: gemm.GemmProblem, d: torch.Tensor) -> None:
    valid = torch.zeros(problem.num_pool_rows, dtype=torch.bool, device="cuda")
    for e in range(problem.config.num_experts):
        valid[problem.rows(e)] = True
    assert bool(torch.isnan(d[~valid]).all()), "a padding row of the pool was written"


@pytest.mark.parametrize("config", catalog.GEMM_EXACT_CONFIGS, ids=lambda c: c.name)
def test_gemm_bit_exact(config: gemm.GemmConfig) -> None:
    for _ in range(2):  # fresh inputs each run
        problem = gemm.make_problem(config, catalog.GEMM_EXACT_COUNTS, small_int=True)
        if config.mode == "l1":  # the test must be able to catch a single scale per tile
            gate, up = problem.b_sf[:, : config.n // 256], problem.b_sf[:, config.n // 256:]
            assert (gate != up).float().mean() > 0.5
        d = _poisoned_output(problem)
        gemm.run_problem(problem, d)
        torch.cuda.synchronize()
        for e, count in enumerate(problem.counts):
            expected = problem.reference(e).to(torch.bfloat16)
            got = d[problem.rows(e)]
            mismatches = (got.view(torch.int16) != expected.view(torch.int16)).sum().item()
            assert mismatches == 0, f"expert {e} ({count} rows): {mismatches} of {got.numel()} BF16 outputs differ"
        _check_padding_untouched(problem, d)


# Tolerance (random inputs, BF16 outputs of fp32 accumulators): the kernel's WGMMA accumulates each 128-K block
# in the tensor cores' reduced precision, the reference exactly; both round to BF16 (rel 2^-9 = 2e-3).
# Measured on the H200 (see the closing note of the GEMM issue): rel-L2 per expert <= MAX_REL_L2.
MAX_REL_L2 = 2e-3


@pytest.mark.parametrize("config", catalog.GEMM_RANDOM_CONFIGS, ids=lambda c: c.name)
def test_gemm_random(config: gemm.GemmConfig) -> None:
    problem = gemm.make_problem(config, catalog.GEMM_RANDOM_COUNTS, small_int=False)
    d = _poisoned_output(problem)
    gemm.run_problem(problem, d)
    torch.cuda.synchronize()
    worst = 0.0
    for e, count in enumerate(problem.counts):
        if count == 0:
            continue
        got = d[problem.rows(e)].float()
        assert bool(torch.isfinite(got).all()), f"expert {e}: unwritten or non-finite outputs"
        err = rel_l2(got, problem.reference(e))
        worst = max(worst, err)
        assert err < MAX_REL_L2, f"expert {e} ({count} rows): rel-L2 {err:.3e}"
    _check_padding_untouched(problem, d)
    print(f"{config.name}: worst per-expert rel-L2 {worst:.3e}")


def test_gemm_repeated_calls_fewer_ctas() -> None:
    """Few CTAs walk many tiles: the ring's phases across tiles and experts must stay right."""
    config = catalog.GEMM_EXACT_CONFIGS[-1]
    problem = gemm.make_problem(config, catalog.GEMM_EXACT_COUNTS, small_int=True)
    expected = [problem.reference(e).to(torch.bfloat16) for e in range(config.num_experts)]
    for num_blocks in (1, 3, 7):
        d = _poisoned_output(problem)
        gemm.run_problem(problem, d, num_blocks=num_blocks)
        torch.cuda.synchronize()
        for e in range(config.num_experts):
            assert torch.equal(d[problem.rows(e)].view(torch.int16), expected[e].view(torch.int16)), (num_blocks, e)
