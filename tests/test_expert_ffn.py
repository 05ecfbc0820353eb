"""Epilogue component through its unit kernel (megamoe.kernels.expert_ffn): cpu and compile tiers.

cpu: the shared-memory plan, the generated source, the routing with exact per-expert counts, and the gpu tier's
acceptance logic itself: it must accept what a correct kernel writes (the reference, and the reference with
emulated tensor-core accumulation error) and reject layout, padding, counter and scale bugs.
compile: every catalog variant's register use (peak register index in the SASS; ptxas reports the launch cap).
"""
from __future__ import annotations

import re
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from megamoe import quant  # noqa: E402
from megamoe import reference as ref  # noqa: E402
from megamoe.jit import checks  # noqa: E402
from megamoe.kernels import catalog  # noqa: E402
from megamoe.kernels import expert_ffn as ef  # noqa: E402
from megamoe.testing import expert_ffn as tef  # noqa: E402
from megamoe.testing import expert_ffn_checks as efc  # noqa: E402

from test_expert_ffn_gpu import check_exact, check_random  # noqa: E402

MATH_REGS = 224  # assembler/expert_ffn_kernel.cuh: kNumMathRegs
COUNTS = [0, 1, 33, 5, 64, 70]


# ---------------------------------------------------------------------------------------------------------------
# cpu
# ---------------------------------------------------------------------------------------------------------------


def test_smem_plan_and_names() -> None:
    configs = catalog.FFN_EXACT_CONFIGS + catalog.FFN_RANDOM_CONFIGS
    assert len({c.name for c in configs}) == len(configs)
    for c in configs:
        assert c.num_stages >= 3 and c.smem_bytes <= ef.SMEM_LIMIT, c
        assert c.staging_offset % 1024 == 0 and c.staging_offset >= c.ring_bytes
        # L1 double buffer (tile + SFs, 128 B aligned each) and L2 rows share the staging area
        assert c.staging_bytes == max(2 * -(-c.block_m * 68 // 128) * 128, c.block_m * 256)
        assert c.num_l1_n_blocks == 2 * c.intermediate // 128
    big = ef.ExpertFfnConfig(128, 7168, 3072, 12)
    assert big.num_stages == 5 and big.smem_bytes == 202752
    assert ef.ExpertFfnConfig(64, 4096, 2048, 1).num_stages == 8
    for kwargs in ({"block_m": 48}, {"hidden": 100}, {"intermediate": 64}, {"num_experts": 0}):
        args = {"block_m": 64, "hidden": 1024, "intermediate": 512, "num_experts": 2} | kwargs
        with pytest.raises(ValueError):
            ef.ExpertFfnConfig(**args)
    with pytest.raises(ValueError, match="stages"):
        ef.ExpertFfnConfig(128, 1024, 512, 2, num_stages=7)


def test_source() -> None:
    config = ef.ExpertFfnConfig(32, 4096, 2048, 12, clamp=True, fast_math=False, debug_l1_acc=True)
    src = ef.source(config)
    assert config.name in src and '#include "expert_ffn_kernel.cuh"' in src
    assert f"ExpertFfnTraits<32, {config.num_stages}, 4096,\n" in src and "true, false,\n" in src
    assert f"Traits::kSmemBytes == {config.smem_bytes}" in src and "__launch_bounds__" in src
    assert config.name == f"megamoe_expert_ffn_m32_h4096_i2048_e12_clamp_exact_dbg_s{config.num_stages}"
    # schedule knobs (defaults: M-major order, next stage awaited in flight): in the name and the traits
    assert "true, 1,\n" in src and "true>;\n" in src  # debug_l1_acc, band_m; prefetch
    knobs = ef.ExpertFfnConfig(128, 4096, 2048, 32, band_m=16, prefetch=False)
    assert knobs.name.endswith("_b16_nopf") and "false, 16,\n" in ef.source(knobs)
    assert "false>;\n" in ef.source(knobs)
    with pytest.raises(ValueError, match="band_m"):
        ef.ExpertFfnConfig(128, 4096, 2048, 32, band_m=0)


@pytest.mark.parametrize("counts, topk", [(COUNTS, 4), ([0, 0, 0], 2), ([7], 2), ([1000, 3, 0, 128], 3)])
def test_routing_with_counts(counts: list[int], topk: int) -> None:
    generator = torch.Generator().manual_seed(1)
    idx = tef.routing_with_counts(counts, topk, generator=generator)
    assert idx.shape[1] == topk
    assert torch.bincount(idx[idx >= 0], minlength=len(counts)).tolist() == counts
    ordered = idx.sort(dim=1).values
    assert not bool(((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any()), "distinct experts"
    assert bool(((idx >= 0).sum(dim=1) <= topk - 1).all()), "one slot stays free"


def _problem(block_m: int, small_int: bool, clamp: bool, fast_math: bool, seed: int = 3,
             debug: bool | None = None) -> tef.FfnProblem:
    debug = small_int if debug is None else debug
    config = ef.ExpertFfnConfig(block_m, 256, 256, len(COUNTS), clamp, fast_math, debug_l1_acc=debug)
    return tef.make_problem(config, COUNTS, small_int=small_int, activation_clamp="auto" if clamp else None,
                           seed=seed, device="cpu")


@pytest.mark.parametrize("block_m", [32, 64, 128])
@pytest.mark.parametrize("small_int, clamp, fast_math", [(True, False, False), (True, True, True),
                                                         (False, True, False), (False, False, True)])
def test_checks_accept_the_reference(block_m: int, small_int: bool, clamp: bool, fast_math: bool) -> None:
    problem = _problem(block_m, small_int, clamp, fast_math)
    assert problem.used_rows == sum(-(-c // block_m) * block_m for c in COUNTS)
    assert problem.num_pool_rows == problem.used_rows + block_m
    assert torch.isnan(problem.inputs.topk_weights[~problem.valid_mask()]).all()
    if clamp:  # the clamp must bite: a good share of gate / up values beyond it
        acc = torch.cat([e.l1_acc for e in problem.reference.experts])
        assert 0.05 < (acc.abs() > problem.activation_clamp).float().mean() < 0.95
    report = efc.compare(problem, efc.expected_outputs(problem))
    (check_exact if small_int else check_random)(report, fast_math)
    assert report.codes.steps[1:] == [0, 0] and report.out_mismatches == 0 and report.out_rel_l2 == 0.0


def _emulate(problem: tef.FfnProblem, noise: float, seed: int = 0) -> ef.FfnOutputs:
    """A kernel whose L1 accumulators carry Gaussian errors of `noise` x their RMS (the tensor cores' accumulation
    error), everything after them exact (debug variants: the noisy accumulators are written too)."""
    generator = torch.Generator().manual_seed(seed)
    outputs = efc.expected_outputs(problem)
    for e, inter in enumerate(problem.reference.experts):
        if problem.counts[e] == 0:
            continue
        rms = inter.l1_acc.pow(2).mean().sqrt()
        h = inter.l1_acc + torch.randn(inter.l1_acc.shape, generator=generator) * noise * rms
        act = ref.swiglu(h, inter.topk_weight, activation_clamp=problem.activation_clamp,
                         fast_math=problem.config.fast_math)
        q, sf = quant.requant_per64(act)
        rows = problem.rows(e)
        outputs.l2_acts.view(torch.uint8)[rows] = q.view(torch.uint8)
        outputs.l2_acts_sf[:, rows] = sf.t()
        if outputs.l1_acc is not None:
            outputs.l1_acc[rows] = h
        w2_scales = ref._l2_scales(problem.inputs.w2_sf[e])
        outputs.out[rows] = ref.block_scaled_matmul(q, sf, problem.case.l2_weights[0][e], w2_scales, 64).to(torch.bfloat16)
    return outputs


@pytest.mark.parametrize("debug", [False, True])
def test_random_checks_accept_emulated_accumulation_error(debug: bool) -> None:
    problem = _problem(64, small_int=False, clamp=True, fast_math=False, debug=debug)
    report = efc.compare(problem, _emulate(problem, 1.5e-4))
    print(report.summary())
    assert report.codes.steps[1] > 0
    assert (report.own_codes is not None) == debug
    if debug:  # the epilogue on its own accumulators is exact here
        assert report.own_codes.steps[1:] == [0, 0] and report.own_codes.sf_mismatches == 0
    check_random(report, False)


def test_code_excess_is_taken_on_the_codes_own_sf() -> None:
    """A group amax off by 2e-3 (its own accumulation error, within RANDOM_SF_REL_ERR) with the group's codes
    requantized on it, as the kernel does, moves codes but leaves no code excess; the same codes stored beside the
    expected SFs do."""
    problem = _problem(64, small_int=False, clamp=False, fast_math=False)
    outputs = efc.expected_outputs(problem)
    expert, rows = 4, problem.rows(4)
    groups = problem.reference.experts[expert].act.unflatten(1, (-1, 64))
    amax = groups.abs().amax(dim=2, keepdim=True) * (1 + 2e-3)
    q = (groups * torch.div(torch.full_like(amax, efc.FP8_MAX), amax)).flatten(1).to(torch.float8_e4m3fn)
    outputs.l2_acts[rows] = q
    outputs.l2_acts_sf[:, rows] = (amax / efc.FP8_MAX).squeeze(2).t()
    _recompute_out(problem, outputs, expert)
    report = efc.compare(problem, outputs)
    assert report.codes.steps[1] > 0 and 1.9e-3 < report.codes.sf_max_rel_err < 2.1e-3
    assert report.codes.excess < 1e-6, report.summary()
    check_random(report, False)
    # The moved codes beside the expected SFs: each is off its own scale by the 2e-3
    outputs.l2_acts_sf[:, rows] = problem.reference.experts[expert].l2_act_sf.t()
    report = efc.compare(problem, outputs)
    assert report.codes.sf_max_rel_err == 0.0 and report.codes.excess > 2e-4, report.summary()


def test_epilogue_check_catches_what_accumulation_noise_hides() -> None:
    """A small code moved by two steps hides in check 1's allowance for the GEMM's error; against the epilogue of
    the kernel's own accumulators it cannot."""
    problem = _problem(64, small_int=False, clamp=True, fast_math=False, debug=True)
    outputs = _emulate(problem, 1.5e-4)
    report = efc.compare(problem, outputs)
    assert report.own_codes.steps[2] == 0
    rows = problem.rows(4)
    codes = outputs.l2_acts.view(torch.uint8)[rows]
    small = ((codes & 0x7F) > 2) & ((codes & 0x7F) < 8)    # a subnormal code: two steps is < 1e-5 amax
    row, col = (int(i) for i in small.nonzero()[0])
    codes[row, col] -= 2
    _recompute_out(problem, outputs, 4)
    report = efc.compare(problem, outputs)
    assert report.own_codes.steps[2] == 1
    with pytest.raises(AssertionError, match="more than 1 step"):
        check_random(report, False)
    report.own_codes = None  # without the accumulators, check 1 alone lets it pass
    check_random(report, False)


def _recompute_out(p: tef.FfnProblem, o: ef.FfnOutputs, expert: int) -> None:
    """What the L2 GEMM makes of (corrupted) activations: the corruption must be caught on the activations."""
    rows = p.rows(expert)
    sf = o.l2_acts_sf[:, rows].t().contiguous()
    o.out[rows] = ref.block_scaled_matmul(o.l2_acts[rows], sf, p.case.l2_weights[0][expert],
                                          ref._l2_scales(p.inputs.w2_sf[expert]), 64).to(torch.bfloat16)


def _corruptions() -> dict:
    def swap_chunks(p: tef.FfnProblem, o: ef.FfnOutputs) -> None:
        row = o.l2_acts.view(torch.uint8)[p.offsets[2]]
        row[:16], row[16:32] = row[16:32].clone(), row[:16].clone()
        _recompute_out(p, o, 2)

    def gate_up_swap(p: tef.FfnProblem, o: ef.FfnOutputs) -> None:  # L1 epilogue reading up as gate
        inter, rows = p.reference.experts[4], p.rows(4)
        i = p.config.intermediate
        h = torch.cat([inter.l1_acc[:, i:], inter.l1_acc[:, :i]], dim=1)
        q, sf = quant.requant_per64(ref.swiglu(h, inter.topk_weight, activation_clamp=p.activation_clamp))
        o.l2_acts.view(torch.uint8)[rows] = q.view(torch.uint8)
        o.l2_acts_sf[:, rows] = sf.t()
        _recompute_out(p, o, 4)

    def sf_doubled(p: tef.FfnProblem, o: ef.FfnOutputs) -> None:
        o.l2_acts_sf[1, p.offsets[5] + 3] *= 2
        _recompute_out(p, o, 5)

    def padding_out(p: tef.FfnProblem, o: ef.FfnOutputs) -> None:
        o.out[p.offsets[3] + 5] = 0  # expert 3 has 5 rows: row 5 of its block is padding

    def padding_act_nonzero(p: tef.FfnProblem, o: ef.FfnOutputs) -> None:
        o.l2_acts.view(torch.uint8)[p.offsets[1] + 1, 7] = 1

    def spare_block_written(p: tef.FfnProblem, o: ef.FfnOutputs) -> None:
        o.l2_acts_sf[0, p.used_rows] = 0.0

    def counter_short(p: tef.FfnProblem, o: ef.FfnOutputs) -> None:
        o.l1_done_count[0] -= 1

    def l1_acc_ulp(p: tef.FfnProblem, o: ef.FfnOutputs) -> None:
        assert o.l1_acc is not None
        o.l1_acc.view(torch.int32)[p.offsets[4] + 2, 9] += 1

    def out_row_shift(p: tef.FfnProblem, o: ef.FfnOutputs) -> None:
        rows = p.rows(5)
        o.out[rows] = torch.roll(o.out[rows], 1, dims=0)

    def out_unwritten(p: tef.FfnProblem, o: ef.FfnOutputs) -> None:
        o.out[p.offsets[2] + 1, 100] = float("nan")

    return {f.__name__: f for f in (swap_chunks, gate_up_swap, sf_doubled, padding_out, padding_act_nonzero,
                                    spare_block_written, counter_short, l1_acc_ulp, out_row_shift, out_unwritten)}


@pytest.mark.parametrize("corruption", list(_corruptions()))
def test_checks_reject_bugs(corruption: str) -> None:
    for small_int in (True, False):
        problem = _problem(32, small_int, clamp=False, fast_math=False)
        outputs = efc.expected_outputs(problem)
        if corruption == "l1_acc_ulp" and not small_int:
            continue
        _corruptions()[corruption](problem, outputs)
        report = efc.compare(problem, outputs)
        with pytest.raises(AssertionError):
            (check_exact if small_int else check_random)(report, False)


def test_validate_rejects_bad_arguments() -> None:
    problem = _problem(32, small_int=True, clamp=False, fast_math=False)
    outputs = ef.new_outputs(problem.config, problem.num_pool_rows, "cpu")
    ef.validate(problem.config, problem.inputs, outputs, None)
    with pytest.raises(ValueError, match="activation_clamp"):
        ef.validate(problem.config, problem.inputs, outputs, 1.0)
    bad = ef.new_outputs(problem.config, problem.num_pool_rows + 32, "cpu")
    with pytest.raises(ValueError, match="l2_acts"):
        ef.validate(problem.config, problem.inputs, bad, None)
    no_debug = ef.FfnOutputs(outputs.l2_acts, outputs.l2_acts_sf, outputs.out, outputs.l1_done_count, None)
    with pytest.raises(ValueError, match="l1_acc"):
        ef.validate(problem.config, problem.inputs, no_debug, None)
    # The L1 epilogue holds pool blocks in 16 bits (a meta tensor: the bound is checked before any other)
    huge = replace(problem.inputs, l1_acts=torch.empty((0xFFFF * 32, problem.config.hidden),
                                                        dtype=torch.float8_e4m3fn, device="meta"))
    with pytest.raises(ValueError, match="65535 blocks"):
        ef.validate(problem.config, huge, outputs, None)


# ---------------------------------------------------------------------------------------------------------------
# compile
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.compile
def test_register_use() -> None:
    """The epilogue fused onto both GEMMs fits the math warpgroups' 224 registers with 0 spills; reports the peak
    register index of each variant (ptxas's 'Used' count is the 168-register launch cap)."""
    lines = []
    for config in catalog.FFN_EXACT_CONFIGS + catalog.FFN_RANDOM_CONFIGS:
        result = ef.compile_expert_ffn(config)
        assert checks.violations(result, checks.CheckOptions(expect_qgmma=True)) == []
        assert result.sass is not None
        peak = max(int(r) for r in re.findall(r"\bR(\d+)\b", result.sass)) + 1
        assert peak <= MATH_REGS, f"{config.name}: registers up to R{peak - 1}"
        lines.append(f"{config.name}: peak register R{peak - 1} ({peak} of {MATH_REGS}), "
                     f"{result.entry.spill_store_bytes} B spills, smem {config.smem_bytes} B")
    print("\n" + "\n".join(lines))
