"""`megamoe demo`: the MoE layer on a DSV4-Flash-like config. Prints the config, the symmetric layout and a phase
report. Without an SM90 GPU every phase runs in the reference; with one, rank 0's tokens and local experts run
through the GEMM component (each GEMM on the reference's pool) and through the fused kernel as one rank, each
checked against the reference."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from rich.console import Console

from megamoe import heuristics, quant, reference
from megamoe.layout import SymmLayout
from megamoe.report import PhaseRow, phase_table

console = Console()


@dataclass(frozen=True)
class DemoConfig:
    num_experts: int = 256
    hidden: int = 4096
    intermediate: int = 2048
    num_topk: int = 6
    num_ranks: int = 8
    num_tokens: int = 128  # per rank
    seed: int = 0

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks


@dataclass
class RankProblem:
    """Rank 0's view: its tokens routed to its own local experts, natural weights and their float originals."""

    x: torch.Tensor
    x_sf: torch.Tensor
    x_float: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    l1: tuple[torch.Tensor, torch.Tensor]
    l2: tuple[torch.Tensor, torch.Tensor]
    w1_float: torch.Tensor
    w2_float: torch.Tensor


def make_rank_problem(cfg: DemoConfig, device: torch.device) -> RankProblem:
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
    e, h, i = cfg.num_local_experts, cfg.hidden, cfg.intermediate
    # Weights expert by expert, so that the float temporaries stay one expert large
    w1_float = torch.empty(e, 2 * i, h)
    w2_float = torch.empty(e, h, i)
    for idx in range(e):
        w1_float[idx] = torch.randn(2 * i, h, generator=gen) / math.sqrt(h)
        w2_float[idx] = torch.randn(h, i, generator=gen) / math.sqrt(i)
    l1 = quant.per_block_cast_to_fp8(w1_float)
    l2 = quant.per_block_cast_to_fp8(w2_float)
    x_float = torch.randn(cfg.num_tokens, h, generator=gen)
    x, x_sf = quant.per_token_cast_to_fp8(x_float)
    topk = min(cfg.num_topk, e)
    topk_idx = quant.random_routing(cfg.num_tokens, e, topk, mask_prob=0.05, generator=gen)
    topk_weights = quant.random_topk_weights(cfg.num_tokens, topk, generator=gen)
    to = lambda t: t.to(device)  # noqa: E731
    return RankProblem(to(x), to(x_sf), to(x_float), to(topk_idx), to(topk_weights), (to(l1[0]), to(l1[1])),
                       (to(l2[0]), to(l2[1])), w1_float, w2_float)


def _gemm_phases(cfg: DemoConfig, problem: RankProblem, inter: reference.RankIntermediates,
                 config: heuristics.MoeConfig) -> list[PhaseRow]:
    """Run the GEMM component on the reference's dispatched pool (L1) and requantized activations (L2)."""
    from megamoe.kernels import gemm
    from megamoe.weights import l1_interleave_permutation, transform_weights

    counts = [ex.x.shape[0] for ex in inter.experts]
    block_m = config.block_m
    (w1_t, w1_sf), (w2, w2_sf) = transform_weights(problem.l1, problem.l2)
    rows = []
    for phase, mode, n, k, a_rows, a_sf_rows, b, b_sf in (
        ("L1 GEMM", "l1", 2 * cfg.intermediate, cfg.hidden, [ex.x for ex in inter.experts],
         [ex.x_sf for ex in inter.experts], w1_t, w1_sf),
        ("L2 GEMM", "l2", cfg.hidden, cfg.intermediate, [ex.l2_act for ex in inter.experts],
         [ex.l2_act_sf for ex in inter.experts], w2, w2_sf),
    ):
        gcfg = gemm.GemmConfig(block_m, mode, n, k, len(counts))
        offsets = gcfg.pool_offsets(counts)
        num_rows = max(4, -(-(offsets[-1] + -(-counts[-1] // block_m) * block_m) // 4) * 4)
        a = torch.zeros(num_rows, k, dtype=torch.float8_e4m3fn, device="cuda")
        a_sf = torch.ones(a_sf_rows[0].shape[1], num_rows, device="cuda")
        for e, (q, sf) in enumerate(zip(a_rows, a_sf_rows)):
            a[offsets[e]:offsets[e] + counts[e]] = q
            a_sf[:, offsets[e]:offsets[e] + counts[e]] = sf.t()
        d = torch.full((num_rows, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        start = time.perf_counter()
        gemm.run(gcfg, a, a_sf.contiguous(), b, b_sf, torch.tensor(counts, dtype=torch.int32, device="cuda"), d)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - start) * 1e3
        errs = []
        for e, ex in enumerate(inter.experts):
            if counts[e] == 0:
                continue
            got = d[offsets[e]:offsets[e] + counts[e]].float()
            want = (ex.l1_acc[:, l1_interleave_permutation(cfg.intermediate, device="cuda")] if mode == "l1"
                    else ex.out.float())
            errs.append(reference.rel_l2(got, want))
        rows.append(PhaseRow(phase, "kernel", f"GEMM component, {mode} mode, BLOCK_M {block_m} ({ms:.1f} ms incl. "
                                              f"JIT/launch)", f"worst per-expert rel-L2 {max(errs):.2e}"))
    return rows


def _fused_phases(cfg: DemoConfig, problem: RankProblem, inter: reference.RankIntermediates) -> list[PhaseRow]:
    """Rank 0's problem through megamoe.fused on one GPU (its local experts as a 1-rank layout)."""
    import megamoe
    from megamoe.bench.timing import time_queued_us
    from megamoe.buffer import allocate
    from megamoe.fused import config_for

    t, e = cfg.num_tokens, cfg.num_local_experts
    layout = SymmLayout.create(1, e, t, problem.topk_idx.shape[1], cfg.hidden, cfg.intermediate)
    buf = allocate(None, layout, torch.device("cuda"))
    l1, l2 = megamoe.transform_weights(problem.l1, problem.l2)
    for name in ("x", "x_sf", "topk_idx", "topk_weights"):
        getattr(buf, name)[:t].copy_(getattr(problem, name))
    stats = torch.zeros(e, dtype=torch.int32, device="cuda")
    y = torch.full((t, cfg.hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    start = time.perf_counter()
    megamoe.fused(y, l1, l2, buf, t, stats)
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - start) * 1e3
    counts = [ex.x.shape[0] for ex in inter.experts]
    timed = time_queued_us(lambda: megamoe.fused(y, l1, l2, buf, t, check_inputs=False), warmup=3, iters=20)
    fused_config = config_for(layout)
    return [
        PhaseRow("dispatch (fused kernel)", "kernel", f"recv counts per local expert "
                 f"{'equal to' if stats.tolist() == counts else 'DIFFERENT FROM'} the reference's",
                 "exact" if stats.tolist() == counts else f"{stats.tolist()} vs {counts}"),
        PhaseRow("fused kernel", "kernel", f"one launch ({fused_config.name}); first call {first_ms:.1f} ms incl. "
                 f"JIT/load, then median {timed['median_us']:.1f} us of 20",
                 f"y rel-L2 vs reference {reference.rel_l2(y.float(), inter.y.float()):.2e}"),
    ]


def run(cfg: DemoConfig) -> None:
    has_sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    device = torch.device("cuda" if has_sm90 else "cpu")
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count if has_sm90 else 132
    config = heuristics.select_config(cfg.num_ranks, cfg.num_experts, cfg.num_tokens, cfg.num_topk, cfg.hidden,
                                      cfg.intermediate, num_sms=num_sms)
    layout = SymmLayout.create(cfg.num_ranks, cfg.num_experts, cfg.num_tokens, cfg.num_topk, cfg.hidden,
                               cfg.intermediate)
    console.rule(f"megamoe demo: {cfg.num_experts} experts, hidden {cfg.hidden}, intermediate {cfg.intermediate}, "
                 f"top-{cfg.num_topk}, {cfg.num_ranks} ranks x {cfg.num_tokens} tokens")
    console.print(heuristics.config_detail_table(config))
    console.print(layout.to_table())

    console.print(f"[bold]Running rank 0[/] on {'the GPU' if has_sm90 else 'the CPU (no SM90 GPU visible)'}: "
                  f"its {cfg.num_tokens} tokens routed among its {cfg.num_local_experts} local experts")
    start = time.perf_counter()
    problem = make_rank_problem(cfg, device)
    inter = reference.moe(problem.x, problem.x_sf, problem.topk_idx, problem.topk_weights, problem.l1, problem.l2,
                          return_intermediates=True)
    ref_seconds = time.perf_counter() - start
    y_fp32 = reference.moe_fp32(problem.x_float.cpu(), problem.topk_idx.cpu(), problem.topk_weights.cpu(),
                                problem.w1_float, problem.w2_float)
    counts = [ex.x.shape[0] for ex in inter.experts]
    codes = sum(ex.l2_act.numel() for ex in inter.experts)

    rows = [PhaseRow("dispatch", "reference" if not has_sm90 else "not built yet",
                     f"{sum(counts)} rows to {len(counts)} experts (min {min(counts)}, max {max(counts)}); "
                     f"{sum(-(-c // config.block_m) for c in counts)} pool blocks of {config.block_m}",
                     "pool = reference intermediates")]
    if has_sm90:
        rows[0] = PhaseRow("dispatch", "reference", rows[0].detail, rows[0].check)
        rows += _gemm_phases(cfg, problem, inter, config)
        rows += _fused_phases(cfg, problem, inter)
    else:
        rows += [PhaseRow("L1 GEMM", "reference", "per-128-K promoted FP8 dot products", ""),
                 PhaseRow("SwiGLU + requant", "reference", f"{codes} FP8 codes, per-64 float SF", ""),
                 PhaseRow("L2 GEMM", "reference", "per-64 activation SF, BF16 per slot", ""),
                 PhaseRow("combine", "reference", "top-k sum in fp32, BF16 y", "")]
    rows.append(PhaseRow("y", "reference", f"reference computed in {ref_seconds:.1f} s",
                         f"FP8 recipe vs unquantized fp32 MoE: rel-L2 {reference.rel_l2(inter.y.float().cpu(), y_fp32):.2%}"))
    console.print(phase_table("phase report (rank 0)", rows))
