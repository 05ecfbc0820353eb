"""`megamoe bench ffn`: the local expert FFN (the expert_ffn unit kernel) against the same recipe run unfused
through cuBLAS (`torch._scaled_mm` per expert, SwiGLU and the per-64 requant in torch), one GPU. Every timed output
is checked first against the exact reference; times are CUDA-graphed medians, set against the weight-read floor at
the measured HBM bandwidth. Timers and ceilings: megamoe.bench.timing; records and tables: megamoe.bench.results.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from rich.table import Table

from megamoe.bench.results import CaseResult, Measurement, first_line, fmt, fmt_met, results_table
from megamoe.bench.timing import HBM_READ_TBPS, graphed, time_us

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
    """Every expert receives the same `rows`. BLOCK_M from the heuristics' bucket for `rows`; fast math, no clamp
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
    FfnBenchCase("prefill 32x768", 32, 768, 4096, 2048, FfnTarget()),  # the T = 4096 per-rank load of 8 GPUs
    FfnBenchCase("prefill 32x1536", 32, 1536, 4096, 2048, FfnTarget()),
)


def ffn_kernel_configs(cases: Sequence[FfnBenchCase] = FFN_CASES) -> list[Any]:
    """The ExpertFfnConfig of every unit-kernel variant `megamoe bench ffn` launches (kernels/catalog.py lists
    them, so `megamoe jit warm` compiles them ahead)."""
    return list({case.config.name: case.config for case in cases}.values())


# Results ------------------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class FfnMeasurement(Measurement):
    floor_ratio: float | None  # time / weight-read floor
    speedup: float | None  # cuBLAS unfused (same recipe) time / this time
    target: str = "-"
    met: bool | None = None


@dataclass(kw_only=True)
class FfnCaseResult(CaseResult[FfnMeasurement]):
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

    @classmethod
    def of(cls, case: FfnBenchCase, **kwargs: Any) -> FfnCaseResult:
        return cls(case=case.name, num_experts=case.num_experts, rows_per_expert=case.rows, hidden=case.hidden,
                   intermediate=case.intermediate, block_m=case.block_m, flops=case.flops,
                   weight_bytes=float(case.weight_bytes), floor_us=case.floor_us, **kwargs)

    def add(self, impl: str, time_us: float | None, note: str = "", *, baseline_us: float | None = None,
            target: FfnTarget | None = None) -> FfnMeasurement:
        ok = time_us is not None and time_us > 0
        return self.record(FfnMeasurement(
            impl=impl, time_us=time_us, **Measurement.rates(time_us, self.flops, self.weight_bytes),
            floor_ratio=time_us / self.floor_us if ok else None,
            speedup=baseline_us / time_us if ok and baseline_us else None,
            target=target.describe(self.floor_us) if target else "-",
            met=target.met(time_us if ok else None, baseline_us, self.floor_us) if target else None,
            note=note))


def ffn_formula(results: Sequence[FfnCaseResult]) -> str:
    first = results[0] if results else None
    return FFN_FORMULA.format(hbm=HBM_READ_TBPS, iters=first.iters if first else 0,
                              warmup=first.warmup if first else 0, seed=first.seed if first else 0)


def _cells(m: FfnMeasurement) -> list[str]:
    return [m.impl, fmt(m.time_us, ".1f"), fmt(m.tflops, ".0f"), fmt(m.weight_gbps, ".0f"), fmt(m.floor_ratio, ".2f"),
            "n/a" if m.speedup is None else f"{m.speedup:.2f}x", m.target, fmt_met(m.met), m.note]


def ffn_results_table(title: str, results: list[FfnCaseResult]) -> Table:
    table = results_table(title, ("case", "implementation", "time (us)", "TFLOP/s", "weight GB/s", "x of weight floor",
                                  "speedup vs cuBLAS unfused", "target", "met?", "note"),
                          left=("case", "implementation", "target", "note"), caption=ffn_formula(results))
    for result in results:
        result.add_rows(table, _cells, label=f"{result.case} (floor {result.floor_us:.0f} us)")
    return table


def ffn_report(results: list[FfnCaseResult]) -> tuple[dict[str, Any], Table]:
    """The JSON's fields besides the results, and the table (megamoe.bench.main)."""
    device = torch.cuda.get_device_name()
    return ({"device": device, "hbm_read_tbps": HBM_READ_TBPS, "formula": ffn_formula(results)},
            ffn_results_table(f"megamoe bench ffn on {device}", results))


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
        # [E, H/128, rows]: the L1 activation SF, M-major per expert (a caller that refills inputs.x per pass
        # refills this too)
        self.x_sf_t = inputs.x_sf.view(e, c, h // 128).transpose(1, 2).contiguous()
        # (A, B, scale_a (M, K/128) M-major, scale_b (K/128, N/128)) of each expert's L1
        self.l1_args = [(inputs.x[r * c:(r + 1) * c], inputs.w1[r].t(), self.x_sf_t[r].t(), inputs.w1_sf[r].t())
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
def _time_graphed(fn: Callable[[], Any], *, warmup: int, iters: int) -> tuple[float, str]:
    """(median us, note): fn CUDA-graphed; if the capture fails, fn eager (its note says so: launch overhead
    included)."""
    try:
        replay = graphed(fn)
    except Exception as exc:
        torch.cuda.synchronize()
        return time_us(fn, warmup=warmup, iters=iters), f"EAGER (graph capture failed: {first_line(exc, 80)})"
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
            failures.append(f"{name} out: {first_line(exc)}")
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

