"""Benchmarks (not tests): median of many runs after warm-up, timed with CUDA events, side by side in one run
with the baselines and the measured ceilings of the H200. `megamoe bench <name>` prints a rich table and writes
JSON.

gemm: the grouped GEMM component against cuBLAS, one GPU.
comm: the dispatch -> trivial expert -> combine unit kernel against an NCCL all_to_all_single round trip, one
process per GPU (spawned here; every visible GPU is a rank); `megamoe bench comm --compile-only` fills the JIT
cache with every variant it launches, on a machine without a GPU.
"""
from __future__ import annotations

import json
import os
import queue as queue_module
import socket
import statistics
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from rich.console import Console
from rich.table import Table

# Ceilings measured on the H200s of this project (README "Benchmarks").
HBM_READ_TBPS = 4.36
FP8_DENSE_TFLOPS = 1350.0
BF16_DENSE_TFLOPS = 780.0


def time_us(fn: Callable[[], None], *, warmup: int = 5, iters: int = 30) -> float:
    """Median over `iters` runs of fn, each timed with its own CUDA events, after `warmup` runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3)
    return statistics.median(times)


def graphed(fn: Callable[[], None], capture_error_mode: str = "global") -> Callable[[], None]:
    """Capture fn (e.g. a per-group loop of launches) in a CUDA graph; returns its replay. capture_error_mode as
    torch.cuda.graph ("thread_local" for NCCL: its watchdog thread queries events during the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside capture (cuBLAS handles, workspaces)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=capture_error_mode):
        fn()
    return graph.replay


@dataclass
class Measurement:
    impl: str
    time_us: float | None
    tflops: float | None = None
    weight_gbps: float | None = None
    note: str = ""


@dataclass
class CaseResult:
    case: str
    flops: float
    weight_bytes: float
    measurements: list[Measurement] = field(default_factory=list)

    def add(self, impl: str, time: float | None, note: str = "") -> None:
        self.measurements.append(Measurement(
            impl, time, None if time is None else self.flops / time / 1e6,
            None if time is None else self.weight_bytes / time / 1e3, note))


# ---------------------------------------------------------------------------------------------------------------
# GEMM component
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GemmCase:
    name: str
    num_groups: int
    rows: int
    n: int
    k: int
    mode: str
    block_m: int


GEMM_CASES = [
    GemmCase("decode 32x24", 32, 24, 4096, 4096, "l1", 64),
    GemmCase("prefill 32x1536", 32, 1536, 4096, 4096, "l1", 128),
    GemmCase("4x8192 K7168", 4, 8192, 4096, 7168, "l1", 128),
    GemmCase("L2 32x1536 K2048", 32, 1536, 4096, 2048, "l2", 128),
]


def _cublas_blockwise(problem) -> Callable[[], None]:
    """torch._scaled_mm per group with blockwise scales (1x128 for A, 128x128 for B): the same recipe as our L1
    mode (L2 mode: approximated with per-128 A scales, the closest blockwise recipe cuBLAS offers)."""
    cfg = problem.config
    calls = []
    for e in range(cfg.num_experts):
        rows = problem.rows(e)
        a = problem.a[rows]
        sf = problem.a_sf[:, rows] if cfg.mode == "l1" else problem.a_sf[::2, rows]
        scale_a = sf.contiguous().t()  # (M, K/128), M-major
        scale_b = problem.b_sf[e].t()  # (K/128, N/128)
        out = torch.empty(a.shape[0], cfg.n, dtype=torch.bfloat16, device=a.device)
        calls.append((a, problem.b[e].t(), scale_a, scale_b, out))

    def run() -> None:
        for a, b, scale_a, scale_b, out in calls:
            torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.bfloat16, out=out)

    return run


def _bf16_grouped(problem) -> Callable[[], None]:
    cfg = problem.config
    a = torch.cat([problem.a[problem.rows(e)] for e in range(cfg.num_experts)]).to(torch.bfloat16)
    b = problem.b.to(torch.bfloat16).transpose(1, 2)  # [G, K, N], K contiguous
    offs = torch.tensor(problem.counts, device=a.device, dtype=torch.int32).cumsum(0).to(torch.int32)
    return lambda: torch._grouped_mm(a, b, offs=offs, out_dtype=torch.bfloat16)


def bench_gemm(cases: list[GemmCase] = GEMM_CASES) -> list[CaseResult]:
    from megamoe.kernels import gemm

    results = []
    for case in cases:
        config = gemm.GemmConfig(case.block_m, case.mode, case.n, case.k, case.num_groups)
        problem = gemm.make_problem(config, [case.rows] * case.num_groups, small_int=False)
        d = torch.empty(problem.num_pool_rows, case.n, dtype=torch.bfloat16, device="cuda")
        result = CaseResult(case.name, 2.0 * case.num_groups * case.rows * case.n * case.k,
                            float(case.num_groups * case.n * case.k))
        result.add(f"megamoe {case.mode} BM{case.block_m} (graphed)",
                   time_us(graphed(lambda: gemm.run_problem(problem, d))))
        for impl, make in (("cuBLAS blockwise loop (graphed)", _cublas_blockwise),
                           ("torch._grouped_mm BF16 (graphed)", _bf16_grouped)):
            try:
                result.add(impl, time_us(graphed(make(problem))))
            except Exception as exc:  # a baseline this torch build lacks is reported, not fatal
                result.add(impl, None, note=f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
        results.append(result)
        del problem, d
        torch.cuda.empty_cache()
    return results


def results_table(title: str, results: list[CaseResult]) -> Table:
    table = Table(title=title)
    for col in ("case", "implementation", "time (us)", "TFLOP/s", "% of FP8 1350", "weights GB/s",
                "% of HBM 4.36 TB/s", "note"):
        table.add_column(col, justify="right" if col not in ("case", "implementation", "note") else "left")
    for result in results:
        for i, m in enumerate(result.measurements):
            fmt = (lambda v, f: "n/a" if v is None else format(v, f))
            table.add_row(result.case if i == 0 else "", m.impl, fmt(m.time_us, ".1f"), fmt(m.tflops, ".0f"),
                          fmt(None if m.tflops is None else 100 * m.tflops / FP8_DENSE_TFLOPS, ".0f"),
                          fmt(m.weight_gbps, ".0f"),
                          fmt(None if m.weight_gbps is None else m.weight_gbps / HBM_READ_TBPS / 10, ".0f"), m.note)
        table.add_section()
    return table


# ---------------------------------------------------------------------------------------------------------------
# Local expert FFN (ffn): the expert_ffn unit kernel against the same recipe run unfused through cuBLAS, one GPU
# ---------------------------------------------------------------------------------------------------------------
FFN_TOLERANCE_REL_L2 = 3e-2  # BF16 outputs: ours vs the cuBLAS pipeline, each vs the exact reference (expert 0)
FFN_APPROX_TOLERANCE_REL_L2 = 6e-2  # the per-128 approximation is another recipe (expected ~2% from per-64)
FFN_FORMULA = (
    "weight bytes = E x 3 x H x I (FP8 w1 [2I, H] + w2 [H, I] per expert; their float SFs, 0.02%, not counted); "
    "weight floor = weight bytes / {hbm:g} TB/s (measured HBM read); x of floor = time / floor; speedup = time of "
    "the cuBLAS unfused pipeline of the same recipe / time; TFLOP/s = 6 x E x rows x H x I / time. Times: median "
    "of {iters} runs after {warmup} warm-up, each a CUDA graph replay between CUDA events; inputs fresh random "
    "(seed {seed}); every timed output checked first against the exact reference (expert 0) and ours against "
    "cuBLAS (all rows)."
)


def ffn_weight_bytes(num_experts: int, hidden: int, intermediate: int) -> int:
    """FP8 weight bytes the local expert FFN reads: w1 [E, 2I, H] + w2 [E, H, I]."""
    return num_experts * 3 * hidden * intermediate


def ffn_flops(num_experts: int, rows: int, hidden: int, intermediate: int) -> float:
    """L1 (2 x rows x 2I x H) + L2 (2 x rows x H x I) per expert."""
    return 6.0 * num_experts * rows * hidden * intermediate


def weight_floor_us(weight_bytes: float, tbps: float = HBM_READ_TBPS) -> float:
    """The time to read the weights once at the measured HBM read bandwidth."""
    return weight_bytes / (tbps * 1e6)


@dataclass(frozen=True)
class FfnTarget:
    """Faster than the cuBLAS unfused pipeline of the same recipe; optionally within max_floor_ratio x the
    weight-read floor."""

    max_floor_ratio: float | None = None

    def describe(self, floor_us: float) -> str:
        parts = ["faster than cuBLAS unfused"]
        if self.max_floor_ratio is not None:
            parts.append(f"<= {self.max_floor_ratio:g}x floor ({self.max_floor_ratio * floor_us:.0f} us)")
        return ", ".join(parts)

    def met(self, time_us: float | None, baseline_us: float | None, floor_us: float) -> bool | None:
        """False when a part that can be checked fails; None when a part cannot be checked (no time, no
        baseline) and the others pass."""
        if time_us is None:
            return None
        checks: list[bool | None] = [None if baseline_us is None else time_us < baseline_us]
        if self.max_floor_ratio is not None:
            checks.append(time_us <= self.max_floor_ratio * floor_us)
        if False in checks:
            return False
        return None if None in checks else True


@dataclass(frozen=True)
class FfnBenchCase:
    """Every expert receives the same `rows`. BLOCK_M from the heuristics' band for `rows`; fast math, no clamp
    (the fused API's defaults)."""

    name: str
    num_experts: int
    rows: int
    hidden: int
    intermediate: int
    target: FfnTarget = FfnTarget()

    @property
    def block_m(self) -> int:
        from megamoe import heuristics

        return heuristics.block_m_for(self.rows)

    @property
    def config(self) -> Any:
        from megamoe.kernels import expert_ffn

        return expert_ffn.ExpertFfnConfig(self.block_m, self.hidden, self.intermediate, self.num_experts,
                                          clamp=False, fast_math=True)

    @property
    def counts(self) -> list[int]:
        return [self.rows] * self.num_experts

    @property
    def weight_bytes(self) -> int:
        return ffn_weight_bytes(self.num_experts, self.hidden, self.intermediate)

    @property
    def flops(self) -> float:
        return ffn_flops(self.num_experts, self.rows, self.hidden, self.intermediate)

    @property
    def floor_us(self) -> float:
        return weight_floor_us(self.weight_bytes)


FFN_CASES = (
    FfnBenchCase("decode 32x24", 32, 24, 4096, 2048, FfnTarget(max_floor_ratio=1.3)),
    FfnBenchCase("prefill 32x1536", 32, 1536, 4096, 2048, FfnTarget()),
)


def ffn_kernel_configs(cases: Sequence[FfnBenchCase] = FFN_CASES) -> list[Any]:
    """The ExpertFfnConfig of every unit-kernel variant `megamoe bench ffn` launches (kernels/catalog.py lists
    them, so `megamoe jit warm` compiles them ahead)."""
    return list({case.config.name: case.config for case in cases}.values())


# Results ------------------------------------------------------------------------------------------------------
@dataclass
class FfnMeasurement:
    impl: str
    time_us: float | None
    tflops: float | None
    weight_gbps: float | None
    floor_ratio: float | None  # time / weight-read floor
    speedup: float | None  # cuBLAS unfused (same recipe) time / this time
    target: str = "-"
    met: bool | None = None
    note: str = ""


@dataclass
class FfnCaseResult:
    case: str
    num_experts: int
    rows_per_expert: int
    hidden: int
    intermediate: int
    block_m: int
    flops: float
    weight_bytes: float
    floor_us: float
    device: str = ""
    warmup: int = 0
    iters: int = 0
    seed: int = 0
    measurements: list[FfnMeasurement] = field(default_factory=list)

    @classmethod
    def of(cls, case: FfnBenchCase, **kwargs: Any) -> FfnCaseResult:
        return cls(case.name, case.num_experts, case.rows, case.hidden, case.intermediate, case.block_m,
                   case.flops, float(case.weight_bytes), case.floor_us, **kwargs)

    def add(self, impl: str, time_us: float | None, note: str = "", *, baseline_us: float | None = None,
            target: FfnTarget | None = None) -> FfnMeasurement:
        ok = time_us is not None and time_us > 0
        m = FfnMeasurement(
            impl, time_us,
            self.flops / time_us / 1e6 if ok else None,
            self.weight_bytes / time_us / 1e3 if ok else None,
            time_us / self.floor_us if ok else None,
            baseline_us / time_us if ok and baseline_us else None,
            target.describe(self.floor_us) if target else "-",
            target.met(time_us if ok else None, baseline_us, self.floor_us) if target else None,
            note)
        self.measurements.append(m)
        return m


def ffn_formula(results: Sequence[FfnCaseResult]) -> str:
    first = results[0] if results else None
    return FFN_FORMULA.format(hbm=HBM_READ_TBPS, iters=first.iters if first else 0,
                              warmup=first.warmup if first else 0, seed=first.seed if first else 0)


def ffn_results_table(title: str, results: list[FfnCaseResult]) -> Table:
    table = Table(title=title, caption=ffn_formula(results))
    left = ("case", "implementation", "target", "note")
    for col in ("case", "implementation", "time (us)", "TFLOP/s", "weight GB/s", "x of weight floor",
                "speedup vs cuBLAS unfused", "target", "met?", "note"):
        table.add_column(col, justify="left" if col in left else "right")
    fmt = (lambda v, f: "n/a" if v is None else format(v, f))
    for result in results:
        label = f"{result.case} (floor {result.floor_us:.0f} us)"
        for i, m in enumerate(result.measurements):
            met = "-" if m.met is None else ("[green]yes[/]" if m.met else "[red]NO[/]")
            table.add_row(label if i == 0 else "", m.impl, fmt(m.time_us, ".1f"), fmt(m.tflops, ".0f"),
                          fmt(m.weight_gbps, ".0f"), fmt(m.floor_ratio, ".2f"),
                          "n/a" if m.speedup is None else f"{m.speedup:.2f}x", m.target, met, m.note)
        table.add_section()
    return table


# Inputs -------------------------------------------------------------------------------------------------------
@dataclass
class FfnBenchInputs:
    """One case's inputs, expert-major and compact (expert e's rows are [e x rows, (e + 1) x rows)), and the
    natural (pre-transform) weights."""

    x: torch.Tensor             # e4m3 [E x rows, H]
    x_sf: torch.Tensor          # f32 [E x rows, H/128]
    topk_weights: torch.Tensor  # f32 [E x rows]
    w1: torch.Tensor            # e4m3 [E, 2I, H], gate rows [0, I), up rows [I, 2I)
    w1_sf: torch.Tensor         # f32 [E, 2I/128, H/128]
    w2: torch.Tensor            # e4m3 [E, H, I]
    w2_sf: torch.Tensor         # f32 [E, H/128, I/128]


def ffn_random_weights(num_experts: int, hidden: int, intermediate: int, *, generator: torch.Generator,
                       device: torch.device | str, chunk: int = 8) -> tuple[tuple[torch.Tensor, torch.Tensor],
                                                                           tuple[torch.Tensor, torch.Tensor]]:
    """Natural weights as `reference.random_case` makes them (w1 ~ N(0, 1/H), w2 ~ N(0, 1/I), per 128x128
    block cast), drawn `chunk` experts at a time to bound the fp32 temporaries."""
    import math

    from megamoe import quant

    def draw(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        q = torch.empty(num_experts, n, k, dtype=torch.uint8, device=device)
        sf = torch.empty(num_experts, n // 128, k // 128, dtype=torch.float32, device=device)
        for start in range(0, num_experts, chunk):
            stop = min(num_experts, start + chunk)
            w = torch.randn(stop - start, n, k, generator=generator, device=device) / math.sqrt(k)
            wq, wsf = quant.per_block_cast_to_fp8(w)
            q[start:stop] = wq.view(torch.uint8)
            sf[start:stop] = wsf
            del w, wq, wsf
        return q.view(torch.float8_e4m3fn), sf

    return draw(2 * intermediate, hidden), draw(hidden, intermediate)


def ffn_random_inputs(case: FfnBenchCase, weights: tuple | None = None, *, seed: int = 0,
                      device: torch.device | str = "cuda") -> FfnBenchInputs:
    """Fresh random inputs for `case`: x ~ N(0, 1) cast per 1x128, top-k weights in [0.05, 0.35), and the weights
    (drawn here unless given: the cases share one set)."""
    from megamoe import quant

    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    if weights is None:
        weights = ffn_random_weights(case.num_experts, case.hidden, case.intermediate, generator=generator,
                                     device=device)
    (w1, w1_sf), (w2, w2_sf) = weights
    n = case.num_experts * case.rows
    x, x_sf = quant.per_token_cast_to_fp8(torch.randn(n, case.hidden, generator=generator, device=device))
    topk_weights = torch.rand(n, generator=generator, device=device) * 0.3 + 0.05
    return FfnBenchInputs(x, x_sf, topk_weights, w1, w1_sf, w2, w2_sf)


def ffn_pool_rows(case: FfnBenchCase, device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 [E x rows]: the pool row of each compact row (expert e at pool_offsets[e], padded to BLOCK_M)."""
    offsets = case.config.pool_offsets(case.counts)
    return torch.cat([torch.arange(o, o + case.rows, device=device) for o in offsets])


def ffn_pool_inputs(case: FfnBenchCase, inputs: FfnBenchInputs) -> Any:
    """The unit kernel's inputs (expert_ffn.FfnInputs): the compact rows scattered into the pool (padding rows
    zero, their SF 1, weight 0: the kernel writes zeros for them and they are never compared), transformed w1."""
    from megamoe.kernels import expert_ffn
    from megamoe.weights import transform_weights

    device = inputs.x.device
    config = case.config
    num_rows = config.num_pool_rows(case.counts)
    rows = ffn_pool_rows(case, device)
    l1_acts = torch.zeros(num_rows, case.hidden, dtype=torch.uint8, device=device)
    l1_acts[rows] = inputs.x.view(torch.uint8)
    l1_acts_sf = torch.ones(case.hidden // 128, num_rows, dtype=torch.float32, device=device)
    l1_acts_sf[:, rows] = inputs.x_sf.t()
    topk_weights = torch.zeros(num_rows, dtype=torch.float32, device=device)
    topk_weights[rows] = inputs.topk_weights
    (w1, w1_sf), (w2, w2_sf) = transform_weights((inputs.w1, inputs.w1_sf), (inputs.w2, inputs.w2_sf))
    return expert_ffn.FfnInputs(l1_acts.view(torch.float8_e4m3fn), l1_acts_sf, topk_weights, w1,
                                w1_sf.contiguous(), w2.contiguous(), w2_sf.contiguous(),
                                torch.tensor(case.counts, dtype=torch.int32, device=device))


def ffn_reference_expert(case: FfnBenchCase, inputs: FfnBenchInputs, expert: int = 0) -> torch.Tensor:
    """BF16 [rows, H]: the exact reference (DESIGN section 4, `reference`) of one expert's rows."""
    from megamoe import reference as ref

    rows = slice(expert * case.rows, (expert + 1) * case.rows)
    src = torch.empty(0, 3, dtype=torch.int64, device=inputs.x.device)
    inter = ref._expert_forward(src, inputs.x[rows], inputs.x_sf[rows], inputs.topk_weights[rows],
                                inputs.w1[expert], inputs.w1_sf[expert], inputs.w2[expert], inputs.w2_sf[expert],
                                None, case.config.fast_math)
    return inter.out


# The cuBLAS baseline -------------------------------------------------------------------------------------------
def quantize_groups_capturable(v: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`quant.requant_per64` (group 64) or `quant.per_token_cast_to_fp8` (group 128) of a float [M, K], bit for
    bit, in ops a CUDA graph can capture: quant's 448 is a 0-dim tensor made with `new_tensor` (a host-to-device
    copy, refused during capture); here it is a filled tensor, the same IEEE divisions."""
    from megamoe import quant

    grouped = v.float().unflatten(-1, (v.shape[-1] // group, group))
    a = torch.clamp_min(grouped.abs().amax(dim=-1), quant.SF_EPS)
    fp8_max = torch.full_like(a, quant.FP8_MAX)
    sf, inv = torch.div(a, fp8_max), torch.div(fp8_max, a)
    q = torch.clamp(grouped * inv.unsqueeze(-1), -quant.FP8_MAX, quant.FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), sf


class UnfusedCublas:
    """The recipe of DESIGN section 4 unfused: per expert, L1 `torch._scaled_mm` with blockwise scales (1x128 for
    A, 128x128 for B) into fp32 (`out_dtype`; BF16 where cuBLAS refuses fp32), then over all rows at once in torch:
    SwiGLU x top-k weight in fp32 (`reference.swiglu`), the per-64 requant (the contract's exact formula,
    `quantize_groups_capturable`); then per expert the L2 `_scaled_mm`, and the BF16 cast.

    cuBLAS blockwise scales A per 1x128 only. per64 (faithful): each 128-K block of the L2 activations holds two
    64-column groups with their own SF, so the two are stacked as 2 x rows zero-padded rows (stack h keeps the
    columns [128b + 64h, 128b + 64h + 64) of every block b, zeros elsewhere, with SF[2b + h] as its 1x128 scale):
    one `_scaled_mm` per expert of 2 x rows rows, whose two halves are summed in fp32 — exactly the per-64
    promotion, at twice the L2 MMA work (the weights are read once). The zeros are written once, at setup.
    per64=False: requant per 128 columns instead (`per_token_cast_to_fp8`: another recipe, the approximation) and
    one plain `_scaled_mm` with BF16 output. `scaled_mm` replaces `torch._scaled_mm` (CPU tests)."""

    def __init__(self, inputs: FfnBenchInputs, num_experts: int, rows: int, *, out_dtype: torch.dtype,
                 per64: bool = True, fast_math: bool = True, scaled_mm: Callable[..., Any] | None = None) -> None:
        e, c = num_experts, rows
        h, i = inputs.x.shape[1], inputs.w2.shape[2]
        dev = inputs.x.device
        self.num_experts, self.rows, self.hidden, self.intermediate = e, c, h, i
        self.out_dtype, self.per64, self.fast_math = out_dtype, per64, fast_math
        self.scaled_mm = scaled_mm or torch._scaled_mm
        self.inputs = inputs
        self.topk_weights = inputs.topk_weights
        x_sf_t = inputs.x_sf.view(e, c, h // 128).transpose(1, 2).contiguous()  # [E, H/128, rows]
        # (A, B, scale_a (M, K/128) M-major, scale_b (K/128, N/128)) of each expert's L1
        self.l1_args = [(inputs.x[r * c:(r + 1) * c], inputs.w1[r].t(), x_sf_t[r].t(), inputs.w1_sf[r].t())
                        for r in range(e)]
        self.l1_out = torch.empty(e, c, 2 * i, dtype=out_dtype, device=dev)
        self.out = torch.empty(e, c, h, dtype=torch.bfloat16, device=dev)
        if per64:
            self.l2_a = torch.zeros(e, 2, c, i, dtype=torch.uint8, device=dev)  # the zero halves stay zero
            self.l2_sf = torch.empty(e, i // 128, 2, c, dtype=torch.float32, device=dev)
            self.l2_out = torch.empty(e, 2, c, h, dtype=out_dtype, device=dev)
            # per-expert (K/128, N/128) views must have stride (1, round_up(K/128, 4)): w2_sf[e].t() has (1, I/128)
            self.l2_args = [(self.l2_a[r].view(2 * c, i).view(torch.float8_e4m3fn), inputs.w2[r].t(),
                             self.l2_sf[r].view(i // 128, 2 * c).t(), inputs.w2_sf[r].t()) for r in range(e)]

    def _l1(self) -> torch.Tensor:
        for r, (a, b, scale_a, scale_b) in enumerate(self.l1_args):
            self.scaled_mm(a, b, scale_a, scale_b, out_dtype=self.out_dtype, out=self.l1_out[r])
        return self.l1_out.view(self.num_experts * self.rows, 2 * self.intermediate)

    def run(self) -> torch.Tensor:
        """One pass; returns the BF16 output [E, rows, H] (a persistent buffer)."""
        from megamoe import reference as ref

        e, c, h, i = self.num_experts, self.rows, self.hidden, self.intermediate
        v = ref.swiglu(self._l1(), self.topk_weights, fast_math=self.fast_math)  # fp32 [E x rows, I]
        if not self.per64:
            q, sf = quantize_groups_capturable(v, 128)  # per 1x128: the approximation
            sf_t = sf.view(e, c, i // 128).transpose(1, 2).contiguous()
            q = q.view(e, c, i)
            w2, w2_sf = self.inputs.w2, self.inputs.w2_sf
            for r in range(e):
                self.scaled_mm(q[r], w2[r].t(), sf_t[r].t(), w2_sf[r].t(), out_dtype=torch.bfloat16,
                               out=self.out[r])
            return self.out
        q, sf = quantize_groups_capturable(v, 64)
        # stack half g of row (e, t): columns [128b + 64g, +64) of block b, scale sf[(e, t), 2b + g]
        dst = self.l2_a.view(e, 2, c, i // 128, 2, 64)
        src = q.view(torch.uint8).view(e, c, i // 128, 2, 64)
        for g in range(2):
            dst[:, g, :, :, g].copy_(src[:, :, :, g])
        self.l2_sf.copy_(sf.view(e, c, i // 128, 2).permute(0, 2, 3, 1))
        for r, (a, b, scale_a, scale_b) in enumerate(self.l2_args):
            self.scaled_mm(a, b, scale_a, scale_b, out_dtype=self.out_dtype, out=self.l2_out[r].view(2 * c, h))
        self.out.copy_(self.l2_out[:, 0].float() + self.l2_out[:, 1].float())  # fp32 sum, one RNE cast
        return self.out


# The run ------------------------------------------------------------------------------------------------------
def _first_line(exc: BaseException, limit: int = 100) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:limit]}"


def _time_graphed(fn: Callable[[], Any], *, warmup: int, iters: int) -> tuple[float, str]:
    """(median us, note): fn CUDA-graphed; if the capture fails, fn eager (its note says so: launch overhead
    included)."""
    try:
        replay = graphed(fn)
    except Exception as exc:
        torch.cuda.synchronize()
        return time_us(fn, warmup=warmup, iters=iters), f"EAGER (graph capture failed: {_first_line(exc, 80)})"
    return time_us(replay, warmup=warmup, iters=iters), ""


def _verified_baseline(case: FfnBenchCase, inputs: FfnBenchInputs, reference: torch.Tensor, *, per64: bool,
                       tolerance: float) -> tuple[UnfusedCublas | None, float | None, list[str]]:
    """The cuBLAS pipeline with fp32 GEMM outputs, else BF16 ones, whichever first runs and matches the
    reference on expert 0 within `tolerance`: (pipeline or None, its rel-L2, what failed)."""
    from megamoe import reference as ref

    failures = []
    for dtype in (torch.float32, torch.bfloat16):
        name = "fp32" if dtype == torch.float32 else "bf16"
        try:
            pipeline = UnfusedCublas(inputs, case.num_experts, case.rows, out_dtype=dtype, per64=per64,
                                     fast_math=case.config.fast_math)
            out = pipeline.run()
            torch.cuda.synchronize()
            error = ref.rel_l2(out[0].float(), reference.float())
        except Exception as exc:  # a recipe this torch / cuBLAS build lacks is reported, not fatal
            failures.append(f"{name} out: {_first_line(exc)}")
            continue
        if error < tolerance:
            return pipeline, error, failures
        failures.append(f"{name} out: rel-L2 {error:.2e} vs reference (expert 0)")
        del pipeline
    return None, None, failures


def bench_ffn_case(case: FfnBenchCase, inputs: FfnBenchInputs, *, warmup: int = 5, iters: int = 30,
                   seed: int = 0) -> FfnCaseResult:
    """One case: the reference of expert 0, the baselines and ours run once and checked, then each timed."""
    import math

    from megamoe import reference as ref
    from megamoe.kernels import expert_ffn as ef

    result = FfnCaseResult.of(case, device=torch.cuda.get_device_name(), warmup=warmup, iters=iters, seed=seed)
    config, tol = case.config, FFN_TOLERANCE_REL_L2
    reference = ffn_reference_expert(case, inputs)

    # Baselines: built, run once and checked against the reference before any timing
    baseline, base_err, base_fail = _verified_baseline(case, inputs, reference, per64=True, tolerance=tol)
    approx, approx_err, approx_fail = _verified_baseline(case, inputs, reference, per64=False,
                                                         tolerance=FFN_APPROX_TOLERANCE_REL_L2)

    # Ours: one eager launch into poisoned outputs, checked against the reference and the baseline
    pool = ffn_pool_inputs(case, inputs)
    rows = ffn_pool_rows(case, pool.l1_acts.device)
    outputs = ef.new_outputs(config, pool.num_pool_rows, pool.l1_acts.device)
    ef.run(config, pool, outputs)
    torch.cuda.synchronize()
    ours = outputs.out[rows].view(case.num_experts, case.rows, case.hidden)
    ours_err = ref.rel_l2(ours[0].float(), reference.float())
    agree = None if baseline is None else ref.rel_l2(ours.float(), baseline.out.float())
    ours_ok = math.isfinite(ours_err) and ours_err < tol and (agree is None or agree < tol)

    # Timing: each implementation on its own, CUDA-graphed
    base_us = approx_us = ours_us = None
    base_how = approx_how = ours_how = ""
    if baseline is not None:
        base_us, base_how = _time_graphed(baseline.run, warmup=warmup, iters=iters)
    if approx is not None:
        approx_us, approx_how = _time_graphed(approx.run, warmup=warmup, iters=iters)

    def launch() -> None:
        outputs.l1_done_count.zero_()  # the L1 -> L2 counters start at zero (a memset node in the graph)
        ef.run(config, pool, outputs)

    after = None
    if ours_ok:
        ours_us, ours_how = _time_graphed(launch, warmup=warmup, iters=iters)
        torch.cuda.synchronize()
        if baseline is not None:  # the last timed runs' outputs still agree
            after = ref.rel_l2(outputs.out[rows].view_as(ours).float(), baseline.out.float())

    def joined(*parts: str) -> str:
        return "; ".join(p for p in parts if p)

    dtype_name = (lambda p: "fp32" if p.out_dtype == torch.float32 else "BF16")
    if baseline is not None:
        note = joined(base_how, f"L1 and L2 _scaled_mm out {dtype_name(baseline)}; L2 per-64 as 2 zero-padded "
                      f"64-column stacks in one call per expert, summed in fp32; rel-L2 vs reference (expert 0) "
                      f"{base_err:.2e}", *base_fail)
    else:
        note = "not timed: " + joined(*base_fail)
    result.add("cuBLAS unfused: _scaled_mm per expert + torch SwiGLU/requant (graphed)", base_us, note,
               baseline_us=base_us)
    if approx is not None:
        note = joined(approx_how, f"APPROXIMATION (another recipe): requant and L2 A scales per 128; L1 out "
                      f"{dtype_name(approx)}, L2 out BF16; rel-L2 vs reference (expert 0) {approx_err:.2e}",
                      *approx_fail)
    else:
        note = "not timed: " + joined(*approx_fail)
    result.add("cuBLAS unfused, L2 per-128 approx. (graphed)", approx_us, note, baseline_us=base_us)
    note = joined(ours_how, f"BLOCK_M {config.block_m}, fast math; rel-L2 vs cuBLAS "
                  + ("n/a" if agree is None else f"{agree:.2e}")
                  + ("" if after is None else f" (after timing {after:.2e})")
                  + f", vs reference (expert 0) {ours_err:.2e}")
    if approx_us is not None and ours_us is not None:
        note += f"; {approx_us / ours_us:.2f}x vs the per-128 approx."
    if not ours_ok:
        note = f"NOT TIMED (beyond rel-L2 {tol:g}): " + note
    result.add("megamoe expert_ffn unit kernel (graphed, counters zeroed in the graph)", ours_us, note,
               baseline_us=base_us, target=case.target)
    return result


def bench_ffn(cases: Sequence[FfnBenchCase] = FFN_CASES, *, warmup: int = 5, iters: int = 30, seed: int = 0,
              device: str = "cuda") -> list[FfnCaseResult]:
    """Every case on one GPU: the same weights for all cases (drawn once), fresh random tokens per case."""
    import sys

    if not cases:
        raise ValueError("no ffn cases")
    if warmup < 1 or iters < 1:
        raise ValueError(f"warmup and iters must be >= 1, got {warmup} and {iters}")
    shapes = {(c.num_experts, c.hidden, c.intermediate) for c in cases}
    generator = torch.Generator(device=device)
    generator.manual_seed(seed + 1_000_003)
    weights = None
    if len(shapes) == 1:
        e, h, i = next(iter(shapes))
        weights = ffn_random_weights(e, h, i, generator=generator, device=device)
    results = []
    for index, case in enumerate(cases):
        started = time.perf_counter()
        inputs = ffn_random_inputs(case, weights, seed=seed + 7919 * index, device=device)
        results.append(bench_ffn_case(case, inputs, warmup=warmup, iters=iters, seed=seed))
        del inputs
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        print(f"megamoe bench ffn: {case.name} done in {time.perf_counter() - started:.1f} s", file=sys.stderr,
              flush=True)
    return results


# ---------------------------------------------------------------------------------------------------------------
# Dispatch -> combine over NVLink (comm): one process per GPU
# ---------------------------------------------------------------------------------------------------------------
# NOTES: the NCCL baseline and our kernel never run at the same time: each is a phase of its own, between
# torch.cuda.synchronize() and a CPU (gloo) barrier on every rank. Our persistent cooperative kernel holds every SM
# while it waits for its peers; an NCCL kernel queued behind it on one GPU while a peer waits for that NCCL kernel
# would never finish.
NVLINK_COPY_GBPS = 360.0  # measured NVLink copy between two H200s, per direction (README "Benchmarks", issue)
COMM_BANDWIDTH_TARGET_GBPS = 290.0  # 80% of the copy
COMM_TOKENS = (8, 128, 4096)  # tokens per rank
COMM_LATENCY_TOKENS = 128  # the round-trip latency target applies here
COMM_BANDWIDTH_TOKENS = 4096  # the bandwidth target applies here
MAX_SLEEP_US = 200_000.0  # time_queued_us: the longest sleep it queues ahead of the timed runs
GPU_CYCLES_PER_US = 2000  # torch.cuda._sleep spins in SM cycles; the H200 clocks at most 1.98 GHz: errs long
COMM_FORMULA = (
    "rows = the mean over ranks of the (token, slot) pairs whose expert lives on another rank; dispatch remote "
    "bytes = rows x (H FP8 + H/128 x 4 B SF + 4 B weight), combine remote bytes = rows x 2H (BF16), per direction; "
    "GB/s per direction = (dispatch remote bytes + combine remote bytes) / round trip. Round trip: the slowest "
    "rank's median over {iters} iterations after {warmup} warm-up, CUDA events, {ranks} ranks (one process per "
    "GPU). NCCL rows carry 4 B more (the expert id), not counted."
)


@dataclass(frozen=True)
class CommShape:
    name: str
    hidden: int
    num_topk: int
    num_experts: int
    intermediate: int  # sizes the buffer's L2 regions only (the unit kernel has no GEMM)
    latency_target_us: float  # round trip at COMM_LATENCY_TOKENS tokens per rank


COMM_SHAPES = (
    CommShape("H4096 topk6 E256", 4096, 6, 256, 2048, 40.0),
    CommShape("H7168 topk8 E384", 7168, 8, 384, 2048, 60.0),
)


@dataclass(frozen=True)
class CommTarget:
    max_round_trip_us: float | None = None
    min_gbps: float | None = None

    def describe(self) -> str:
        parts = ([f"< {self.max_round_trip_us:g} us"] if self.max_round_trip_us is not None else []) + \
                ([f">= {self.min_gbps:g} GB/s"] if self.min_gbps is not None else [])
        return ", ".join(parts) or "-"

    def met(self, round_trip_us: float | None, gbps: float | None) -> bool | None:
        if round_trip_us is None:
            return None
        ok = True
        if self.max_round_trip_us is not None:
            ok &= round_trip_us < self.max_round_trip_us
        if self.min_gbps is not None:
            ok &= gbps is not None and gbps >= self.min_gbps
        return ok


@dataclass(frozen=True)
class CommCase:
    shape: CommShape
    tokens: int  # per rank; also the buffer's num_max_tokens_per_rank

    @property
    def name(self) -> str:
        return f"{self.shape.name} T={self.tokens}"

    @property
    def target(self) -> CommTarget | None:
        if self.tokens == COMM_LATENCY_TOKENS:
            return CommTarget(max_round_trip_us=self.shape.latency_target_us)
        if self.tokens == COMM_BANDWIDTH_TOKENS:
            return CommTarget(min_gbps=COMM_BANDWIDTH_TARGET_GBPS)
        return None

    def layout(self, num_ranks: int) -> Any:
        from megamoe.layout import SymmLayout

        s = self.shape
        return SymmLayout.create(num_ranks, s.num_experts, self.tokens, s.num_topk, s.hidden, s.intermediate)


def comm_cases(tokens: Sequence[int] = COMM_TOKENS, shapes: Sequence[CommShape] = COMM_SHAPES) -> list[CommCase]:
    return [CommCase(shape, t) for shape in shapes for t in tokens]


def parse_int_list(text: str) -> list[int]:
    """"8,128,4096" -> [8, 128, 4096] (the CLI's list arguments)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise ValueError(f"expected comma-separated integers, got {text!r}")
    return values


def check_comm_options(tokens: Sequence[int], warmup: int, iters: int) -> None:
    if not tokens or any(isinstance(t, bool) or not isinstance(t, int) or t <= 0 for t in tokens):
        raise ValueError(f"tokens must be positive integers, got {list(tokens)}")
    if len(set(tokens)) != len(tokens):
        raise ValueError(f"tokens must be distinct, got {list(tokens)}")
    if warmup < 1:
        raise ValueError(f"warmup must be >= 1, got {warmup}")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")


def comm_num_ranks(device_count: int, shapes: Sequence[CommShape] = COMM_SHAPES) -> int:
    """The rank count of `megamoe bench comm`: every visible GPU, at least 2, at most kMaxRanks, dividing E."""
    from megamoe.layout import MAX_RANKS

    if device_count < 2:
        raise SystemExit(f"megamoe bench comm needs at least 2 GPUs (one rank per GPU over NVLink), got "
                         f"{device_count}; run it where 2 or more GPUs are visible (CUDA_VISIBLE_DEVICES)")
    if device_count > MAX_RANKS:
        raise SystemExit(f"megamoe bench comm supports at most {MAX_RANKS} ranks (one NVLink domain), found "
                         f"{device_count} GPUs; set CUDA_VISIBLE_DEVICES to {MAX_RANKS} or fewer")
    bad = [s.name for s in shapes if s.num_experts % device_count]
    if bad:
        raise SystemExit(f"megamoe bench comm: {device_count} GPUs do not divide the experts of {bad}; use 2, 4 or "
                         f"8 GPUs (CUDA_VISIBLE_DEVICES)")
    return device_count


def comm_block_m(case: CommCase, num_ranks: int) -> int:
    """BLOCK_M of the launch: the buffer's own (heuristics.select_config, as SymmBuffer.config())."""
    from megamoe import heuristics

    s = case.shape
    return heuristics.select_config(num_ranks, s.num_experts, case.tokens, s.num_topk, s.hidden,
                                    s.intermediate).block_m


# The unit-kernel variants timed side by side, in table order: (record key, knob preset name, table label).
# Presets are dispatch_combine's: "legacy" = LEGACY_KNOBS (the first version), "default" = the config's field
# defaults (the predicted fastest; the targets are judged on it), "fused_pull" = FUSED_PULL_KNOBS (2 pulling warps
# per CTA with 4 rows in flight, as the fused kernel will have).
COMM_VARIANTS = (
    ("ours_legacy", "legacy", "megamoe unit kernel, previous config (legacy knobs)"),
    ("ours", "default", "megamoe unit kernel (dispatch + expert + combine)"),
    ("ours_fused_pull", "fused_pull", "megamoe unit kernel, 2 pull warps x 4 rows (fused kernel's pull)"),
)


def comm_variant_knobs(preset: str) -> dict[str, Any]:
    from megamoe.kernels import dispatch_combine as dc

    return {"legacy": dc.LEGACY_KNOBS, "default": {}, "fused_pull": dc.FUSED_PULL_KNOBS}[preset]


def comm_kernel_configs(num_ranks: int, tokens: Sequence[int] = COMM_TOKENS,
                        shapes: Sequence[CommShape] = COMM_SHAPES) -> list[tuple[CommCase, Any]]:
    """(case, DispatchCombineConfig) of every unit-kernel variant `megamoe bench comm` launches on num_ranks
    (every case x every COMM_VARIANTS knob preset)."""
    from megamoe.kernels import dispatch_combine as dc

    return [(case, dc.DispatchCombineConfig(case.layout(num_ranks), comm_block_m(case, num_ranks),
                                            **comm_variant_knobs(preset)))
            for case in comm_cases(tokens, shapes) for _, preset, _ in COMM_VARIANTS]


def precompile_comm(ranks: Sequence[int] = (2, 4, 8), tokens: Sequence[int] = COMM_TOKENS,
                    shapes: Sequence[CommShape] = COMM_SHAPES, console: Console | None = None) -> list[Any]:
    """Compile every variant the comm bench launches on each rank count into the JIT cache (no GPU needed)."""
    from megamoe.jit import checks
    from megamoe.kernels import dispatch_combine as dc

    table = Table(title="megamoe bench comm: unit kernel variants")
    for col in ("ranks", "case", "kernel", "cache", "compile checks"):
        table.add_column(col, overflow="fold")
    compiled = []
    for num_ranks in ranks:
        for case, config in comm_kernel_configs(comm_num_ranks(num_ranks, shapes), tokens, shapes):
            result = dc.compile_kernel(config)
            compiled.append(result)
            found = checks.violations(result)
            table.add_row(str(num_ranks), case.name, config.name,
                          "hit" if result.cache_hit else f"compiled {result.compile_seconds:.1f} s",
                          "[red]" + "; ".join(found) + "[/]" if found else "pass")
    if console is not None:
        console.print(table)
    return compiled


# Byte accounting ------------------------------------------------------------------------------------------------
def dispatch_row_bytes(hidden: int) -> int:
    """Bytes dispatch moves per remote (token, slot): the FP8 row, its SF (one float per 128), the top-k weight."""
    return hidden + hidden // 128 * 4 + 4


def combine_row_bytes(hidden: int) -> int:
    """Bytes combine moves per remote (token, slot): the expert's BF16 row."""
    return 2 * hidden


def count_remote_rows(topk_idx: torch.Tensor, rank: int, num_local_experts: int) -> int:
    """This rank's (token, slot) pairs whose expert lives on another rank (-1 slots are not sent)."""
    valid = topk_idx >= 0
    return int((valid & (topk_idx.div(num_local_experts, rounding_mode="floor") != rank)).sum())


def expected_remote_rows(tokens: int, num_topk: int, num_ranks: int) -> float:
    """Uniform routing: a slot's expert is remote with probability (R - 1) / R."""
    return tokens * num_topk * (num_ranks - 1) / num_ranks


def remote_bytes_per_direction(total_remote_rows: int | float, num_ranks: int, hidden: int) -> tuple[float, float]:
    """(dispatch, combine) remote bytes per rank and direction, from the remote rows summed over all ranks. Every
    remote row leaves one rank and enters another, so the mean over ranks is the same for what a rank sends and
    what it receives: dispatch pulls it in, combine pushes it back."""
    rows = total_remote_rows / num_ranks
    return rows * dispatch_row_bytes(hidden), rows * combine_row_bytes(hidden)


def gbps_per_direction(dispatch_bytes: float, combine_bytes: float, round_trip_us: float | None) -> float | None:
    if round_trip_us is None or round_trip_us <= 0:
        return None
    return (dispatch_bytes + combine_bytes) / round_trip_us / 1e3


# Results --------------------------------------------------------------------------------------------------------
@dataclass
class CommMeasurement:
    impl: str
    round_trip_us: float | None  # the slowest rank's median
    gbps: float | None
    per_rank_us: list[float | None] = field(default_factory=list)
    dispatch_us: float | None = None
    combine_us: float | None = None
    target: str = "-"
    met: bool | None = None
    note: str = ""


@dataclass
class CommCaseResult:
    case: str
    num_ranks: int
    tokens_per_rank: int
    hidden: int
    num_topk: int
    num_experts: int
    remote_rows: float  # per rank (mean)
    dispatch_bytes: float  # remote, per rank and direction
    combine_bytes: float
    target: CommTarget | None = None
    device: str = ""
    warmup: int = 0
    iters: int = 0
    measurements: list[CommMeasurement] = field(default_factory=list)

    @property
    def remote_bytes(self) -> float:
        return self.dispatch_bytes + self.combine_bytes

    def add(self, impl: str, per_rank_us: Sequence[float | None], note: str = "", *,
            dispatch_us: float | None = None, combine_us: float | None = None,
            apply_target: bool = False) -> CommMeasurement:
        times = list(per_rank_us)
        round_trip = None if not times or any(t is None for t in times) else max(times)
        gbps = gbps_per_direction(self.dispatch_bytes, self.combine_bytes, round_trip)
        target = self.target if apply_target else None
        m = CommMeasurement(impl, round_trip, gbps, times, dispatch_us, combine_us,
                            target.describe() if target else "-", target.met(round_trip, gbps) if target else None,
                            note)
        self.measurements.append(m)
        return m


def _max(values: Sequence[float | None]) -> float | None:
    return None if any(v is None for v in values) or not values else max(values)  # type: ignore[type-var]


def assemble_comm_results(cases: Sequence[CommCase], records: Sequence[Sequence[dict]], num_ranks: int, *,
                          device: str = "", warmup: int = 0, iters: int = 0) -> list[CommCaseResult]:
    """The table's rows from every rank's records (records[rank][case index], as _comm_case_on_rank returns)."""
    if len(records) != num_ranks or any(len(r) != len(cases) for r in records):
        raise ValueError(f"expected {num_ranks} ranks x {len(cases)} cases of records, got "
                         f"{[len(r) for r in records]}")
    results = []
    for i, case in enumerate(cases):
        recs = [records[rank][i] for rank in range(num_ranks)]
        total_rows = sum(int(r["remote_rows"]) for r in recs)
        dispatch_bytes, combine_bytes = remote_bytes_per_direction(total_rows, num_ranks, case.shape.hidden)
        result = CommCaseResult(case.name, num_ranks, case.tokens, case.shape.hidden, case.shape.num_topk,
                                case.shape.num_experts, total_rows / num_ranks, dispatch_bytes, combine_bytes,
                                case.target, device, warmup, iters)
        eager = [r["nccl_eager"] for r in recs]
        d, c = _max([e["dispatch_us"] for e in eager]), _max([e["combine_us"] for e in eager])
        result.add("NCCL all_to_all_single, eager", [e["round_trip_us"] for e in eager],
                   "split sizes exchanged + host sync; " + ("" if d is None or c is None else
                                                           f"dispatch {d:.1f} / combine {c:.1f} us"),
                   dispatch_us=d, combine_us=c)
        graphed_runs = [r["nccl_graphed"] for r in recs]
        if all(g["graphed"] for g in graphed_runs):
            impl, note = "NCCL all_to_all_single, CUDA graph", "splits fixed at capture, count exchange kept"
        else:
            reason = next((g["note"] for g in graphed_runs if g["note"]), "")
            impl, note = "NCCL all_to_all_single, fixed splits", f"eager: graph capture failed ({reason})"
        if any(g.get("host_bound") for g in graphed_runs):
            note += "; host-bound"
        result.add(impl, [g["median_us"] for g in graphed_runs], note)
        for key, _, label in COMM_VARIANTS:  # the variants every rank timed (records without a key: not run)
            if not all(key in r for r in recs):
                continue
            ours = [r[key] for r in recs]
            note = (f"BLOCK_M {int(ours[0]['block_m'])}, mean {max(o['us_per_call'] for o in ours):.1f} us, "
                    f"host {max(o['host_us_per_call'] for o in ours):.0f} us/launch")
            if any(o.get("host_bound") for o in ours):
                note += "; host-bound (sleep too short)"
            result.add(label, [o["median_us"] for o in ours], note, apply_target=True)
        results.append(result)
    return results


def comm_formula(results: Sequence[CommCaseResult]) -> str:
    first = results[0] if results else CommCaseResult("", 0, 0, 0, 0, 0, 0, 0, 0)
    return COMM_FORMULA.format(iters=first.iters, warmup=first.warmup, ranks=first.num_ranks)


def comm_results_table(title: str, results: list[CommCaseResult]) -> Table:
    table = Table(title=title, caption=comm_formula(results))
    left = ("case", "implementation", "target", "note")
    for col in ("case", "implementation", "round trip (us)", "remote MB per direction", "GB/s per direction",
                f"% of {NVLINK_COPY_GBPS:g} GB/s", "target", "met?", "note"):
        table.add_column(col, justify="left" if col in left else "right")
    fmt = (lambda v, f: "n/a" if v is None else format(v, f))
    for result in results:
        for i, m in enumerate(result.measurements):
            met = "-" if m.met is None else ("[green]yes[/]" if m.met else "[red]NO[/]")
            table.add_row(result.case if i == 0 else "", m.impl, fmt(m.round_trip_us, ".1f"),
                          format(result.remote_bytes / 1e6, ".2f"), fmt(m.gbps, ".0f"),
                          fmt(None if m.gbps is None else 100 * m.gbps / NVLINK_COPY_GBPS, ".0f"), m.target, met,
                          m.note)
        table.add_section()
    return table


# Timing -----------------------------------------------------------------------------------------------------------
def time_stages_us(stages: Sequence[Callable[[Any], Any]], *, warmup: int = 5, iters: int = 30) -> list[float]:
    """[round trip, stage 0, stage 1, ...] medians (us). Stage i gets stage i - 1's return value (the first gets
    None). Each iteration has its own CUDA events and is waited for (for chains with host syncs inside)."""

    def chain(events: list[Any] | None) -> None:
        value = None
        for i, stage in enumerate(stages):
            if events:
                events[i].record()
            value = stage(value)
        if events:
            events[-1].record()

    for _ in range(warmup):
        chain(None)
    torch.cuda.synchronize()
    totals: list[float] = []
    per_stage: list[list[float]] = [[] for _ in stages]
    for _ in range(iters):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(stages) + 1)]
        chain(events)
        events[-1].synchronize()
        totals.append(events[0].elapsed_time(events[-1]) * 1e3)
        for i in range(len(stages)):
            per_stage[i].append(events[i].elapsed_time(events[i + 1]) * 1e3)
    return [statistics.median(totals)] + [statistics.median(t) for t in per_stage]


def time_queued_us(fn: Callable[[], Any], *, warmup: int = 5, iters: int = 30) -> dict[str, float]:
    """`iters` back-to-back runs of fn, each between its own CUDA events, enqueued behind a sleep kernel long
    enough for the host to enqueue them all: the intervals are GPU time, not launch overhead (collective kernels
    keep their ranks in step by themselves). Returns median/mean/min/max (us), the host's time per call, the sleep
    and host_bound = 1.0 when the host still fell behind (the numbers then include launch overhead)."""
    host = []
    for _ in range(warmup):
        wall = time.perf_counter()
        fn()
        host.append((time.perf_counter() - wall) * 1e6)
    torch.cuda.synchronize()
    # The median ignores the first call's module load / JIT; the cap keeps the ranks' sleeps (and so their start
    # skew, which a peer spends spinning in the kernel's barrier) far below MEGAMOE_TIMEOUT_S.
    sleep_us = min(1.5 * statistics.median(host) * (iters + 1) + 500.0, MAX_SLEEP_US)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    torch.cuda._sleep(int(sleep_us * GPU_CYCLES_PER_US))
    wall = time.perf_counter()
    for i in range(iters):
        events[i].record()
        fn()
    events[-1].record()
    enqueue_us = (time.perf_counter() - wall) * 1e6
    events[-1].synchronize()
    times = [events[i].elapsed_time(events[i + 1]) * 1e3 for i in range(iters)]
    return {"median_us": statistics.median(times), "mean_us": events[0].elapsed_time(events[-1]) * 1e3 / iters,
            "min_us": min(times), "max_us": max(times), "host_us_per_call": enqueue_us / iters,
            "sleep_us": sleep_us, "host_bound": float(enqueue_us > sleep_us)}


# The NCCL baseline ------------------------------------------------------------------------------------------------
class NcclRoundTrip:
    """dispatch: all_to_all_single of the per-destination row counts (the split sizes), then of every (token, slot)
    row grouped by destination rank: FP8 x, its SF, top-k weight and expert id (H + H/32 + 8 B); expert: FP8 ->
    BF16 of the received rows (stands in for the unit kernel's trivial expert); combine: all_to_all_single of the
    BF16 rows back and index_add into y [T, H]. Eager: the split sizes go to the host (.tolist(), a sync), as a
    real system's must; fixed=True: the splits of the first call are reused (capturable; the count exchange
    still runs)."""

    def __init__(self, x: torch.Tensor, x_sf: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 num_ranks: int, num_local_experts: int, group: Any) -> None:
        self.num_tokens, self.hidden = x.shape
        self.num_topk = topk_idx.shape[1]
        self.group = group
        self.x = x
        self.xpack = torch.cat([x.view(torch.uint8), x_sf.float().contiguous().view(torch.uint8)], dim=1)
        meta = torch.stack([topk_weights.float().contiguous().view(torch.int32), topk_idx.to(torch.int32)], dim=-1)
        self.meta = meta.reshape(-1, 2).contiguous().view(torch.uint8)  # [T * topk, 8]
        if bool((topk_idx < 0).any()):
            raise ValueError("the NCCL baseline takes routings without -1 slots")
        self.dest = topk_idx.reshape(-1).div(num_local_experts, rounding_mode="floor")
        self.ranks = torch.arange(num_ranks, device=x.device)
        self.row_bytes = self.xpack.shape[1] + self.meta.shape[1]
        self.splits: tuple[list[int], list[int]] | None = None

    def dispatch(self, fixed: bool = False) -> tuple:
        import torch.distributed as dist

        order = torch.argsort(self.dest, stable=True)
        send_counts = (self.dest[:, None] == self.ranks[None, :]).sum(dim=0)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        if fixed and self.splits is not None:
            in_splits, out_splits = self.splits
        else:
            in_splits, out_splits = send_counts.tolist(), recv_counts.tolist()
            self.splits = (in_splits, out_splits)
        send = torch.cat([self.xpack.index_select(0, order // self.num_topk), self.meta.index_select(0, order)],
                         dim=1)
        recv = torch.empty(sum(out_splits), self.row_bytes, dtype=torch.uint8, device=send.device)
        dist.all_to_all_single(recv, send, out_splits, in_splits, group=self.group)
        return order, recv, in_splits, out_splits

    def expert(self, state: tuple) -> tuple:
        order, recv, in_splits, out_splits = state
        return order, recv[:, : self.hidden].view(torch.float8_e4m3fn).to(torch.bfloat16), in_splits, out_splits

    def combine(self, state: tuple) -> torch.Tensor:
        import torch.distributed as dist

        order, out, in_splits, out_splits = state
        back = torch.empty(sum(in_splits), self.hidden, dtype=torch.bfloat16, device=out.device)
        dist.all_to_all_single(back, out, in_splits, out_splits, group=self.group)
        y = torch.zeros(self.num_tokens, self.hidden, dtype=torch.bfloat16, device=out.device)
        y.index_add_(0, order // self.num_topk, back)
        return y

    def stages(self, fixed: bool = False) -> list[Callable[[Any], Any]]:
        return [lambda _: self.dispatch(fixed), self.expert, self.combine]

    def round_trip(self, fixed: bool = False) -> torch.Tensor:
        return self.combine(self.expert(self.dispatch(fixed)))

    def check(self) -> str | None:
        """One eager round trip (fixes the splits); y must be topk x bf16(x) (every slot valid, exact in BF16)."""
        y = self.round_trip()
        expected = (self.x.to(torch.bfloat16).float() * self.num_topk).to(torch.bfloat16)
        if not torch.allclose(y.float(), expected.float(), rtol=1e-2, atol=1e-6):
            return f"y differs from topk x bf16(x) in {int((y != expected).sum())} of {y.numel()} values"
        return None


# One process per GPU -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CommPlan:
    cases: tuple[CommCase, ...]
    warmup: int
    iters: int
    seed: int = 0


def _phase_barrier(cpu_group: Any) -> None:
    """Everything this rank launched has finished, and so has every other rank's (before the next phase)."""
    import torch.distributed as dist

    torch.cuda.synchronize()
    if cpu_group is not None:
        dist.barrier(group=cpu_group)
    else:
        dist.barrier(device_ids=[torch.cuda.current_device()])
        torch.cuda.synchronize()


def _all_ranks(flag: bool, cpu_group: Any) -> bool:
    import torch.distributed as dist

    device = "cpu" if cpu_group is not None else "cuda"
    value = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=cpu_group)
    return bool(value.item())


def _comm_case_on_rank(case: CommCase, index: int, plan: CommPlan, rank: int, num_ranks: int, group: Any,
                       cpu_group: Any) -> dict:
    import megamoe
    from megamoe.kernels import dispatch_combine as dc

    shape, layout = case.shape, case.layout(num_ranks)
    counts = [case.tokens if r == rank else 0 for r in range(num_ranks)]  # only this rank's inputs are made
    mine = dc.random_inputs(layout, counts, "uniform", seed=plan.seed + 7919 * index + rank)[rank]
    record: dict[str, Any] = {"remote_rows": count_remote_rows(mine.topk_idx, rank, layout.num_local_experts)}

    buf = megamoe.get_symm_buffer(group, shape.num_experts, case.tokens, shape.num_topk, shape.hidden,
                                  shape.intermediate)
    dc.load_inputs(buf, mine)
    staged = [t.to(buf.device) for t in (mine.x, mine.x_sf, mine.topk_idx, mine.topk_weights)]
    baseline = NcclRoundTrip(*staged, num_ranks, layout.num_local_experts, group)
    error = baseline.check()
    if error:
        raise RuntimeError(f"rank {rank} {case.name}: NCCL baseline: {error}")
    _phase_barrier(cpu_group)

    # Phase 1: NCCL, eager (split sizes through the host)
    total, dispatch_us, _, combine_us = time_stages_us(baseline.stages(), warmup=plan.warmup, iters=plan.iters)
    record["nccl_eager"] = {"round_trip_us": total, "dispatch_us": dispatch_us, "combine_us": combine_us}
    _phase_barrier(cpu_group)

    # Phase 2: NCCL, fixed splits, CUDA graph where the capture works (every rank must agree), else eager
    note = ""
    try:
        replay: Callable[[], Any] | None = graphed(lambda: baseline.round_trip(fixed=True),
                                                   capture_error_mode="thread_local")
    except Exception as exc:
        replay, note = None, f"rank {rank}: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:100]}"
    torch.cuda.synchronize()
    captured = _all_ranks(replay is not None, cpu_group)
    if not captured:
        replay = lambda: baseline.round_trip(fixed=True)  # noqa: E731
        note = note or "failed on another rank"
    _phase_barrier(cpu_group)
    assert replay is not None
    record["nccl_graphed"] = {"graphed": captured, "note": note,
                              **time_queued_us(replay, warmup=plan.warmup, iters=plan.iters)}
    del replay
    _phase_barrier(cpu_group)

    # Phase 3: ours, every variant on the same buffer and inputs, each in a phase of its own
    for key, preset, _ in COMM_VARIANTS:
        record[key] = dc.bench_round_trip(buf, case.tokens, block_m=comm_block_m(case, num_ranks),
                                          knobs=comm_variant_knobs(preset), num_warmup=plan.warmup,
                                          num_iters=plan.iters)
        _phase_barrier(cpu_group)
    buf.destroy()
    del baseline, staged
    torch.cuda.empty_cache()
    return record


def _comm_worker(rank: int, num_ranks: int, port: int, plan: CommPlan, results: Any, backend: str = "nccl",
                 case_fn: Callable[..., dict] | None = None) -> None:
    """One rank: time every case (case_fn: _comm_case_on_rank), gather the records on rank 0, which assembles the
    results; report (rank, results or None, error or None) on `results` and leave. backend="gloo" and a fake
    case_fn run the harness on a CPU (tests)."""
    from megamoe.buffer import NO_MULTICAST_ENV

    os.environ.update(NO_MULTICAST_ENV)  # before any NCCL / symmetric-memory initialization (DESIGN 6)
    payload, error = None, None
    try:
        import sys

        import torch.distributed as dist

        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=num_ranks)
        group = dist.group.WORLD
        cpu_group: Any = group
        if backend == "nccl":
            import torch.distributed._symmetric_memory as symm_mem

            if hasattr(symm_mem, "enable_symm_mem_for_group"):  # required by older torch, a no-op since
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    symm_mem.enable_symm_mem_for_group(group.group_name)
            try:
                cpu_group = dist.new_group(backend="gloo")  # barriers and gathers that launch nothing on the GPU
            except Exception:
                cpu_group = None
        case_fn = case_fn or _comm_case_on_rank
        records = []
        for index, case in enumerate(plan.cases):
            started = time.perf_counter()
            records.append(case_fn(case, index, plan, rank, num_ranks, group, cpu_group))
            if rank == 0:
                print(f"megamoe bench comm: {case.name} done in {time.perf_counter() - started:.1f} s",
                      file=sys.stderr, flush=True)
        gathered: list | None = [None] * num_ranks if rank == 0 else None
        dist.gather_object(records, gathered, dst=0, group=cpu_group)
        if rank == 0:
            assert gathered is not None
            device = torch.cuda.get_device_name() if backend == "nccl" else "cpu"
            payload = assemble_comm_results(plan.cases, gathered, num_ranks, device=device, warmup=plan.warmup,
                                            iters=plan.iters)
    except BaseException:
        error = f"rank {rank} raised:\n{traceback.format_exc()}"
    # One report per rank, then leave without interpreter teardown (as the multigpu tests do)
    results.put((rank, payload, error))
    results.close()
    results.join_thread()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bench_comm(tokens: Sequence[int] = COMM_TOKENS, *, warmup: int = 10, iters: int = 50,
               shapes: Sequence[CommShape] = COMM_SHAPES, seed: int = 0,
               timeout_s: float = 480.0) -> list[CommCaseResult]:
    """Spawn one process per visible GPU; rank 0 gathers every rank's timings and returns the results."""
    from megamoe.buffer import NO_MULTICAST_ENV

    check_comm_options(tokens, warmup, iters)
    num_ranks = comm_num_ranks(torch.cuda.device_count(), shapes)
    plan = CommPlan(tuple(comm_cases(tokens, shapes)), warmup, iters, seed)
    precompile_comm([num_ranks], tokens, shapes)  # once here (cache hits when warmed), not in every rank at once
    os.environ.update(NO_MULTICAST_ENV)  # inherited by the spawned ranks too
    return spawn_comm_ranks(num_ranks, plan, timeout_s=timeout_s)


def spawn_comm_ranks(num_ranks: int, plan: CommPlan, *, backend: str = "nccl",
                     case_fn: Callable[..., dict] | None = None, timeout_s: float = 1200.0,
                     grace_s: float = 30.0) -> list[CommCaseResult]:
    """Run _comm_worker in num_ranks spawned processes; rank 0's assembled results. Raises RuntimeError with every
    rank's traceback when one fails; ranks still running grace_s after a failure (waiting in a collective for the
    failed one) are killed, as are all of them after timeout_s."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_comm_worker, args=(rank, num_ranks, port, plan, results, backend, case_fn),
                         daemon=True) for rank in range(num_ranks)]
    for proc in procs:
        proc.start()
    reports: dict[int, tuple[Any, str | None]] = {}
    problems: list[str] = []
    deadline, grace = time.monotonic() + timeout_s, None
    try:
        while len(reports) < num_ranks:
            try:
                rank, payload, error = results.get(timeout=1.0)
            except queue_module.Empty:
                now = time.monotonic()
                missing = sorted(set(range(num_ranks)) - reports.keys())
                dead = [r for r in missing if not procs[r].is_alive()]
                if dead:
                    problems.append(f"ranks {dead} exited (codes {[procs[r].exitcode for r in dead]}) without "
                                    f"reporting")
                    break
                if now > deadline:
                    problems.append(f"ranks {missing} did not report within {timeout_s:.0f} s (hang?); killed")
                    break
                if grace is not None and now > grace:
                    problems.append(f"ranks {missing} still running {grace_s:.0f} s after a failure (waiting in a "
                                    f"collective?); killed")
                    break
                continue
            reports[rank] = (payload, error)
            if error and grace is None:
                grace = time.monotonic() + grace_s
    finally:
        for proc in procs:
            proc.join(30 if len(reports) == num_ranks else 1)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
    problems = [err for _, (_, err) in sorted(reports.items()) if err] + problems
    if problems:
        raise RuntimeError("megamoe bench comm failed:\n" + "\n".join(problems))
    return reports[0][0]


BENCHES: dict[str, Callable[..., list]] = {"gemm": bench_gemm, "comm": bench_comm, "ffn": bench_ffn}


def main(name: str, json_path: str | None = None, **options: Any) -> list:
    """Run one bench (options: its keyword arguments), print its table, write its JSON."""
    if name not in BENCHES:
        raise ValueError(f"bench must be one of {sorted(BENCHES)}, got {name!r}")
    if not torch.cuda.is_available():
        raise SystemExit("megamoe bench needs a CUDA GPU")
    results = BENCHES[name](**options)
    console = Console()
    payload: dict[str, Any] = {"bench": name}
    if name == "comm":
        first = results[0]
        payload.update(device=f"{first.num_ranks} x {first.device}", num_ranks=first.num_ranks,
                       nvlink_copy_gbps=NVLINK_COPY_GBPS, formula=comm_formula(results))
        table = comm_results_table(f"megamoe bench comm on {payload['device']}", results)
    elif name == "ffn":
        payload.update(device=torch.cuda.get_device_name(), hbm_read_tbps=HBM_READ_TBPS, formula=ffn_formula(results))
        table = ffn_results_table(f"megamoe bench ffn on {payload['device']}", results)
    else:
        payload["device"] = torch.cuda.get_device_name()
        table = results_table(f"megamoe bench {name} on {payload['device']}", results)
    console.print(table)
    path = Path(json_path or f"megamoe-bench-{name}.json")
    payload["results"] = [asdict(r) for r in results]
    path.write_text(json.dumps(payload, indent=1))
    console.print(f"wrote {path}")
    return results
