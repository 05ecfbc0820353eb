"""multigpu tier: the fused kernel across every visible GPU (2, 4 or 8 ranks; the issue "Fused kernel on 2, 4 and 8
H200s"), one process per GPU (megamoe.testing.ranks: torch.distributed NCCL on localhost, torch symmetric memory,
multicast off), against the reference on every rank.

Each rank draws its own tokens and its own experts' weights (megamoe.testing.fused_ranks), and the reference of its y
is computed across the ranks where the weights live (`fused_ranks.reference_y`; the cpu test below checks it against
`reference.moe` bit for bit over gloo). Every call: y poisoned (NaN) first, the recv stats (from random initial
values) against the rows each local expert received, the workspace clean afterwards.
- The matrix (one buffer per shape, sized for its largest T): smoke (E 8, 4096 x 2048, top-6, 1-4 tokens), decode
  (E 48, 7168 x 2048, 16 and 128), prefill (E 48, 7168 x 3072, 256 and 8192), DSV4-Flash (E 256, 4096 x 2048, 16 /
  128 / 4096), DSV4-Pro (E 384, 7168 x 3072, 16 / 128 / 4096), top-8 (E 256, 4096 x 2048, 128); per shape T = 0 on
  every rank and on the odd ranks, ranks with different T, masked slots, and every rank sending slot 0 of every token
  to one expert.
- 1000 calls back to back (no host synchronization), T and routing changing every call; CUDA-graph replays with
  new inputs; a rank that never launches: the others time out naming the NVLink barrier instead of hanging.
The variants are compiled by the compile-tier test here for 2, 4 and 8 ranks (`scripts/make_jit_carry.sh` runs it).
Within a device call's limit (600 s), run the matrix one shape at a time (`-k "matrix and prefill"`); the harness
gives up after HARNESS_TIMEOUT_S with every rank's traceback.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pytest

torch = pytest.importorskip("torch")


@dataclass(frozen=True)
class Shape:
    name: str
    num_experts: int
    hidden: int
    intermediate: int
    num_topk: int
    tokens: tuple[int, ...]  # per rank; the buffer is sized for the largest

    @property
    def max_tokens(self) -> int:
        return max(self.tokens)


SHAPES = {s.name: s for s in (
    Shape("smoke", 8, 4096, 2048, 6, (1, 2, 4)),
    Shape("decode", 48, 7168, 2048, 6, (16, 128)),
    Shape("prefill", 48, 7168, 3072, 6, (256, 8192)),
    Shape("flash", 256, 4096, 2048, 6, (16, 128, 4096)),
    Shape("pro", 384, 7168, 3072, 6, (16, 128, 4096)),
    Shape("top8", 256, 4096, 2048, 8, (128,)),
)}
# The back-to-back, graph and timeout scenarios (E a multiple of 2, 4 and 8)
STRESS = Shape("stress", 16, 2048, 1024, 6, (128,))
NUM_BACK_TO_BACK = 1000
NUM_GRAPH_REPLAYS = 20
RANK_COUNTS = (2, 4, 8)
# The gpu tier runs the scenarios on a one-rank NCCL group too (the harness, the draws, the reference's collectives
# and the checks on every gpu-tier run; the cross-GPU paths need the multigpu tier)
COMPILED_RANK_COUNTS = (1, *RANK_COUNTS)
TIMEOUT_S = 2.0  # device barrier timeout of the timeout scenario
HARNESS_TIMEOUT_S = 540.0  # below a device call's 600 s, so that a hang is reported with every rank's traceback


def cases(shape: Shape, num_ranks: int) -> list[tuple[str, list[int], str]]:
    """(label, T per rank, routing) of one shape's matrix."""
    small, large = shape.tokens[0], shape.max_tokens
    out = [(f"T{t}", [t] * num_ranks, "uniform") for t in shape.tokens]
    out += [("T0", [0] * num_ranks, "uniform"),
            ("T0_on_odd_ranks", [0 if r % 2 else small for r in range(num_ranks)], "uniform"),
            ("T_per_rank", [shape.tokens[r % len(shape.tokens)] for r in range(num_ranks)], "uniform"),
            (f"T{min(large, 256)}_masked", [min(large, 256)] * num_ranks, "masked"),
            (f"T{small}_hot_expert", [small] * num_ranks, "hot_expert")]
    return out


def layouts(num_ranks: int) -> list[Any]:
    from megamoe.layout import SymmLayout

    return [SymmLayout.create(num_ranks, s.num_experts, s.max_tokens, s.num_topk, s.hidden, s.intermediate)
            for s in (*SHAPES.values(), STRESS)]


# ---------------------------------------------------------------------------------------------------------------
# Scenarios: run in every rank's process, return a list of error strings (empty: pass)
# ---------------------------------------------------------------------------------------------------------------


class _Rank:
    """One rank's buffer and weights of a shape (drawn from the scenario's seed)."""

    def __init__(self, ctx: Any, shape: Shape, seed: int) -> None:
        import megamoe
        from megamoe import weights
        from megamoe.testing import fused_ranks

        self.ctx, self.shape, self.seed = ctx, shape, seed
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_local = shape.num_experts // ctx.num_ranks
        self.buf = megamoe.get_symm_buffer(ctx.group, shape.num_experts, shape.max_tokens, shape.num_topk,
                                           shape.hidden, shape.intermediate)
        self.l1, self.l2 = fused_ranks.draw_local_weights(seed, ctx.rank, self.num_local, shape.hidden,
                                                          shape.intermediate, self.device)
        self.l1_t, self.l2_t = weights.transform_weights(self.l1, self.l2)

    def tokens(self, case_seed: int, num_tokens: int, routing: str) -> Any:
        from megamoe.testing import fused_ranks

        return fused_ranks.draw_tokens(case_seed, self.ctx.rank, num_tokens, self.shape.num_experts,
                                       self.shape.num_topk, self.shape.hidden, routing, self.device)

    def fill(self, tokens: Any) -> None:
        from test_fused_e2e_gpu import _fill

        _fill(self.buf, tokens.x, tokens.x_sf, tokens.topk_idx, tokens.topk_weights)

    def new_stats(self) -> Any:
        """Random initial recv stats (a kernel that assigned instead of adding would lose them)."""
        return torch.randint(0, 100, (self.num_local,), dtype=torch.int32, device=self.device)

    def check(self, tag: str, tokens: Any, y: Any, initial_stats: Any = None, stats: Any = None,
              clean: bool = True) -> tuple[list[str], Any]:
        """y against the reference, the recv stats against initial_stats + the rows each local expert received (when
        given), the workspace ready for the next call (when `clean`; `tokens` must then be the last call's).
        Returns (errors, those rows). Collective: the reference runs across the ranks."""
        from megamoe import reference
        from megamoe.testing import fused_ranks
        from test_fused_gpu import assert_workspace_ready, max_y_rel_l2

        errors = []
        # NOTES: read before the collective below. The fused call ends without a barrier, so a peer that has
        # passed this check may launch its next call, whose notify lands in this rank's next-parity receive
        # counts before this rank's next launch; it cannot get there before this rank joins the collective.
        if clean:
            try:
                assert_workspace_ready(self.buf, tag, y.shape[0])
            except AssertionError as exc:
                errors.append(str(exc))
        y_ref, recv = fused_ranks.reference_y(self.ctx.group, self.ctx.rank, self.ctx.num_ranks, tokens, self.l1,
                                              self.l2)
        if y.numel():
            if not bool(torch.isfinite(y).all()):
                errors.append(f"{tag}: y holds non-finite values")
            else:
                err = reference.rel_l2(y.float(), y_ref.float())
                if err > max_y_rel_l2(y.shape[0]):
                    errors.append(f"{tag}: y rel-L2 {err:.3e} > {max_y_rel_l2(y.shape[0])}")
        if stats is not None and not torch.equal(stats, initial_stats + recv):
            errors.append(f"{tag}: recv stats {stats.tolist()}, expected {initial_stats.tolist()} + {recv.tolist()}")
        return errors, recv


def _scenario_matrix(ctx: Any, shape_name: str, seed: int) -> list[str]:
    import megamoe

    shape = SHAPES[shape_name]
    rank = _Rank(ctx, shape, seed)
    errors = []
    for index, (label, counts, routing) in enumerate(cases(shape, ctx.num_ranks)):
        case_seed = seed + 1 + index
        tokens = rank.tokens(case_seed, counts[ctx.rank], routing)
        rank.fill(tokens)
        y = torch.full((counts[ctx.rank], shape.hidden), float("nan"), dtype=torch.bfloat16, device=rank.device)
        stats = rank.new_stats()
        initial = stats.clone()
        ctx.phase_barrier()
        megamoe.fused(y, rank.l1_t, rank.l2_t, rank.buf, counts[ctx.rank], stats)
        torch.cuda.synchronize()
        errors += rank.check(f"{shape.name} R {ctx.num_ranks} {label} T {counts} seed {case_seed} rank {ctx.rank}",
                             tokens, y, initial, stats)[0]
    rank.buf.destroy()
    return errors


def _scenario_back_to_back(ctx: Any, seed: int, num_calls: int) -> list[str]:
    """Calls queued with no host synchronization: each copies its inputs into the buffer, then launches; T per
    rank and routing change every call (the release chains across ranks under stress)."""
    import random

    import megamoe
    from megamoe.testing.dispatch_combine import load_inputs
    from megamoe.testing.fused_ranks import ROUTINGS

    rank = _Rank(ctx, STRESS, seed)
    rng = random.Random(seed)  # the same sequence on every rank
    calls = []
    for call in range(num_calls):
        counts = [rng.choice([0, 1, rng.randint(1, STRESS.max_tokens), STRESS.max_tokens]) for _ in
                  range(ctx.num_ranks)]
        routing = ROUTINGS[call % len(ROUTINGS)]
        calls.append((counts, routing, rank.tokens(seed + 1 + call, counts[ctx.rank], routing)))
    ys = []
    stats = rank.new_stats()  # accumulates over every call
    initial = stats.clone()
    ctx.phase_barrier()
    for _, _, tokens in calls:
        num_tokens = load_inputs(rank.buf, tokens)
        y = torch.full((num_tokens, STRESS.hidden), float("nan"), dtype=torch.bfloat16, device=rank.device)
        megamoe.fused(y, rank.l1_t, rank.l2_t, rank.buf, num_tokens, stats, check_inputs=False)
        ys.append(y)
    torch.cuda.synchronize()
    errors, received = [], torch.zeros_like(initial)
    for call, ((counts, routing, tokens), y) in enumerate(zip(calls, ys)):
        call_errors, recv = rank.check(f"call {call} {routing} T {counts} rank {ctx.rank}", tokens, y,
                                       clean=call == len(calls) - 1)
        errors += call_errors
        received += recv
    if not torch.equal(stats, initial + received):
        errors.append(f"rank {ctx.rank}: recv stats after {num_calls} calls {stats.tolist()}, expected "
                      f"{initial.tolist()} + {received.tolist()}")
    rank.buf.destroy()
    return errors


def _scenario_graph(ctx: Any, seed: int) -> list[str]:
    """One capture per rank at a fixed T; every replay (all ranks together) reads new inputs copied into the
    buffer outside the graph and writes the captured y."""
    import megamoe
    from megamoe.bench.timing import graphed

    rank = _Rank(ctx, STRESS, seed)
    num_tokens = 96
    y = torch.full((num_tokens, STRESS.hidden), float("nan"), dtype=torch.bfloat16, device=rank.device)
    rank.fill(rank.tokens(seed + 1, num_tokens, "uniform"))
    ctx.phase_barrier()
    megamoe.fused(y, rank.l1_t, rank.l2_t, rank.buf, num_tokens)  # compile and load outside the capture
    ctx.phase_barrier()
    replay = graphed(lambda: megamoe.fused(y, rank.l1_t, rank.l2_t, rank.buf, num_tokens, check_inputs=False),
                     capture_error_mode="thread_local")
    errors = []
    for replay_idx in range(NUM_GRAPH_REPLAYS):
        tokens = rank.tokens(seed + 2 + replay_idx, num_tokens, "masked")
        rank.fill(tokens)
        y.fill_(float("nan"))
        ctx.phase_barrier()
        replay()
        torch.cuda.synchronize()
        errors += rank.check(f"replay {replay_idx} rank {ctx.rank}", tokens, y)[0]
    rank.buf.destroy()
    return errors


_KEPT_UNTIL_EXIT: list = []


def _scenario_peer_never_arrives(ctx: Any, seed: int) -> list[str]:
    """Rank 1 never launches; every other rank must time out at the dispatch barrier, report it and trap."""
    import torch.distributed as dist

    from megamoe.fused import prepare
    from megamoe.fused import run as fused_run
    from megamoe.testing.ranks import expect_barrier_timeout

    rank = _Rank(ctx, STRESS, seed)
    # NOTES: after the trap, freeing symmetric memory raises inside a destructor (std::terminate) before this rank
    # can report: the buffer stays referenced until the worker leaves with os._exit
    _KEPT_UNTIL_EXIT.append(rank)
    num_tokens = 64
    rank.fill(rank.tokens(seed + 1, num_tokens, "uniform"))
    y = torch.empty(num_tokens, STRESS.hidden, dtype=torch.bfloat16, device=rank.device)
    prepare(rank.buf)  # load the module and allocate the timeout records before the timed window
    torch.cuda.synchronize()
    # NOTES: no NCCL communicator may be alive when a rank traps (torch's watchdog would abort the process before it
    # reports); the peers' mappings stay valid after the group is gone, and rank 1 keeps its memory alive until
    # rank 0 has reported
    dist.barrier(group=ctx.group)
    dist.destroy_process_group()
    if ctx.rank == 1:
        ctx.release.wait(300)
        time.sleep(TIMEOUT_S * 10)  # the other ranks (beyond rank 0) trap about as late as rank 0
        return []
    return expect_barrier_timeout(
        ctx.rank, lambda: fused_run(y, rank.l1_t, rank.l2_t, rank.buf, num_tokens, timeout_s=TIMEOUT_S), TIMEOUT_S)


_SCENARIOS = {"matrix": _scenario_matrix, "back_to_back": _scenario_back_to_back, "graph": _scenario_graph,
              "peer_never_arrives": _scenario_peer_never_arrives}


# ---------------------------------------------------------------------------------------------------------------
# Process harness (megamoe.testing.ranks)
# ---------------------------------------------------------------------------------------------------------------


def _run_scenario(ctx: Any, scenario: str, kwargs: dict) -> list[str]:
    return _SCENARIOS[scenario](ctx, **kwargs)


def _spawn(scenario: str, timeout_s: float = HARNESS_TIMEOUT_S, num_ranks: int | None = None, **kwargs: Any) -> None:
    """The scenario on num_ranks ranks (default: every visible GPU, which must be 2, 4 or 8 SM90 GPUs)."""
    import random

    from megamoe.fused import compile_fused, config_for
    from megamoe.testing.ranks import spawn_ranks

    if num_ranks is None:
        num_ranks = torch.cuda.device_count()
        if num_ranks not in RANK_COUNTS or any(torch.cuda.get_device_capability(d) != (9, 0)
                                               for d in range(num_ranks)):
            pytest.skip(f"multigpu tier: needs 2, 4 or 8 SM90 GPUs, found {num_ranks}")
    for layout in layouts(num_ranks):  # here once (a cache hit when carried), not in every rank at once
        compile_fused(config_for(layout))
    seed = random.SystemRandom().randrange(1 << 30)
    outcome = spawn_ranks(num_ranks, _run_scenario, scenario, dict(kwargs, seed=seed), what=scenario,
                          timeout_s=timeout_s)
    failures = [e for errors in outcome for e in errors]
    print(f"{scenario} {kwargs} on {num_ranks} ranks, seed {seed}: {len(failures)} failures")
    assert not failures, f"seed {seed}:\n" + "\n".join(failures[:30])


# ---------------------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------------------


GLOO_SHAPE = (8, 256, 128, 3)  # experts, hidden, intermediate, top-k of the cpu test


def _gloo_draw(seed: int, rank: int, counts: list[int], routing: str) -> tuple[tuple, Any]:
    """(natural local weights, tokens) of one rank of the cpu test."""
    from megamoe.testing import fused_ranks

    num_experts, hidden, intermediate, num_topk = GLOO_SHAPE
    weights = fused_ranks.draw_local_weights(seed, rank, num_experts // len(counts), hidden, intermediate, "cpu")
    return weights, fused_ranks.draw_tokens(seed + 1, rank, counts[rank], num_experts, num_topk, hidden, routing, "cpu")


def _gloo_reference(ctx: Any, seed: int, counts: list[int], routing: str) -> tuple[list[int], list[int]]:
    from megamoe.testing import fused_ranks

    (l1, l2), tokens = _gloo_draw(seed, ctx.rank, counts, routing)
    y, recv = fused_ranks.reference_y(ctx.group, ctx.rank, ctx.num_ranks, tokens, l1, l2)
    return y.view(torch.int16).flatten().tolist(), recv.tolist()


@pytest.mark.parametrize("counts, routing", [([5, 3], "uniform"), ([0, 4], "masked"), ([6, 2], "hot_expert"),
                                             ([3, 0, 5, 2], "masked"), ([0, 0, 0, 0], "uniform")])
def test_distributed_reference_matches_reference_moe(counts: list[int], routing: str) -> None:
    """cpu tier: the per-rank reference across 2 and 4 gloo ranks equals `reference.moe` over every rank's inputs,
    bit for bit, y and recv stats."""
    from megamoe import reference
    from megamoe.testing.ranks import spawn_ranks

    seed, num_ranks = 7, len(counts)
    num_experts = GLOO_SHAPE[0]
    got = spawn_ranks(num_ranks, _gloo_reference, seed, counts, routing, backend="gloo", what="reference",
                      timeout_s=120)
    weights, tokens = zip(*(_gloo_draw(seed, r, counts, routing) for r in range(num_ranks)))
    stats = [torch.zeros(num_experts // num_ranks, dtype=torch.int32) for _ in range(num_ranks)]
    ys = reference.moe([t.x for t in tokens], [t.x_sf for t in tokens], [t.topk_idx for t in tokens],
                       [t.topk_weights for t in tokens], [w[0] for w in weights], [w[1] for w in weights],
                       fast_math=True, cumulative_local_expert_recv_stats=stats)
    assert sum(int(s.sum()) for s in stats) == sum(int((t.topk_idx >= 0).sum()) for t in tokens)
    for r in range(num_ranks):
        assert got[r][0] == ys[r].view(torch.int16).flatten().tolist(), f"rank {r}: y differs"
        assert got[r][1] == stats[r].tolist(), f"rank {r}: recv counts"
    if routing == "hot_expert":
        hot = (seed + 1) % num_experts
        assert all(bool((t.topk_idx[:, 0] == hot).all()) for t in tokens)
        assert all(bool((t.topk_idx[:, 1:] != hot).all()) for t in tokens)


@pytest.mark.compile
def test_fused_multigpu_variants_compile() -> None:
    """compile tier: the variants this file launches on 1, 2, 4 and 8 ranks (so the carried JIT cache holds them)."""
    from megamoe.fused import compile_fused, config_for
    from megamoe.jit import checks

    for num_ranks in COMPILED_RANK_COUNTS:
        for layout in layouts(num_ranks):
            result = compile_fused(config_for(layout))
            problems = checks.violations(result, checks.CheckOptions(expect_qgmma=True))
            assert not problems, problems


@pytest.mark.gpu
@pytest.mark.parametrize("scenario, kwargs", [("matrix", {"shape_name": "smoke"}), ("matrix", {"shape_name": "top8"}),
                                              ("back_to_back", {"num_calls": 100}), ("graph", {})],
                         ids=["smoke", "top8", "back_to_back", "graph"])
def test_fused_scenarios_one_rank(scenario: str, kwargs: dict) -> None:
    """gpu tier: the multigpu scenarios on a one-rank NCCL group (every rank-local path of this file)."""
    _spawn(scenario, num_ranks=1, **kwargs)


@pytest.mark.multigpu
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fused_matrix_every_gpu(shape: str) -> None:
    _spawn("matrix", shape_name=shape)


@pytest.mark.multigpu
def test_fused_back_to_back_calls_every_gpu() -> None:
    _spawn("back_to_back", num_calls=NUM_BACK_TO_BACK)


@pytest.mark.multigpu
def test_fused_cuda_graph_every_gpu() -> None:
    _spawn("graph")


@pytest.mark.multigpu
def test_fused_peer_that_never_arrives_times_out() -> None:
    _spawn("peer_never_arrives", timeout_s=300.0)
