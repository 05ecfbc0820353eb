"""`megamoe bench fused`: the fused kernel on one GPU at the single-rank load of an 8-GPU DSV4-Flash deployment
(E 32 local experts, H 4096, I 2048, top-6), phase-serial and overlapped, beside the expert-FFN unit kernel on the
same pool rows, warm and after an L2 flush, against the weight-read floor of the experts the routing touches.

Routing of every case: top-k of randn(T, E) (seed s), weights the softmax of the chosen scores. Every case's output
is checked first against megamoe.reference.moe (y rel-L2), and the serial and overlapped outputs compared bit for
bit. Times: GPU time of back-to-back runs queued behind a sleep (bench.timing.time_queued_us), median of `iters`;
cold: each run after a 256 MB write (outside its interval); `rounds` rounds per case, each timing every
implementation warm and cold once in its own shuffled order (bench.timing.shuffled_rounds, the GEMM bench's method),
reported as the median over the rounds. Beside the fused kernel, in the same rounds:
- the expert-FFN unit kernel on the pool rows the fused call left (the GEMM work alone);
- the chain of our unit kernels: the dispatch/combine unit kernel (dispatch, its trivial expert, scatter, combine)
  then the expert-FFN unit kernel, two launches back to back (the fused kernel's work, unfused);
- the cuBLAS unfused pipeline on the routed rows (`RoutedCublas`: gather, the recipe per expert through
  `torch._scaled_mm`, the top-k combine in torch; CUDA-graphed), its y checked against the reference too.
`wave_fills`: the fused kernel's wave fill targets to time (heuristics.WAVE_FILL x the grid by default; 0 = one
wave of every expert)."""
from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from rich.console import Group
from rich.table import Table

from megamoe.bench.results import CaseResult, Measurement, fmt, fmt_met, results_table
from megamoe.bench.timing import HBM_READ_TBPS, l2_flusher, shuffled_rounds, time_queued_us


@dataclass(frozen=True)
class FusedShape:
    """One bench shape on one rank: E local experts, H, I, top-k, the T it times by default, the buffer's T_max."""
    num_experts: int
    hidden: int
    intermediate: int
    num_topk: int
    tokens: tuple[int, ...]
    max_tokens: int = 4096


FUSED_SHAPES = {
    # one rank of 8 serving DSV4-Flash (256 experts): the main targets
    "flash": FusedShape(32, 4096, 2048, 6, (8, 128, 1024, 4096)),
    # every DSV4-Flash expert on one GPU (the E = 256 target, at T = 128)
    "e256": FusedShape(256, 4096, 2048, 6, (128,)),
    # the Pro shape (reported, no target)
    "pro": FusedShape(48, 7168, 3072, 6, (8, 128, 4096)),
}
FUSED_SEEDS = (0, 1, 2)
# The pull staging's stages per dispatch warp timed beside the default (2, which leaves a fifth GEMM stage at
# BLOCK_M 128 and H 4096; issue: size the pull staging from the GEMM's stage count). At H 7168 (--shape pro) 2 pull
# stages leave 4 GEMM stages at BLOCK_M 128 and 1 leaves 5, so 1 is timed too.
PULL_STAGE_VARIANTS = (1, 4)
FUSED_MAX_Y_REL_L2 = 1e-2  # as the gpu tests (tests/test_fused_gpu.py: MAX_Y_REL_L2)
FUSED_FORMULA = (
    "floor = FP8 weight bytes of the experts touched (3 x H x I each) / {hbm:g} TB/s; x floor = time / floor; "
    "TFLOP/s = 6 x rows x H x I / time, rows = valid (token, slot) pairs; cold = after a 256 MB L2 flush. Times: "
    "median over {rounds} rounds (each times every implementation warm and cold once, in shuffled orders) of the "
    "median of {iters} queued runs after {warmup} warm-up (GPU time between CUDA events)."
)


class RoutedCublas:
    """The cuBLAS unfused pipeline on one routing: the (token, slot) rows gathered expert-major into a buffer padded
    to the largest expert's rows (rounded up to 16; padding rows are zeros with weight 0 and are dropped at the
    combine), bench.ffn.UnfusedCublas (per expert L1 `_scaled_mm`, SwiGLU x top-k weight, the per-64 requant, L2
    `_scaled_mm`), then the combine: an fp32 index_add over tokens, one BF16 cast. `run` is capturable.
    `scaled_mm` replaces `torch._scaled_mm` (CPU tests)."""

    def __init__(self, x: torch.Tensor, x_sf: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 natural: tuple, num_experts: int, *, out_dtype: torch.dtype,
                 scaled_mm: Any = None) -> None:
        from megamoe.bench.ffn import FfnBenchInputs, UnfusedCublas
        from megamoe.layout import ceil_div

        t, h = x.shape
        dev = x.device
        valid = topk_idx >= 0
        tokens = torch.arange(t, device=dev).unsqueeze(1).expand_as(topk_idx)[valid]
        experts, weights = topk_idx[valid].long(), topk_weights[valid]
        counts = torch.bincount(experts, minlength=num_experts)
        rows = max(16, ceil_div(int(counts.max()), 16) * 16) if experts.numel() else 16
        order = torch.argsort(experts, stable=True)
        starts = torch.cumsum(counts, 0) - counts
        slot_in_expert = torch.arange(order.numel(), device=dev) - starts[experts[order]]
        position = experts[order] * rows + slot_in_expert
        n = num_experts * rows
        self.num_tokens, self.hidden = t, h
        self.src_token = torch.full((n,), t, dtype=torch.long, device=dev)  # padding rows read row t (zeros)
        self.src_token[position] = tokens[order]
        self.x_ext = torch.cat([x.view(torch.uint8), torch.zeros(1, h, dtype=torch.uint8, device=dev)])
        self.x_sf_ext = torch.cat([x_sf, torch.ones(1, x_sf.shape[1], dtype=torch.float32, device=dev)])
        w_pad = torch.zeros(n, dtype=torch.float32, device=dev)
        w_pad[position] = weights[order].float()
        (w1, w1_sf), (w2, w2_sf) = natural
        self.inputs = FfnBenchInputs(torch.zeros(n, h, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn),
                                     torch.ones(n, h // 128, dtype=torch.float32, device=dev), w_pad,
                                     w1, w1_sf, w2, w2_sf)
        self.pipeline = UnfusedCublas(self.inputs, num_experts, rows, out_dtype=out_dtype, scaled_mm=scaled_mm)
        self.rows = rows
        self.y32 = torch.empty(t + 1, h, dtype=torch.float32, device=dev)
        self.y = torch.empty(t, h, dtype=torch.bfloat16, device=dev)

    def expert_rows(self) -> torch.Tensor:
        """The gather and the per-expert FFN: [E x rows, H] in the expert-major padded order (before the combine)."""
        e, c = self.pipeline.num_experts, self.rows
        torch.index_select(self.x_ext, 0, self.src_token, out=self.inputs.x.view(torch.uint8))
        sf = torch.index_select(self.x_sf_ext, 0, self.src_token)
        self.pipeline.x_sf_t.copy_(sf.view(e, c, -1).transpose(1, 2))
        return self.pipeline.run().view(e * c, self.hidden)

    def run(self) -> torch.Tensor:
        out = self.expert_rows()
        self.y32.zero_()
        self.y32.index_add_(0, self.src_token, out.float())
        self.y.copy_(self.y32[:self.num_tokens])
        return self.y


def verified_routed_cublas(x: torch.Tensor, x_sf: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                           natural: tuple, num_experts: int, y_ref: torch.Tensor,
                           tolerance: float) -> tuple[RoutedCublas | None, float | None, str]:
    """RoutedCublas with fp32 GEMM outputs, else BF16 ones, whichever first runs and matches y_ref within
    `tolerance`: (pipeline or None, its y rel-L2, what failed)."""
    from megamoe import reference
    from megamoe.bench.results import first_line

    failures = []
    for dtype in (torch.float32, torch.bfloat16):
        try:
            pipeline = RoutedCublas(x, x_sf, topk_idx, topk_weights, natural, num_experts, out_dtype=dtype)
            err = reference.rel_l2(pipeline.run().float(), y_ref.float())
        except Exception as exc:  # a recipe this torch / cuBLAS build lacks is reported, not fatal
            failures.append(f"{dtype}: {first_line(exc)}")
            continue
        if math.isfinite(err) and err <= tolerance:
            return pipeline, err, "; ".join(failures)
        failures.append(f"{dtype}: y rel-L2 {err:.2e}")
    return None, None, "; ".join(failures)


@dataclass(kw_only=True)
class FusedMeasurement(Measurement):
    cold: bool = False
    x_floor: float | None = None
    rounds_us: list[float] = field(default_factory=list)  # per-round medians (time_us: their median)


@dataclass(kw_only=True)
class FusedCaseResult(CaseResult[FusedMeasurement]):
    shape: str  # a key of FUSED_SHAPES
    tokens: int
    seed: int
    experts_touched: int
    max_rows: int
    rows: int
    floor_us: float
    block_m: int
    y_rel_l2: float
    serial_equals_overlapped: bool
    warmup: int
    iters: int
    cublas_y_rel_l2: float | None = None
    # --phases: (phase, earliest, latest mark in us after the kernel's start) of one overlapped call, warm L2
    phases: list[tuple[str, float, float]] | None = None
    # --phases: the same of the config for the call's load, where it is not the buffer's default
    fitted_phases: list[tuple[str, float, float]] | None = None


def routed_inputs(num_tokens: int, num_experts: int, num_topk: int, hidden: int, seed: int,
                  device: torch.device) -> tuple[torch.Tensor, ...]:
    """x (e4m3), x_sf, topk_idx, topk_weights of one case: top-k of randn(T, E), softmax weights."""
    from megamoe import quant

    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(num_tokens, num_experts, generator=gen)
    top = scores.topk(num_topk, dim=1)
    x, x_sf = quant.per_token_cast_to_fp8(torch.randn(num_tokens, hidden, generator=gen))
    return (x.to(device), x_sf.to(device), top.indices.to(device),
            torch.softmax(top.values, dim=1).to(torch.float32).to(device))


def load_routed_inputs(buf: Any, spec: FusedShape, num_tokens: int, seed: int,
                       device: torch.device) -> tuple[torch.Tensor, ...]:
    """routed_inputs of one case, copied into the buffer's first `num_tokens` input rows; returns them."""
    inputs = routed_inputs(num_tokens, spec.num_experts, spec.num_topk, spec.hidden, seed, device)
    for name, value in zip(("x", "x_sf", "topk_idx", "topk_weights"), inputs):
        getattr(buf, name)[:num_tokens].copy_(value)
    return inputs


def fused_kernel_configs(shape: str = "flash", tokens: Sequence[int] | None = None) -> list[Any]:
    """Every variant the bench launches (for --compile-only): the fused kernel both orders, the expert-FFN and the
    dispatch/combine unit kernels."""
    from megamoe.fused import config_for
    from megamoe.kernels.dispatch_combine import DispatchCombineConfig
    from megamoe.layout import SymmLayout

    spec = FUSED_SHAPES[shape]
    e, h, i = spec.num_experts, spec.hidden, spec.intermediate
    layout = SymmLayout.create(1, e, spec.max_tokens, spec.num_topk, h, i)
    fused = [config_for(layout, serial=serial) for serial in (True, False)]
    return fused + [unit_kernel_config(spec, fused[0].block_m),
                    DispatchCombineConfig(layout, fused[0].block_m, True)] + [
        config_for(layout, serial=False, pull_stages=p) for p in PULL_STAGE_VARIANTS] + [
        config_for(layout, expected_tokens_per_expert=expected_load(spec, t)) for t in tokens or spec.tokens]


def expected_load(shape: FusedShape, num_tokens: int) -> float:
    """The expected rows per expert of a call of `num_tokens` tokens per rank (what a serving framework that knows
    its batch size passes as `expected_tokens_per_expert`, the same on every rank)."""
    from megamoe import heuristics

    return heuristics.default_expected_tokens_per_expert(1, shape.num_experts, max(num_tokens, 1), shape.num_topk)


def precompile_fused(shape: str = "flash") -> None:
    from megamoe.fused import compile_fused
    from megamoe.kernels.dispatch_combine import DispatchCombineConfig
    from megamoe.kernels.dispatch_combine import compile_kernel as compile_dispatch_combine
    from megamoe.kernels.expert_ffn import ExpertFfnConfig, compile_expert_ffn

    for config in fused_kernel_configs(shape):
        if isinstance(config, ExpertFfnConfig):
            compile_expert_ffn(config)
        elif isinstance(config, DispatchCombineConfig):
            compile_dispatch_combine(config)
        else:
            compile_fused(config)


def unit_kernel_config(spec: FusedShape, block_m: int) -> Any:
    """The expert-FFN unit kernel the bench compares the fused kernel with: the shape's, the fused call's BLOCK_M."""
    from megamoe.kernels.expert_ffn import ExpertFfnConfig

    return ExpertFfnConfig(block_m, spec.hidden, spec.intermediate, spec.num_experts, fast_math=True)


def unit_kernel_runner(buf: Any, spec: FusedShape, block_m: int, counts: list[int], w: tuple) -> Callable[[], None]:
    """A launch of the expert-FFN unit kernel (unit_kernel_config) over the pool the fused call left in `buf` (same
    rows, the call's BLOCK_M), its completion counters zeroed first."""
    from megamoe.kernels import expert_ffn as ef

    config = unit_kernel_config(spec, block_m)

    rows = config.num_pool_rows(counts, spare_blocks=0)
    device = buf.device
    inputs = ef.FfnInputs(buf.view("l1_acts")[:rows].contiguous(), buf.view("l1_acts_sf")[:, :rows].contiguous(),
                          buf.view("l1_topk_weights")[:rows].contiguous(), w[0][0], w[0][1].contiguous(),
                          w[1][0].contiguous(), w[1][1].contiguous(),
                          torch.tensor(counts, dtype=torch.int32, device=device))
    outputs = ef.new_outputs(config, rows, device)

    def run() -> None:
        outputs.l1_done_count.zero_()
        ef.run(config, inputs, outputs)

    return run


def bench_setup(spec: FusedShape, dev: torch.device) -> tuple[tuple, Any, Any, Any, Any]:
    """The bench's fixed state for one shape: the natural weights (seed 12345), their kernel layout (l1, l2), a
    one-rank buffer for the shape's T_max, and the L2 flusher."""
    from megamoe import weights
    from megamoe.bench.ffn import ffn_random_weights
    from megamoe.buffer import allocate
    from megamoe.layout import SymmLayout

    e, h, i = spec.num_experts, spec.hidden, spec.intermediate
    natural = ffn_random_weights(e, h, i, generator=torch.Generator(device=dev).manual_seed(12345), device=dev)
    l1, l2 = weights.transform_weights(*natural)
    buf = allocate(None, SymmLayout.create(1, e, spec.max_tokens, spec.num_topk, h, i), dev)
    return natural, l1, l2, buf, l2_flusher(dev)


def bench_fused(tokens: Sequence[int] | None = None, seeds: Sequence[int] = FUSED_SEEDS, *, warmup: int = 3,
                iters: int = 20, rounds: int = 5, wave_fills: Sequence[int] | None = None, phases: bool = False,
                shape: str = "flash", device: str = "cuda") -> list[FusedCaseResult]:
    from megamoe import heuristics, reference
    from megamoe.bench.timing import graphed
    from megamoe.fused import config_for
    from megamoe.fused.launch import PHASES
    from megamoe.fused.launch import run as fused_run
    from megamoe.jit.diagnostics import PhaseTimes
    from megamoe.jit.runtime import num_sms as device_num_sms
    from megamoe.kernels import dispatch_combine as dc

    wave_fills = list(wave_fills or [heuristics.WAVE_FILL])

    dev = torch.device(device)
    spec = FUSED_SHAPES[shape]
    e, h, i = spec.num_experts, spec.hidden, spec.intermediate
    natural, l1, l2, buf, flush = bench_setup(spec, dev)
    expert_bytes = 3 * h * i
    results = []
    for t in tokens or spec.tokens:
        for seed in seeds:
            started = time.perf_counter()
            x, x_sf, idx, tw = load_routed_inputs(buf, spec, t, seed, dev)
            counts = torch.bincount(idx.flatten(), minlength=e).tolist()
            touched, rows = sum(c > 0 for c in counts), sum(counts)
            floor = touched * expert_bytes / (HBM_READ_TBPS * 1e6)
            y = {s: torch.full((t, h), float("nan"), dtype=torch.bfloat16, device=dev) for s in (True, False)}
            configs = {s: fused_run(y[s], l1, l2, buf, t, serial=s) for s in (True, False)}
            torch.cuda.synchronize()
            y_ref = reference.moe(x, x_sf, idx, tw, natural[0], natural[1], fast_math=True)
            err = reference.rel_l2(y[False].float(), y_ref.float())
            same = torch.equal(y[True].view(torch.int16), y[False].view(torch.int16))
            result = FusedCaseResult(case=f"T {t} seed {seed}", shape=shape, tokens=t, seed=seed,
                                     experts_touched=touched,
                                     max_rows=max(counts), rows=rows, floor_us=floor,
                                     block_m=configs[False].block_m, y_rel_l2=err, serial_equals_overlapped=same,
                                     warmup=warmup, iters=iters)
            fitted = config_for(buf.layout, expected_tokens_per_expert=expected_load(spec, t))
            if phases:
                def marks(**kwargs: Any) -> list[tuple[str, float, float]]:
                    for _ in range(3):  # warm: the marks of the last of three calls
                        timer = PhaseTimes(PHASES, dev)
                        fused_run(y[False], l1, l2, buf, t, serial=False, phase_times=timer, **kwargs)
                    torch.cuda.synchronize()
                    return timer.ends_us()

                result.phases = marks()
                if fitted != configs[False]:
                    result.fitted_phases = marks(expected_tokens_per_expert=expected_load(spec, t))
            flops = 6.0 * rows * h * i
            unit_kernel = unit_kernel_runner(buf, spec, configs[False].block_m, counts, (l1, l2))

            y_dc = torch.empty(t, h, dtype=torch.bfloat16, device=dev)

            def chain() -> None:
                dc.run(buf, t, y_dc, block_m=configs[False].block_m, check_inputs=False)
                unit_kernel()

            grid = device_num_sms(dev)
            runners = {}
            for fill in wave_fills:
                label = "" if fill == heuristics.WAVE_FILL and len(wave_fills) == 1 else (
                    ", one wave" if fill == 0 else f", waves >= {fill} x grid L1 tiles")
                tiles = heuristics.min_wave_l1_tiles_for(grid, fill)
                runners[f"fused, overlapped{label}"] = (
                    lambda tiles=tiles: fused_run(y[False], l1, l2, buf, t, serial=False, min_wave_l1_tiles=tiles))
            for p in PULL_STAGE_VARIANTS:
                stages = config_for(configs[False].layout, pull_stages=p).num_stages
                runners[f"fused, overlapped, {p} pull stage{'s' * (p > 1)} ({stages} GEMM stages)"] = (
                    lambda p=p: fused_run(y[False], l1, l2, buf, t, serial=False, pull_stages=p))
            # The variant of the call's own load (BLOCK_M, GEMM stages), where it is not the buffer's default
            if fitted != configs[False]:
                runners[f"fused, overlapped, config for the call's load (BLOCK_M {fitted.block_m}, "
                        f"{fitted.num_stages} stages)"] = (
                    lambda: fused_run(y[False], l1, l2, buf, t, expected_tokens_per_expert=expected_load(spec, t)))
            runners["fused, phase-serial"] = lambda: fused_run(y[True], l1, l2, buf, t, serial=True)
            runners["expert-FFN unit kernel, same rows (+ counter memset)"] = unit_kernel
            runners["chain: dispatch/combine unit kernel + expert-FFN unit kernel"] = chain
            cublas, cublas_err, cublas_note = verified_routed_cublas(x, x_sf, idx, tw, natural, e, y_ref,
                                                                     FUSED_MAX_Y_REL_L2)
            result.cublas_y_rel_l2 = cublas_err
            cublas_name = "cuBLAS unfused pipeline (gather, _scaled_mm per expert, torch combine; graphed)"
            if cublas is not None:
                runners[cublas_name] = graphed(cublas.run)
            ok = math.isfinite(err) and err <= FUSED_MAX_Y_REL_L2
            # Every fused runner's output is the overlapped default's, bit for bit (the waves and the pull staging
            # change the order of the work, never a result)
            mismatched = set()
            for name, fn in runners.items():
                if name.startswith("fused") and name != "fused, phase-serial":
                    reference_y = y[False].clone()
                    y[False].fill_(float("nan"))
                    fn()
                    torch.cuda.synchronize()
                    if not torch.equal(y[False].view(torch.int16), reference_y.view(torch.int16)):
                        mismatched.add(name)
                    y[False].copy_(reference_y)
            if cublas is None:
                for cold in (False, True):
                    result.record(FusedMeasurement(impl=cublas_name, time_us=None, cold=cold,
                                                   note=f"NOT TIMED: {cublas_note}"))
            # Timed in rounds (shuffled_rounds): each round times every runner warm and cold once, in its own
            # order, so that the GPU's power state (which the heavier runners move) hits all of them alike
            timers = {(name, cold): (lambda fn=fn, cold=cold: time_queued_us(
                          fn, warmup=warmup, iters=iters, before=flush if cold else None))
                      for name, fn in runners.items() for cold in (False, True)} if ok else {}
            timed = shuffled_rounds(timers, rounds=rounds)
            for name in runners:
                for cold in (False, True):
                    note = "" if ok else f"NOT TIMED: y rel-L2 {err:.2e} > {FUSED_MAX_Y_REL_L2:g}"
                    if name in mismatched:
                        note = "y DIFFERS from the default overlapped call's"
                    us, rounds_us = None, []
                    if ok:
                        rounds_us = [t["median_us"] for t in timed[name, cold]]
                        us = statistics.median(rounds_us)
                        note = "; ".join(filter(None, (note, f"rounds {min(rounds_us):.1f}..{max(rounds_us):.1f}")))
                        if any(t["host_bound"] for t in timed[name, cold]):
                            note = "; ".join(filter(None, (note, "host-bound: includes launch overhead")))
                    result.record(FusedMeasurement(impl=name, time_us=us, cold=cold, note=note, rounds_us=rounds_us,
                                                   x_floor=None if us is None else us / floor,
                                                   **Measurement.rates(us, flops, touched * expert_bytes)))
            results.append(result)
            print(f"megamoe bench fused: {result.case} done in {time.perf_counter() - started:.1f} s",
                  file=sys.stderr, flush=True)
    return results


# Issue 15's targets (one H200, cold L2, the median over the seeds of one run): (shape, T) -> the checks, each
# (name, the per-seed value's key in call_values, the goal as text, the test of the seeds' median).
PEER_SINGLE_RANK_US = {("flash", 8): 173.5, ("flash", 128): 240.1, ("flash", 1024): 518.2, ("flash", 4096): 1627.8,
                       ("e256", 128): 1566.9}  # DeepGEMM's SM90 MegaMoE, its own benchmark, one rank of an H200
FUSED_TARGETS: dict[tuple[str, int], list[tuple[str, str, str, Callable[[float], bool]]]] = {
    ("flash", 8): [("x floor", "x_floor", "<= 1.12", lambda v: v <= 1.12),
                   ("us", "us", "< the peer's 173.5", lambda v: v < PEER_SINGLE_RANK_US["flash", 8])],
    ("flash", 128): [("x floor", "x_floor", "<= 1.20", lambda v: v <= 1.20),
                     ("us - unit kernel", "over_unit_us", "<= 10", lambda v: v <= 10.0)],
    ("flash", 1024): [("us", "us", "<= 450", lambda v: v <= 450.0)],
    ("flash", 4096): [("TFLOP/s", "tflops", ">= 950", lambda v: v >= 950.0),
                      ("unit kernel / fused", "unit_ratio", ">= 0.9", lambda v: v >= 0.9)],
    ("e256", 128): [("x floor", "x_floor", "<= 1.08", lambda v: v <= 1.08),
                    ("us", "us", "< the peer's 1566.9", lambda v: v < PEER_SINGLE_RANK_US["e256", 128])],
}


def call_values(result: FusedCaseResult) -> dict[str, float] | None:
    """The cold numbers the targets judge, of the fused call with the config for the call's load (the default where
    that is the same config): time, x floor, TFLOP/s, and against the expert-FFN unit kernel in the same rounds."""
    cold = [m for m in result.measurements if m.cold and m.time_us is not None]
    fitted = [m for m in cold if m.impl.startswith("fused, overlapped, config for the call's load")]
    default = [m for m in cold if m.impl == "fused, overlapped"]
    unit = [m for m in cold if m.impl.startswith("expert-FFN unit kernel")]
    call = (fitted or default or [None])[0]
    if call is None or not unit:
        return None
    unit_us = unit[0].time_us
    return {"us": call.time_us, "x_floor": call.x_floor, "tflops": call.tflops, "unit_us": unit_us,
            "over_unit_us": call.time_us - unit_us, "unit_ratio": unit_us / call.time_us}


def fused_targets(results: list[FusedCaseResult]) -> list[dict[str, Any]]:
    """Issue 15's targets judged on one run: per (shape, T) with a target, the median over its seeds."""
    targets: list[dict[str, Any]] = []
    for (shape, tokens), checks in FUSED_TARGETS.items():
        values = [v for r in results if (r.shape, r.tokens) == (shape, tokens) for v in [call_values(r)] if v]
        if not values:
            continue
        for name, key, goal, test in checks:
            value = statistics.median(v[key] for v in values)
            targets.append({"target": f"{shape} T {tokens} {name}", "value": value, "goal": goal, "met": test(value),
                            "seeds": len(values)})
    return targets


def targets_text(targets: list[dict[str, Any]], markup: bool = True) -> str:
    """Each target's seed median and whether it is met (rich markup, or plain text for a note)."""
    def met(t: dict[str, Any]) -> str:
        return fmt_met(t["met"]) if markup else ("yes" if t["met"] else "NO")
    return "; ".join(f"{t['target']} {t['value']:.4g} ({t['goal']}: {met(t)})" for t in targets)


def targets_caption(targets: list[dict[str, Any]], device: str) -> str:
    """The table's line of targets (the targets assume an H200)."""
    machine = "" if "H200" in device else f" (judged on {device}: the targets assume an H200)"
    return f"issue 15 targets, cold, median over the seeds{machine}: {targets_text(targets)}"


def fused_report(results: list[FusedCaseResult]) -> tuple[dict[str, Any], Table]:
    shape = results[0].shape if results else "flash"
    spec = FUSED_SHAPES[shape]
    e, h, i, k = spec.num_experts, spec.hidden, spec.intermediate, spec.num_topk
    iters = results[0].iters if results else 0
    warmup = results[0].warmup if results else 0
    rounds = max((len(m.rounds_us) for r in results for m in r.measurements), default=0)
    caption = FUSED_FORMULA.format(hbm=HBM_READ_TBPS, iters=iters, warmup=warmup, rounds=rounds)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    table = results_table(f"megamoe bench fused --shape {shape}: E {e} H {h} I {i} top-{k}, one GPU ({device})",
                          ["case", "experts / max rows / rows", "floor us",
                           "y rel-L2 fused / cuBLAS, serial == overlapped", "implementation", "L2", "us", "x floor",
                           "TFLOP/s", "note"],
                          left=["case", "implementation", "note"], caption=caption)
    for r in results:
        info = [f"{r.experts_touched} / {r.max_rows} / {r.rows}", f"{r.floor_us:.1f}",
                f"{r.y_rel_l2:.2e} / {fmt(r.cublas_y_rel_l2, '.2e')}, "
                f"{'yes' if r.serial_equals_overlapped else 'NO'}"]
        for j, m in enumerate(r.measurements):
            table.add_row(r.case if j == 0 else "", *(info if j == 0 else ["", "", ""]), m.impl,
                          "cold" if m.cold else "warm", fmt(m.time_us, ".1f"), fmt(m.x_floor, ".2f"),
                          fmt(m.tflops, ".0f"), m.note)
        table.add_section()
    targets = fused_targets(results)
    if targets:
        table.caption = f"{caption}\n{targets_caption(targets, device)}"
    phases = phases_table(results)
    fields = {"shape": {"name": shape, "experts": e, "hidden": h, "intermediate": i, "topk": k}, "formula": caption,
              "device": device, "targets": targets}
    return fields, (table if phases is None else Group(table, phases))


PHASE_CAPTION = (
    "us after the kernel's start, earliest / latest mark over the CTAs (one overlapped call, warm L2): head = count + "
    "notify + NVLink barrier + receive table; pull = a dispatch warp's pulls done (latest: the last pool block "
    "arrived); L1 / L2 start = a tile's A load issued once its input was ready (earliest L1: the first L1 tile; "
    "latest L2: the last L2 tile); l2_done = a CTA's scatter warp sent and signalled its last L2 tile (earliest to "
    "latest: how evenly the CTAs finish); reduce = a CTA's math warps done (tiles and top-k reduce); end = a CTA's "
    "every warp done (no barrier at the end of a call: the next call cleans)"
)


def phases_table(results: list[FusedCaseResult]) -> Table | None:
    """The --phases table: one row per case, earliest / latest mark per phase (None without phases)."""
    timed = [r for r in results if r.phases]
    if not timed:
        return None
    names = [name for name, _, _ in timed[0].phases][1:]
    table = results_table("megamoe bench fused --phases", ["case", *names, "first L1 before last arrival"],
                          left=["case"], caption=PHASE_CAPTION)
    for r in timed:
        for label, phases in ((r.case, r.phases), (f"{r.case}, call's config", r.fitted_phases)):
            if phases is None:
                continue
            marks = {name: (lo, hi) for name, lo, hi in phases}
            overlapped = marks["l1_start"][0] < marks["pull"][1]
            table.add_row(label, *(f"{marks[n][0]:.1f} / {marks[n][1]:.1f}" for n in names),
                          "yes" if overlapped else "no")
    return table
