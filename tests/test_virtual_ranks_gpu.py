"""Virtual ranks on one H200 (gpu tier, megamoe.testing.virtual_ranks): R ranks as R concurrent cooperative
launches of floor(132 / R) CTAs over R plain buffers sharing one buffer_ptrs list. Cross-rank pulls, combine
scatters, the NVLink barriers and the clean run as between GPUs (peer-mapped TMA and cross-GPU ordering do not:
the multigpu tier covers them).

- The fused kernel at R = 2 and 4, ranks with different T (one with T = 0), recv stats, two calls per case (the
  second on the workspace the first one left): y against reference.moe on every rank.
- The same with a different kernel variant on each rank (BLOCK_M 32 / 64 / 128 from per-rank expected loads, one
  rank phase-serial): the cross-rank protocol (slot reservations, pulls, combine rows and their counts, barriers)
  does not depend on the variant, so a serving framework that sizes each rank's call from its own batch gets the
  right y, only not the config the shared load would pick.
- The fused kernel's calls back to back on each rank's stream (no host sync between them, the ranks drifting
  apart): the case its end without a barrier must survive (assembler/fused_kernel.cuh).
- The dispatch/combine unit kernel's exact 2-rank cases (its multigpu tier's `_scenario_exact` matrix: every
  routing x BLOCK_M, T = T_max on both ranks, T = 0 on one): pool rows, SF, weights, metadata, counts and y bit for
  bit, and the workspace's state after all calls.
Inputs fresh per case (seed printed), outputs and pool poisoned before every launch."""
from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from megamoe import reference, weights  # noqa: E402
from megamoe.testing.virtual_ranks import grid_per_rank, launch_concurrently, virtual_rank_buffers  # noqa: E402
from test_fused_e2e_gpu import _check_y, _draw_inputs, _fill  # noqa: E402
from test_fused_gpu import _seed, assert_workspace_ready  # noqa: E402

# (E per rank, top-k, H, I, T_max): E_local 8
FUSED_SHAPE = (8, 6, 2048, 1024, 128)


FUSED_TOKENS = [[128, 0], [77, 128], [100, 0, 37, 128], [1, 128, 128, 64]]

# Per rank: (T, expected_tokens_per_expert, serial). The default load of FUSED_SHAPE at R = 2 and 4 is 96 rows per
# expert (BLOCK_M 128); 8 and 40 pick BLOCK_M 32 and 64 (heuristics.block_m_for)
MIXED_VARIANTS = [
    [(100, 8.0, False), (128, None, False)],
    [(128, 8.0, False), (0, 40.0, False), (37, None, False), (90, 8.0, True)],
]


@pytest.mark.compile
def test_virtual_rank_variants_compile() -> None:
    """compile tier: the variants this file launches (so the carried JIT cache holds them)."""
    from megamoe.fused import compile_fused, config_for
    from megamoe.kernels import dispatch_combine as dc
    from megamoe.layout import SymmLayout

    experts_per_rank, num_topk, hidden, intermediate, max_tokens = FUSED_SHAPE
    for num_ranks in sorted({len(t) for t in FUSED_TOKENS}):
        compile_fused(config_for(SymmLayout.create(num_ranks, experts_per_rank * num_ranks, max_tokens, num_topk,
                                                   hidden, intermediate)))
    for ranks in MIXED_VARIANTS:
        layout = SymmLayout.create(len(ranks), experts_per_rank * len(ranks), max_tokens, num_topk, hidden,
                                   intermediate)
        for _, expected, serial in ranks:
            compile_fused(config_for(layout, expected_tokens_per_expert=expected, serial=serial))
    buf = virtual_rank_buffers(*DC_SHAPE, device="cpu")[0]
    for block_m in (32, 64, 128):
        dc.compile_kernel(dc.config_for(buf, block_m))


def _fused_virtual_case(tokens: list[int], rank_kwargs: list[dict]) -> list[int]:
    """Two calls of the fused kernel on R virtual ranks (`rank_kwargs[r]`: rank r's extra `run` arguments): y and
    the recv stats against the reference on every rank, the workspace ready after each call. Returns each rank's
    BLOCK_M."""
    from megamoe.fused.launch import prepare, run

    num_ranks = len(tokens)
    experts_per_rank, num_topk, hidden, intermediate, max_tokens = FUSED_SHAPE
    num_experts = experts_per_rank * num_ranks
    seed = _seed()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rc = reference.random_case(tokens, hidden, intermediate, num_experts, num_topk, num_ranks=num_ranks,
                               mask_prob=0.1, generator=gen, device="cuda")
    bufs = virtual_rank_buffers(num_ranks, num_experts, max_tokens, num_topk, hidden, intermediate)
    pairs = [weights.transform_weights(rc.l1_weights[r], rc.l2_weights[r]) for r in range(num_ranks)]
    stats = [torch.randint(0, 100, (experts_per_rank,), dtype=torch.int32, generator=gen, device="cuda")
             for _ in range(num_ranks)]
    initial = [s.clone() for s in stats]
    stats_ref = [s.clone() for s in stats]
    y_refs = reference.moe(rc.x, rc.x_sf, rc.topk_idx, rc.topk_weights, rc.l1_weights, rc.l2_weights,
                           fast_math=True, cumulative_local_expert_recv_stats=stats_ref)
    ys = [torch.empty(t, hidden, dtype=torch.bfloat16, device="cuda") for t in tokens]
    grid = grid_per_rank(num_ranks)
    block_ms = [prepare(buf, **kwargs).block_m for buf, kwargs in zip(bufs, rank_kwargs)]
    for call in range(2):
        for r, buf in enumerate(bufs):
            _fill(buf, rc.x[r], rc.x_sf[r], rc.topk_idx[r], rc.topk_weights[r])
            ys[r].fill_(float("nan"))
        launch_concurrently([
            lambda stream, r=r: run(ys[r], pairs[r][0], pairs[r][1], bufs[r], tokens[r], recv_stats=stats[r],
                                    num_sms=grid, stream=stream, **rank_kwargs[r])
            for r in range(num_ranks)])
        for r in range(num_ranks):
            tag = f"seed {seed} R {num_ranks} T {tokens} BLOCK_M {block_ms} call {call} rank {r}"
            err = _check_y(tag, ys[r], y_refs[r])
            assert_workspace_ready(bufs[r], tag, tokens[r])
            print(f"{tag}: y rel-L2 {err:.3e}")
    # Two calls each added what every local expert received (counted across the ranks); the reference added it once
    for r in range(num_ranks):
        rows = stats_ref[r] - initial[r]
        assert torch.equal(stats[r], initial[r] + 2 * rows), (
            f"seed {seed} rank {r}: recv stats {stats[r].tolist()}, expected initial + 2 x {rows.tolist()}")
    return block_ms


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", FUSED_TOKENS,
                         ids=lambda t: "T" + "_".join(map(str, t)))
def test_fused_virtual_ranks(tokens: list[int]) -> None:
    _fused_virtual_case(tokens, [{}] * len(tokens))


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", MIXED_VARIANTS, ids=lambda v: f"R{len(v)}")
def test_fused_virtual_ranks_mixed_variants(ranks: list[tuple[int, float | None, bool]]) -> None:
    """Each rank runs its own variant (BLOCK_M from its own expected load, one rank phase-serial)."""
    tokens = [t for t, _, _ in ranks]
    kwargs = [{"expected_tokens_per_expert": expected, "serial": serial} for _, expected, serial in ranks]
    block_ms = _fused_virtual_case(tokens, kwargs)
    # The ranks must run different BLOCK_M, else the case tests nothing beyond test_fused_virtual_ranks
    assert len(set(block_ms)) > 1, f"BLOCK_M per rank {block_ms}: the expected loads no longer pick different variants"


# Calls per rank in the back-to-back test
BACK_TO_BACK_CALLS = 6


@pytest.mark.gpu
@pytest.mark.parametrize("num_ranks", [2, 4])
def test_fused_virtual_ranks_back_to_back(num_ranks: int) -> None:
    """Every rank's calls issued back to back on its own stream, each call's inputs copied into the buffer on that
    stream just before it, with no host sync between the calls: a rank that finishes a call copies its next inputs
    and notifies its peers while they still run the previous one. The fused kernel ends without a barrier, so this
    is what its parity-buffered counts and the head's clean are for (combine/clean.cuh). T drawn per call and rank
    (T = 0 included), and rank 0's pulls delayed on odd calls so that the ranks drift apart; every call's y against
    the reference, the workspaces ready after the last call."""
    from megamoe.fused.launch import prepare, run

    experts_per_rank, num_topk, hidden, intermediate, max_tokens = FUSED_SHAPE
    num_experts = experts_per_rank * num_ranks
    seed = _seed()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rc = reference.random_case([1] * num_ranks, hidden, intermediate, num_experts, num_topk, num_ranks=num_ranks,
                               generator=gen, device="cuda")
    bufs = virtual_rank_buffers(num_ranks, num_experts, max_tokens, num_topk, hidden, intermediate)
    pairs = [weights.transform_weights(rc.l1_weights[r], rc.l2_weights[r]) for r in range(num_ranks)]
    # Per call: every rank's T and inputs (drawn up front: nothing may allocate between the launches)
    tokens = [[0 if (call + r) % 5 == 4 else int(torch.randint(1, max_tokens + 1, (1,), generator=gen,
                                                                 device="cuda")) for r in range(num_ranks)]
              for call in range(BACK_TO_BACK_CALLS)]
    inputs = [[_draw_inputs(t, hidden, num_experts, num_topk, gen) for t in call_tokens] for call_tokens in tokens]
    ys = [[torch.full((t, hidden), float("nan"), dtype=torch.bfloat16, device="cuda") for t in call_tokens]
          for call_tokens in tokens]
    grid = grid_per_rank(num_ranks)
    for buf in bufs:
        prepare(buf)

    def rank_calls(stream: torch.cuda.Stream, r: int) -> None:
        with torch.cuda.stream(stream):
            for call in range(BACK_TO_BACK_CALLS):
                _fill(bufs[r], *inputs[call][r])
                run(ys[call][r], pairs[r][0], pairs[r][1], bufs[r], tokens[call][r], num_sms=grid, stream=stream,
                    debug_delay_pull=r == 0 and call % 2 == 1)

    launch_concurrently([lambda stream, r=r: rank_calls(stream, r) for r in range(num_ranks)])
    for call in range(BACK_TO_BACK_CALLS):
        per_rank = [list(field) for field in zip(*inputs[call])]  # x, x_sf, topk_idx, topk_weights: one per rank
        y_refs = reference.moe(*per_rank, rc.l1_weights, rc.l2_weights, fast_math=True)
        for r in range(num_ranks):
            tag = f"seed {seed} R {num_ranks} call {call} T {tokens[call]} rank {r}"
            err = _check_y(tag, ys[call][r], y_refs[r])
            print(f"{tag}: y rel-L2 {err:.3e}")
    for r in range(num_ranks):
        assert_workspace_ready(bufs[r], f"seed {seed} R {num_ranks} rank {r} after {BACK_TO_BACK_CALLS} calls",
                               tokens[-1][r])


# The dispatch/combine unit kernel's 2-rank shape (tests/test_dispatch_combine_multigpu.py: SHAPE)
DC_SHAPE = (2, 8, 256, 4, 512, 128)


@pytest.mark.gpu
def test_dispatch_combine_virtual_2_ranks() -> None:
    from megamoe.kernels import dispatch_combine as dc
    from megamoe.testing import dispatch_combine as dcc

    num_ranks, num_experts, t_max, num_topk, hidden, intermediate = DC_SHAPE
    bufs = virtual_rank_buffers(num_ranks, num_experts, t_max, num_topk, hidden, intermediate)
    grid = grid_per_rank(num_ranks)
    token_cases = {"random": None, "max": [t_max, t_max], "zero_on_rank1": [t_max // 2, 0], "zero_on_rank0": [0, 37]}
    errors, num_calls = [], 0
    base_seed = _seed()
    rng = random.Random(base_seed)
    for block_m in (32, 64, 128):
        for buf in bufs:
            dc.prepare(buf, block_m)
        for routing in dcc.ROUTINGS:
            for label, counts in token_cases.items():
                counts = counts or [rng.randint(1, t_max) for _ in range(num_ranks)]
                seed = rng.randrange(1 << 30)
                inputs = dcc.random_inputs(bufs[0].layout, counts, routing, seed=seed)
                ys, stats = [], []
                for buf in bufs:
                    num_tokens = dcc.load_inputs(buf, inputs[buf.rank])
                    ys.append(torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=buf.device))
                    stats.append(torch.zeros(buf.layout.num_local_experts, dtype=torch.int32, device=buf.device))
                    dcc.poison(buf, ys[-1])
                launch_concurrently([
                    lambda stream, r=r: dc.run(bufs[r], counts[r], ys[r], block_m=block_m, recv_stats=stats[r],
                                               check_inputs=False, stream=stream, num_sms=grid)
                    for r in range(num_ranks)])
                num_calls += 1
                for r, buf in enumerate(bufs):
                    errors += [f"bm={block_m} {routing} {label} T={counts} seed {seed} rank {r}: {e}"
                               for e in dcc.call_errors(buf, inputs, ys[r], stats[r], block_m)]
    for buf in bufs:
        errors += [f"rank {buf.rank}: {e}" for e in dcc.workspace_errors(buf, num_calls)]
    print(f"seed {base_seed}: {num_calls} two-rank calls, {len(errors)} mismatches")
    assert not errors, "\n".join(errors[:20])
