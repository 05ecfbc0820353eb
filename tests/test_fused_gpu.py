"""The fused kernel: its variants compile (compile tier); end to end on one H200 (gpu tier, megamoe.fused.run)
against megamoe.reference.moe.

Every call: fresh random inputs (seed printed), y and the pool, L2 activations and combine rows poisoned (NaN
bytes) before the launch, the CUDA error state checked, the workspace ready for the next call afterwards
(assert_workspace_ready). Measured values are printed: run with -s."""
from __future__ import annotations

import random
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from megamoe import reference, weights  # noqa: E402
from megamoe.buffer import allocate  # noqa: E402
from megamoe.layout import WORKSPACE_HEADER_FIELDS, SymmLayout  # noqa: E402

# The layouts (R, E, T_max, topk, H, I) and orders the gpu tests launch; the compile test below builds them
SMALL_LAYOUTS = [(1, 8, 128, 6, 1024, 512), (1, 32, 128, 8, 2048, 1024)]
FLASH_LAYOUT = (1, 32, 4096, 6, 4096, 2048)

# y rel-L2 against the exact-quantization reference. Measured on the H200 (scripts/fused_error_spread.py, 200 seeds
# per row, the two SMALL_LAYOUTS): T 128 median 4.1e-3 / 4.2e-3, max 4.7e-3 / 4.6e-3; T 7 max 6.9e-3 / 5.7e-3; T 2
# max 1.04e-2 / 7.5e-3; T 1 median 3.3e-3 / 3.9e-3, p99 9.4e-3 / 8.6e-3, max 1.35e-2 / 9.6e-3. The requant's one-step
# FP8 flips dominate; a single token's output carries only a few of them, so below 7 tokens the error has a long
# tail (a T = 1 case measured 1.007e-2 against the old single bound of 1e-2).
MAX_Y_REL_L2 = 1e-2  # T >= 7: 1.45x the largest measured
MAX_Y_REL_L2_FEW_TOKENS = 2e-2  # T < 7: 1.5x the largest measured (T = 1)


def max_y_rel_l2(num_tokens: int) -> float:
    """The y rel-L2 bound of a call with num_tokens tokens (measured: above)."""
    return MAX_Y_REL_L2 if num_tokens >= 7 else MAX_Y_REL_L2_FEW_TOKENS


# The workspace header's word of the NVLink barrier ordinal, whose low bit is a call's count parity
# (common/count_buffers.cuh)
NVL_COUNTER_WORD = next(first for name, first, _ in WORKSPACE_HEADER_FIELDS if name == "nvl_barrier_counter")


def assert_workspace_ready(buf: Any, what: str, num_tokens: int | None = None) -> None:
    """The workspace is ready for the next call: the send and receive counts of the next call's parity are zero
    (the call zeroed them in its head: combine/clean.cuh, clean_next_parity). The fused kernel ends without a
    clean, so this call's own counters keep their values; with `num_tokens` (this rank's T of the call) the combine
    arrivals must be exactly the rows each token sent (valid top-k slots) and zero past T, which also checks that
    the call zeroed what an earlier call with more tokens left."""
    header = buf.view("workspace_header").view(torch.int32)
    parity = int(header[NVL_COUNTER_WORD]) & 1
    for name in ("expert_send_count", "expert_recv_count"):
        left = buf.view(name)[parity].view(torch.int32)
        assert not bool(left.ne(0).any()), f"{what}: {name}[{parity}] (the next call's) not zero: {left.tolist()}"
    if num_tokens is not None:
        arrivals = buf.view("combine_arrival_count").view(torch.int32)
        expected = torch.zeros_like(arrivals)
        expected[:num_tokens] = (buf.topk_idx[:num_tokens] >= 0).sum(dim=1).to(torch.int32)
        wrong = arrivals.ne(expected).nonzero().flatten().tolist()
        assert not wrong, (f"{what}: combine arrivals of tokens {wrong[:8]} are "
                           f"{arrivals[wrong[:8]].tolist()}, expected {expected[wrong[:8]].tolist()}")


def _seed() -> int:
    return random.SystemRandom().randrange(1 << 31)


def _poison(buf) -> None:
    for name in ("l1_acts", "l2_acts"):
        buf.view(name).view(torch.uint8).fill_(0x7F)  # FP8 NaN
    for name in ("l1_acts_sf", "l2_acts_sf", "l1_topk_weights"):
        buf.view(name).fill_(float("nan"))
    buf.view("combine").fill_(float("nan"))


def _case_buffer(num_tokens: int, num_experts: int, num_topk: int, hidden: int, intermediate: int,
                 max_tokens: int, seed: int, small_int: bool = False):
    gen = torch.Generator().manual_seed(seed)
    device = torch.device("cuda")
    case = reference.random_case(num_tokens, hidden, intermediate, num_experts, num_topk, mask_prob=0.1,
                                 small_int=small_int, generator=gen, device=device)
    layout = SymmLayout.create(1, num_experts, max_tokens, num_topk, hidden, intermediate)
    buf = allocate(None, layout, device)
    l1_nat = tuple(t.to(device) for t in case.l1_weights[0])
    l2_nat = tuple(t.to(device) for t in case.l2_weights[0])
    l1, l2 = weights.transform_weights(l1_nat, l2_nat)
    return case, buf, l1, l2


def _call(case, buf, l1, l2, num_tokens: int, **kwargs):
    from megamoe import fused

    _poison(buf)
    buf.x[:num_tokens].copy_(case.x[0])
    buf.x_sf[:num_tokens].copy_(case.x_sf[0])
    buf.topk_idx[:num_tokens].copy_(case.topk_idx[0])
    buf.topk_weights[:num_tokens].copy_(case.topk_weights[0])
    y = torch.full((num_tokens, buf.hidden), float("nan"), dtype=torch.bfloat16, device=buf.device)
    config = fused.run(y, l1, l2, buf, num_tokens, **kwargs)
    torch.cuda.synchronize()
    assert_workspace_ready(buf, config.name, num_tokens)
    return y, config


def _test_configs() -> list:
    from megamoe.fused import config_for

    configs = [config_for(SymmLayout.create(*lay), serial=s) for lay in SMALL_LAYOUTS for s in (True, False)]
    return configs + [config_for(SymmLayout.create(*FLASH_LAYOUT), serial=s) for s in (True, False)]


@pytest.mark.compile
def test_fused_variants_compile() -> None:
    """compile tier: every variant these tests launch builds for sm_90a, issues QGMMA and draws no C75xx note (a
    printf reachable beside the WGMMAs would draw C7510: DESIGN 5c). Spills are not asserted yet: measured 142-362 B (notes/fused.md), the open step
    of the fused issue; the catalog's 0-spill checks apply once they are gone."""
    from megamoe.fused import compile_fused
    from megamoe.jit import checks

    for config in _test_configs():
        result = compile_fused(config)
        problems = [v for v in checks.violations(result, checks.CheckOptions(expect_qgmma=True))
                    if "spill" not in v and "stack frame" not in v and "LDL/STL" not in v]
        print(config.name, f"spills {result.entry.spill_store_bytes} B")
        assert not problems, problems


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1021, 4096])
@pytest.mark.parametrize("serial", [True, False])
def test_fused_flash_shape(num_tokens: int, serial: bool) -> None:
    """The single-rank load of an 8-GPU DSV4-Flash deployment: E = 32 local experts, H 4096, I 2048, top-6; y
    bit-identical across grid sizes (132, 78, 66, 8 CTAs) and repeated calls."""
    seed = _seed()
    _, num_experts, max_tokens, num_topk, hidden, intermediate = FLASH_LAYOUT
    case, buf, l1, l2 = _case_buffer(num_tokens, num_experts, num_topk, hidden, intermediate, max_tokens, seed)
    y_ref = reference.moe(case.x[0], case.x_sf[0], case.topk_idx[0], case.topk_weights[0], case.l1_weights[0],
                          case.l2_weights[0], fast_math=True)
    first = None
    for num_sms in (132, 78, 66, 8, 132):
        y, config = _call(case, buf, l1, l2, num_tokens, serial=serial, num_sms=num_sms)
        err = reference.rel_l2(y.float(), y_ref.float())
        print(f"seed {seed} {config.name} num_sms {num_sms}: y rel-L2 {err:.3e}")
        assert err <= MAX_Y_REL_L2, f"seed {seed}: y rel-L2 {err:.3e} > {MAX_Y_REL_L2}"
        if first is None:
            first = y.clone()
        assert torch.equal(y.view(torch.int16), first.view(torch.int16)), f"seed {seed}: y differs at {num_sms} SMs"


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [0, 1, 7, 128])
@pytest.mark.parametrize("num_experts,num_topk,hidden,intermediate", [lay[1:2] + lay[3:] for lay in SMALL_LAYOUTS])
@pytest.mark.parametrize("serial", [True, False])
def test_fused_matches_reference(num_tokens: int, num_experts: int, num_topk: int, hidden: int, intermediate: int,
                                 serial: bool) -> None:
    from megamoe import fused

    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    device = torch.device("cuda")
    max_tokens = 128
    case = reference.random_case(num_tokens, hidden, intermediate, num_experts, num_topk, mask_prob=0.1,
                                 generator=gen)
    layout = SymmLayout.create(1, num_experts, max_tokens, num_topk, hidden, intermediate)
    buf = allocate(None, layout, device)
    l1_nat = tuple(t.to(device) for t in case.l1_weights[0])
    l2_nat = tuple(t.to(device) for t in case.l2_weights[0])
    l1, l2 = weights.transform_weights(l1_nat, l2_nat)
    for call in range(2):  # twice: the second call runs on the workspace the first one left
        _poison(buf)
        buf.x[:num_tokens].copy_(case.x[0])
        buf.x_sf[:num_tokens].copy_(case.x_sf[0])
        buf.topk_idx[:num_tokens].copy_(case.topk_idx[0])
        buf.topk_weights[:num_tokens].copy_(case.topk_weights[0])
        y = torch.full((num_tokens, hidden), float("nan"), dtype=torch.bfloat16, device=device)
        config = fused.run(y, l1, l2, buf, num_tokens, serial=serial)
        torch.cuda.synchronize()
        y_ref = reference.moe(case.x[0], case.x_sf[0], case.topk_idx[0], case.topk_weights[0],
                              case.l1_weights[0], case.l2_weights[0], fast_math=True)
        err = reference.rel_l2(y.float().cpu(), y_ref.float())
        print(f"seed {seed} {config.name} call {call}: y rel-L2 {err:.3e}")
        assert torch.isfinite(y).all(), f"seed {seed}: y holds non-finite values"
        bound = max_y_rel_l2(num_tokens)
        assert err <= bound, f"seed {seed}: y rel-L2 {err:.3e} > {bound}"
        assert_workspace_ready(buf, f"seed {seed} call {call}", num_tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("layout_idx,num_tokens,num_sms,wave_tiles", [
    (0, 128, 132, None), (1, 77, 8, None), (2, 1021, 132, None), (2, 1021, 66, None),
    (1, 100, 132, 0), (2, 1021, 132, 2**32 - 1), (2, 300, 66, 500)])
def test_fused_task_order_matches_model(layout_idx: int, num_tokens: int, num_sms: int,
                                        wave_tiles: int | None) -> None:
    """The device scheduler (assembler/fused_scheduler.cuh) and its task claims against megamoe.scheduler's global
    sequence: the TMA-A warp's task list of every CTA dumped by a debug buffer, each CTA starting at its own index,
    in increasing order, every task once (scheduler.check_claims), for grids of 132, 66 and 8 CTAs, with the default
    wave fill and with one expert per wave, one wave, and a target between; y checked as in every call."""
    from megamoe import heuristics, scheduler
    from megamoe.fused.launch import dumped_tasks

    _, num_experts, max_tokens, num_topk, hidden, intermediate = (SMALL_LAYOUTS + [FLASH_LAYOUT])[layout_idx]
    seed = _seed()
    case, buf, l1, l2 = _case_buffer(num_tokens, num_experts, num_topk, hidden, intermediate, max_tokens, seed)
    capacity = 4096
    dump = torch.zeros(num_sms, 1 + 4 * capacity, dtype=torch.int32, device=buf.device)
    y, config = _call(case, buf, l1, l2, num_tokens, num_sms=num_sms, task_dump=dump, min_wave_l1_tiles=wave_tiles)
    wave_tiles = heuristics.min_wave_l1_tiles_for(num_sms) if wave_tiles is None else wave_tiles
    y_ref = reference.moe(case.x[0], case.x_sf[0], case.topk_idx[0], case.topk_weights[0], case.l1_weights[0],
                          case.l2_weights[0], fast_math=True)
    err = reference.rel_l2(y.float(), y_ref.float())
    assert err <= MAX_Y_REL_L2, f"seed {seed} {config.name}: y rel-L2 {err:.3e} > {MAX_Y_REL_L2}"
    idx = case.topk_idx[0]
    counts = torch.bincount(idx[idx >= 0].flatten().cpu(), minlength=num_experts).tolist()
    got = [[scheduler.Task(*t) for t in tasks] for tasks in dumped_tasks(dump)]
    sequence = scheduler.task_sequence(counts, block_m=config.block_m, num_l1_n_blocks=2 * intermediate // 128,
                                       num_l2_n_blocks=hidden // 128, min_wave_l1_tiles=wave_tiles,
                                       n_major_l2=config.n_major_l2)
    try:
        scheduler.check_claims(got, sequence)
    except scheduler.ScheduleError as error:
        pytest.fail(f"seed {seed} {config.name}: {error}")
    per_cta = sorted(len(t) for t in got)
    print(f"seed {seed} {config.name}: {len(sequence)} tasks on {num_sms} CTAs as the model's sequence claims them "
          f"({per_cta[0]}-{per_cta[-1]} per CTA)")


# Phase by phase on random inputs (the seed's Phase 2-5 milestones): the pool, the L2 activations and the combine
# rows stay in the buffer after a call. Dispatch exact; the L2 activations and SFs held to the expert-FFN unit
# kernel's check 1 on random inputs (the same L1 GEMM and epilogue code; its thresholds and their measurements are in
# tests/test_expert_ffn_gpu.py: codes two or more steps off occur, measured 0.09% at |value| <= 3.5e-3 amax, bounded
# through the excess beyond rounding); per-slot combine rows at most MAX_Y_REL_L2.


@pytest.mark.gpu
@pytest.mark.parametrize("layout_idx,num_tokens", [(0, 128), (1, 100)])
@pytest.mark.parametrize("small_int", [False, True], ids=["random", "small_int"])
def test_fused_phase_intermediates(layout_idx: int, num_tokens: int, small_int: bool) -> None:
    """The intermediates the call leaves in the buffer against the reference's. small_int (DESIGN section 4, check
    0): FP8 small-integer inputs with power-of-two scales make the L1 GEMM exact, so the L1 epilogue's codes may
    differ from the reference's only where SwiGLU's ulps move a value across a rounding boundary (one step, at the
    boundary: the expert-FFN unit kernel's check-0 bounds, tests/test_expert_ffn_gpu.py), and the combine rows are
    held to that kernel's exact-tier output bound. Measured on the H200: no code and no SF differs at all (0 of
    349184 and 746496 codes, fast math), the random inputs 1.1% one step off."""
    from megamoe import scheduler
    from megamoe.testing.expert_ffn_checks import CodeStats
    from test_expert_ffn_gpu import (EXACT_OUT_REL_L2, RANDOM_CODE_EXCESS, RANDOM_MULTI_STEP_FRACTION,
                                     RANDOM_ONE_STEP_FRACTION, RANDOM_SF_REL_ERR, check_epilogue)

    _, num_experts, max_tokens, num_topk, hidden, intermediate = SMALL_LAYOUTS[layout_idx]
    seed = _seed()
    case, buf, l1, l2 = _case_buffer(num_tokens, num_experts, num_topk, hidden, intermediate, max_tokens, seed,
                                     small_int)
    _, config = _call(case, buf, l1, l2, num_tokens)
    ref = reference.moe(case.x[0], case.x_sf[0], case.topk_idx[0], case.topk_weights[0], case.l1_weights[0],
                        case.l2_weights[0], fast_math=True, return_intermediates=True)
    counts = ref.num_recv_per_expert.tolist()
    meta = buf.view("pool_src_metadata").view(torch.int32)
    acts, acts_sf = buf.view("l1_acts").view(torch.uint8), buf.view("l1_acts_sf")
    l2_acts, l2_sf = buf.view("l2_acts"), buf.view("l2_acts_sf")
    combine = buf.view("combine")
    stats = CodeStats()
    for e, (count, first) in enumerate(zip(counts, scheduler.pool_offsets(counts, config.block_m))):
        x = ref.experts[e]
        rows = torch.arange(first, first + count, device=buf.device)
        src = meta[rows, :3].to(torch.int64)
        rows = rows[torch.argsort((src[:, 0] * max_tokens + src[:, 1]) * num_topk + src[:, 2])]
        # Dispatch: rows, SF, top-k weights and source metadata, exactly
        assert torch.equal(meta[rows, :3].to(torch.int64).cpu(), x.src.cpu()), f"seed {seed}: expert {e} metadata"
        assert torch.equal(acts[rows].cpu(), x.x.view(torch.uint8).cpu()), f"seed {seed}: expert {e} pool rows"
        assert torch.equal(acts_sf[:, rows].t().cpu(), x.x_sf.cpu()), f"seed {seed}: expert {e} pool SF"
        assert torch.equal(buf.view("l1_topk_weights")[rows].cpu(), x.topk_weight.cpu()), f"seed {seed}: weights"
        # L1 epilogue: requantized activations and SFs against the reference's
        if count:
            stats.add(l2_acts[rows].cpu(), l2_sf[:, rows].t().cpu(), x.act.cpu(), x.l2_act.cpu(), x.l2_act_sf.cpu())
        # L2 + scatter: each row's combine slot at (slot, token)
        if count:
            got = combine[x.src[:, 2].to(buf.device), x.src[:, 1].to(buf.device)]
            err = reference.rel_l2(got.float(), x.out.float())
            bound = EXACT_OUT_REL_L2 if small_int else MAX_Y_REL_L2
            assert err <= bound, f"seed {seed}: expert {e} combine rows rel-L2 {err:.3e} > {bound}"
    num_codes = sum(stats.steps)
    print(f"seed {seed} {config.name} {'small-int' if small_int else 'random'}: {stats.summary()}")
    if small_int:
        check_epilogue(stats, fast_math=True)
        return
    assert stats.excess <= RANDOM_CODE_EXCESS, stats.summary()
    assert stats.steps[1] <= RANDOM_ONE_STEP_FRACTION * num_codes, stats.summary()
    assert stats.steps[2] <= RANDOM_MULTI_STEP_FRACTION * num_codes, stats.summary()
    assert stats.sf_max_rel_err <= RANDOM_SF_REL_ERR, stats.summary()
