"""gpu tier: the epilogue component through its unit kernel (megamoe.kernels.expert_ffn): L1 grouped GEMM + L1
epilogue (SwiGLU x top-k weight, per-64 FP8 requant, TMA store, L1 completion counters) -> L2 grouped GEMM + L2
epilogue (BF16 staging, valid rows out), one persistent launch whose L2 producer waits on the counters.

Every run: fresh random inputs (seed printed), outputs poisoned (NaN), pool padding rows NaN on input; padding rows
of used pool blocks must come out as exact zeros, spare pool blocks and the outputs' padding rows untouched, every
counter at 2I/128. Measured values are printed: run with -s. Thresholds are set from the H200 measurements
written beside them."""
from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from megamoe.kernels import catalog  # noqa: E402
from megamoe.kernels import expert_ffn as ef  # noqa: E402
from megamoe.testing import expert_ffn as tef  # noqa: E402
from megamoe.testing import expert_ffn_checks as efc  # noqa: E402

pytestmark = pytest.mark.gpu


def _seed() -> int:
    return random.SystemRandom().randrange(1 << 31)


# ---------------------------------------------------------------------------------------------------------------
# Check 0: small-integer inputs, power-of-two scales (DESIGN section 4). The L1 accumulators are exact, so they
# must match bit for bit; SwiGLU (a transcendental) may differ from torch's by ulps (exact math: the same
# 1 / (1 + expf(-g)) as torch.sigmoid, expected identical; fast math: __expf is off by up to ~2 + 1.16 |g| ulps,
# <= 2^-16 relative), so a code may flip by one step where the reference's value sits within that much of an
# FP8 rounding midpoint, and an SF by that relative amount. The L2 GEMM reads requantized activations, which are
# not small integers: the tensor cores' ~14-bit accumulation is not exact there, so its BF16 outputs are held to
# the GEMM test's bound (one BF16 step + EXCESS_FLOOR x the expert's RMS) against block_scaled_matmul of the
# kernel's own activations and SFs, and their mismatches counted (GEMM L2 mode on random data: 4.2-4.3% flips).
# ---------------------------------------------------------------------------------------------------------------
# Measured on the H200, 2026-11-29, 8 small-integer variants: L1 accumulators bit-exact; codes off 0; code excess
# 0 (exact) / 7.7e-21 amax (fast); SF mismatches 0; L2 outputs vs the kernel's own recomputation differ in
# <= 2.42% (excess <= 3.4e-4 RMS); per-slot rel-L2 vs the reference <= 4.4e-4. The ulp-level bounds below stay
# at the derivation above (they cannot be "measured down" to 0 without encoding one run's luck).
EXACT_L1_ACC_MISMATCHES = 0
EXACT_MAX_CODE_STEPS = 1
EXACT_CODE_EXCESS = {False: 2.0**-18, True: 2.0**-13}      # by fast_math, in units of the row amax
EXACT_FLIP_FRACTION = {False: 1e-3, True: 1e-2}
EXACT_SF_REL_ERR = {False: 2.0**-20, True: 2.0**-13}
OUT_EXCESS_FLOOR = 2.0**-9                                 # as tests/test_gemm_gpu.py (H200-measured there)
OUT_MISMATCH_FRACTION = 0.10                               # measured <= 6.1% (random tier), 2.4% (exact tier)
EXACT_OUT_REL_L2 = 2e-3                                    # measured <= 4.4e-4

# ---------------------------------------------------------------------------------------------------------------
# Check 1: random inputs against the reference's intermediates. The L1 accumulators carry the tensor cores'
# accumulation error (~1e-4 of the RMS, up to 1e-3 measured by the GEMM test), an absolute error that moves small
# codes (fine FP8 spacing) by more than one step: a CPU emulation with Gaussian errors of 2e-4 RMS on the L1
# accumulators (H 1024, I 512) gave 1.7% codes one step off, 0.17% two or more, excess 9e-4 amax, SF rel err 1e-3,
# per-slot rel-L2 5.7e-3 (DESIGN: 1.2% flips and 3.7e-3 with cuBLAS partials). So the bound is on the excess
# beyond the rounding of the reference's unrounded value on the code's own scale (a layout or scale bug gives
# ~0.1-1 amax), and the step histogram is reported.
# ---------------------------------------------------------------------------------------------------------------
# Measured on the H200, 2026-11-29, 24 random variants (BLOCK_M 32/64/128 x clamp x fast math x 4096x2048 and
# 7168x3072): code excess <= 9.7e-4 amax; codes one step off <= 1.11% (DESIGN's cuBLAS emulation: 1.2%), two or
# more <= 0.113% (all small values, where FP8 steps are finer than the accumulation error); SF rel err <= 1.04e-3;
# per-slot BF16 rel-L2 <= 8.4e-3. Thresholds ~2x the measurement.
# The excess is taken on each code's own SF scale (the SF the kernel stored beside it): on the expected SF's scale, a
# group's codes also carry the error of the group's own amax, which RANDOM_SF_REL_ERR bounds. Measured over 261
# random-tier cases on an H100 (scripts/ffn_code_excess.py, the debug variant, all 8 shape x clamp x math cases,
# 20-61 seeds each): code excess median 5-6e-4, max 1.15e-3 amax; SF rel err median 7-9e-4, max 1.92e-3 (the next
# 1.62e-3, 1.45e-3: 1.3x under its bound); every L1 accumulator within 1.15e-3 x its expert's accumulator RMS of
# the reference's. On the expected SF's scale the case with the 1.92e-3 SF had 2.09e-3 of excess (4.9e-4 on its
# own scale), over the bound below: that scale counted an SF error within its own bound as code error.
RANDOM_CODE_EXCESS = 2e-3            # in units of the group amax
RANDOM_ONE_STEP_FRACTION = 0.025
RANDOM_MULTI_STEP_FRACTION = 2.5e-3
RANDOM_SF_REL_ERR = 2.5e-3
RANDOM_OUT_REL_L2 = 1.5e-2           # per slot, vs the reference's BF16 output


def check_common(report: efc.FfnReport) -> None:
    assert report.errors == [], "\n".join(report.errors)
    assert report.out_excess <= OUT_EXCESS_FLOOR, f"L2 out beyond a BF16 step of its recomputation: {report.summary()}"
    assert report.out_mismatches <= OUT_MISMATCH_FRACTION * report.num_outputs, report.summary()


def check_epilogue(codes: efc.CodeStats, fast_math: bool) -> None:
    """The epilogue alone (codes against the reference epilogue of the same fp32 accumulators): only SwiGLU's ulps
    differ, so a code never moves by more than one step, and only at a rounding boundary."""
    assert codes.steps[2] == 0, f"a code off by more than {EXACT_MAX_CODE_STEPS} step: {codes.summary()}"
    assert codes.excess <= EXACT_CODE_EXCESS[fast_math], f"a flip off a rounding boundary: {codes.summary()}"
    assert codes.steps[1] <= EXACT_FLIP_FRACTION[fast_math] * sum(codes.steps), codes.summary()
    assert codes.sf_max_rel_err <= EXACT_SF_REL_ERR[fast_math], codes.summary()


def check_exact(report: efc.FfnReport, fast_math: bool) -> None:
    """Acceptance of check 0 (also run on simulated outputs by the cpu tier)."""
    check_common(report)
    assert report.l1_acc_mismatches == EXACT_L1_ACC_MISMATCHES, report.summary()
    check_epilogue(report.codes, fast_math)
    assert report.out_rel_l2 <= EXACT_OUT_REL_L2, report.summary()


def check_random(report: efc.FfnReport, fast_math: bool) -> None:
    """Acceptance of check 1 (also run on emulated outputs by the cpu tier). Codes >= 2 steps off the reference's
    are allowed (they come from the GEMM's accumulation error, see above) but bounded by the excess: a code two
    steps off lies a full step beyond the rounding, and a step at |s| is >= |s| / 16, so such codes sit at
    |value| <= 16 x RANDOM_CODE_EXCESS amax. With the kernel's own L1 accumulators (debug variants) the epilogue
    alone is held to check 0's bounds: never more than one step."""
    check_common(report)
    codes = report.codes
    assert codes.excess <= RANDOM_CODE_EXCESS, report.summary()
    assert codes.steps[1] <= RANDOM_ONE_STEP_FRACTION * report.num_codes, report.summary()
    assert codes.steps[2] <= RANDOM_MULTI_STEP_FRACTION * report.num_codes, report.summary()
    assert codes.sf_max_rel_err <= RANDOM_SF_REL_ERR, report.summary()
    assert report.out_rel_l2 <= RANDOM_OUT_REL_L2, report.summary()
    if report.own_codes is not None:
        check_epilogue(report.own_codes, fast_math)


def _run(problem: tef.FfnProblem, num_blocks: int | None = None) -> ef.FfnOutputs:
    outputs = ef.new_outputs(problem.config, problem.num_pool_rows)
    tef.run_problem(problem, outputs, num_blocks=num_blocks)
    torch.cuda.synchronize()
    return outputs


@pytest.mark.parametrize("config", catalog.FFN_EXACT_CONFIGS, ids=lambda c: c.name)
def test_expert_ffn_small_int(config: ef.ExpertFfnConfig) -> None:
    seed = _seed()
    problem = tef.make_problem(config, catalog.FFN_EXACT_COUNTS, small_int=True,
                              activation_clamp="auto" if config.clamp else None, seed=seed)
    # The test must be able to catch a single weight scale per L1 tile (DESIGN section 4)
    w1_sf = problem.inputs.w1_sf
    assert (w1_sf[:, : w1_sf.shape[1] // 2] != w1_sf[:, w1_sf.shape[1] // 2:]).float().mean() > 0.5
    report = efc.compare(problem, _run(problem))
    print(f"\n{config.name} seed {seed} clamp {problem.activation_clamp}: {report.summary()}")
    check_exact(report, config.fast_math)


# One reference case per (shape, clamp, math), shared by the BLOCK_M variants that follow it in the list.
_case_cache: dict[tuple, tef.FfnCase] = {}


def _random_case(config: ef.ExpertFfnConfig) -> tef.FfnCase:
    key = (config.hidden, config.intermediate, config.clamp, config.fast_math)
    if key not in _case_cache:
        _case_cache.clear()
        _case_cache[key] = tef.make_case(config.hidden, config.intermediate, catalog.FFN_RANDOM_COUNTS,
                                        small_int=False, fast_math=config.fast_math,
                                        activation_clamp="auto" if config.clamp else None, seed=_seed(),
                                        device="cuda")
    return _case_cache[key]


@pytest.mark.parametrize("config", catalog.FFN_RANDOM_CONFIGS, ids=lambda c: c.name)
def test_expert_ffn_random(config: ef.ExpertFfnConfig) -> None:
    case = _random_case(config)
    problem = tef.pack_problem(config, case)
    report = efc.compare(problem, _run(problem))
    print(f"\n{config.name} seed {case.seed} clamp {problem.activation_clamp}: {report.summary()}")
    check_random(report, config.fast_math)


@pytest.mark.parametrize("config", catalog.FFN_EXACT_CONFIGS, ids=lambda c: c.name)
def test_expert_ffn_epilogue_random(config: ef.ExpertFfnConfig) -> None:
    """Random inputs through the debug variants: besides check 1 against the reference, the reference epilogue on
    the kernel's own L1 accumulators must give the kernel's codes and SFs to within SwiGLU's ulps (check_epilogue):
    the epilogue never moves a code by more than one step; what moves codes further is the GEMM's accumulation."""
    seed = _seed()
    problem = tef.make_problem(config, catalog.FFN_EXACT_COUNTS, small_int=False,
                              activation_clamp="auto" if config.clamp else None, seed=seed)
    report = efc.compare(problem, _run(problem))
    print(f"\n{config.name} seed {seed} clamp {problem.activation_clamp}: {report.summary()}")
    assert report.own_codes is not None
    check_random(report, config.fast_math)


def _exact_config(block_m: int, *, clamp: bool, fast_math: bool) -> ef.ExpertFfnConfig:
    return next(c for c in catalog.FFN_EXACT_CONFIGS
                if (c.block_m, c.hidden, c.clamp, c.fast_math) == (block_m, 2048, clamp, fast_math))


def _assert_same(a: ef.FfnOutputs, b: ef.FfnOutputs, what: str) -> None:
    for name in ("l2_acts", "l2_acts_sf", "out", "l1_done_count", "l1_acc"):
        x, y = getattr(a, name), getattr(b, name)
        if x is not None:
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), f"{what}: {name} differs"


def test_expert_ffn_fewer_ctas() -> None:
    """Few CTAs walk every task: with one CTA its own L2 producer waits for counters only its own math warpgroups
    publish (the flush before L2 work), with a few the ring's phases cross L1 -> L2. The result must not depend on
    the grid: bit-identical to the full grid."""
    config = _exact_config(64, clamp=False, fast_math=False)
    problem = tef.make_problem(config, catalog.FFN_EXACT_COUNTS, small_int=True, seed=_seed())
    full = _run(problem)
    check_exact(efc.compare(problem, full), config.fast_math)
    for num_blocks in (1, 2, 5):
        _assert_same(_run(problem, num_blocks), full, f"{num_blocks} CTAs")


def test_expert_ffn_back_to_back() -> None:
    """Many launches in a row, each into freshly poisoned outputs: an L2 tile that read its activations before
    their publication would see the poison (or a previous run's values are never there to see). All identical."""
    config = _exact_config(128, clamp=True, fast_math=True)
    problem = tef.make_problem(config, catalog.FFN_EXACT_COUNTS, small_int=True, activation_clamp="auto",
                              seed=_seed())
    runs = [ef.new_outputs(config, problem.num_pool_rows) for _ in range(30)]
    for outputs in runs:
        tef.run_problem(problem, outputs)
    torch.cuda.synchronize()
    check_exact(efc.compare(problem, runs[0]), config.fast_math)
    for i, outputs in enumerate(runs[1:], 1):
        _assert_same(outputs, runs[0], f"run {i}")
