"""`megamoe bench fused`: the fused kernel on one GPU at the single-rank load of an 8-GPU DSV4-Flash deployment
(E 32 local experts, H 4096, I 2048, top-6), phase-serial and overlapped, beside the expert-FFN unit kernel on the
same pool rows, warm and after an L2 flush, against the weight-read floor of the experts the routing touches.

Routing of every case: top-k of randn(T, E) (seed s), weights the softmax of the chosen scores. Every case's output
is checked first against megamoe.reference.moe (y rel-L2), and the serial and overlapped outputs compared bit for
bit. Times: GPU time of back-to-back runs queued behind a sleep (bench.timing.time_queued_us), median of `iters`;
cold: each run after a 256 MB write (outside its interval). Not yet here: the chain of unit kernels and the cuBLAS
unfused pipeline on routed rows (issue part 1's bench list)."""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from rich.table import Table

from megamoe.bench.results import CaseResult, Measurement, fmt, results_table
from megamoe.bench.timing import HBM_READ_TBPS, l2_flusher, time_queued_us

FUSED_SHAPE = (32, 4096, 2048, 6)  # E local, H, I, top-k
FUSED_MAX_TOKENS = 4096
FUSED_TOKENS = (8, 128, 1024, 4096)
FUSED_SEEDS = (0, 1, 2)
FUSED_MAX_Y_REL_L2 = 1e-2  # as the gpu tests (tests/test_fused_gpu.py: MAX_Y_REL_L2)
FUSED_FORMULA = (
    "floor = FP8 weight bytes of the experts touched (3 x H x I each) / {hbm:g} TB/s; x floor = time / floor; "
    "TFLOP/s = 6 x rows x H x I / time, rows = valid (token, slot) pairs; cold = after a 256 MB L2 flush. Times: "
    "median of {iters} queued runs after {warmup} warm-up (GPU time between CUDA events)."
)


@dataclass(kw_only=True)
class FusedMeasurement(Measurement):
    cold: bool = False
    x_floor: float | None = None


@dataclass(kw_only=True)
class FusedCaseResult(CaseResult[FusedMeasurement]):
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


def fused_kernel_configs(tokens: Sequence[int] = FUSED_TOKENS) -> list[Any]:
    """Every variant the bench launches (for --compile-only): the fused kernel both orders, the unit kernel."""
    from megamoe.fused import config_for
    from megamoe.kernels.expert_ffn import ExpertFfnConfig
    from megamoe.layout import SymmLayout

    e, h, i, k = FUSED_SHAPE
    layout = SymmLayout.create(1, e, FUSED_MAX_TOKENS, k, h, i)
    fused = [config_for(layout, serial=s) for s in (True, False)]
    return fused + [ExpertFfnConfig(fused[0].block_m, h, i, e, fast_math=True)]


def precompile_fused(console: Any = None) -> None:
    from megamoe.fused import compile_fused
    from megamoe.kernels.expert_ffn import ExpertFfnConfig, compile_expert_ffn

    for config in fused_kernel_configs():
        (compile_expert_ffn if isinstance(config, ExpertFfnConfig) else compile_fused)(config)


def _unit_kernel_pool(buf: Any, config: Any, counts: list[int], w: tuple) -> tuple[Any, Any]:
    """The expert-FFN unit kernel's inputs over the pool the fused call left in `buf` (same rows, same BLOCK_M)."""
    from megamoe.kernels import expert_ffn as ef

    rows = config.num_pool_rows(counts, spare_blocks=0)
    device = buf.device
    inputs = ef.FfnInputs(buf.view("l1_acts")[:rows].contiguous(), buf.view("l1_acts_sf")[:, :rows].contiguous(),
                          buf.view("l1_topk_weights")[:rows].contiguous(), w[0][0], w[0][1].contiguous(),
                          w[1][0].contiguous(), w[1][1].contiguous(),
                          torch.tensor(counts, dtype=torch.int32, device=device))
    return inputs, ef.new_outputs(config, rows, device)


def bench_fused(tokens: Sequence[int] = FUSED_TOKENS, seeds: Sequence[int] = FUSED_SEEDS, *, warmup: int = 5,
                iters: int = 30, device: str = "cuda") -> list[FusedCaseResult]:
    from megamoe import reference, weights
    from megamoe.bench.ffn import ffn_random_weights
    from megamoe.buffer import allocate
    from megamoe.fused.launch import run as fused_run
    from megamoe.kernels import expert_ffn as ef
    from megamoe.layout import SymmLayout

    dev = torch.device(device)
    e, h, i, k = FUSED_SHAPE
    natural = ffn_random_weights(e, h, i, generator=torch.Generator(device=dev).manual_seed(12345), device=dev)
    l1, l2 = weights.transform_weights(*natural)
    buf = allocate(None, SymmLayout.create(1, e, FUSED_MAX_TOKENS, k, h, i), dev)
    flush = l2_flusher(dev)
    expert_bytes = 3 * h * i
    results = []
    for t in tokens:
        for seed in seeds:
            started = time.perf_counter()
            x, x_sf, idx, tw = routed_inputs(t, e, k, h, seed, dev)
            for name, value in (("x", x), ("x_sf", x_sf), ("topk_idx", idx), ("topk_weights", tw)):
                getattr(buf, name)[:t].copy_(value)
            counts = torch.bincount(idx.flatten(), minlength=e).tolist()
            touched, rows = sum(c > 0 for c in counts), sum(counts)
            floor = touched * expert_bytes / (HBM_READ_TBPS * 1e6)
            y = {s: torch.full((t, h), float("nan"), dtype=torch.bfloat16, device=dev) for s in (True, False)}
            configs = {s: fused_run(y[s], l1, l2, buf, t, serial=s) for s in (True, False)}
            torch.cuda.synchronize()
            y_ref = reference.moe(x, x_sf, idx, tw, natural[0], natural[1], fast_math=True)
            err = reference.rel_l2(y[False].float(), y_ref.float())
            same = torch.equal(y[True].view(torch.int16), y[False].view(torch.int16))
            result = FusedCaseResult(case=f"T {t} seed {seed}", tokens=t, seed=seed, experts_touched=touched,
                                     max_rows=max(counts), rows=rows, floor_us=floor,
                                     block_m=configs[False].block_m, y_rel_l2=err, serial_equals_overlapped=same,
                                     warmup=warmup, iters=iters)
            flops = 6.0 * rows * h * i
            ffn_config = ef.ExpertFfnConfig(configs[False].block_m, h, i, e, fast_math=True)
            pool, outputs = _unit_kernel_pool(buf, ffn_config, counts, (l1, l2))

            def unit_kernel() -> None:
                outputs.l1_done_count.zero_()
                ef.run(ffn_config, pool, outputs)

            runners = {"fused, overlapped": lambda: fused_run(y[False], l1, l2, buf, t, serial=False),
                       "fused, phase-serial": lambda: fused_run(y[True], l1, l2, buf, t, serial=True),
                       "expert-FFN unit kernel, same rows (+ counter memset)": unit_kernel}
            ok = math.isfinite(err) and err <= FUSED_MAX_Y_REL_L2
            for name, fn in runners.items():
                for cold in (False, True):
                    note = "" if ok else f"NOT TIMED: y rel-L2 {err:.2e} > {FUSED_MAX_Y_REL_L2:g}"
                    us = None
                    if ok:
                        timed = time_queued_us(fn, warmup=warmup, iters=iters, before=flush if cold else None)
                        us = timed["median_us"]
                        if timed["host_bound"]:
                            note = "host-bound: includes launch overhead"
                    result.record(FusedMeasurement(impl=name, time_us=us, cold=cold, note=note,
                                                   x_floor=None if us is None else us / floor,
                                                   **Measurement.rates(us, flops, touched * expert_bytes)))
            results.append(result)
            print(f"megamoe bench fused: {result.case} done in {time.perf_counter() - started:.1f} s",
                  file=sys.stderr, flush=True)
    return results


def fused_report(results: list[FusedCaseResult]) -> tuple[dict[str, Any], Table]:
    e, h, i, k = FUSED_SHAPE
    iters = results[0].iters if results else 0
    warmup = results[0].warmup if results else 0
    caption = FUSED_FORMULA.format(hbm=HBM_READ_TBPS, iters=iters, warmup=warmup)
    table = results_table(f"megamoe bench fused: E {e} H {h} I {i} top-{k}, one GPU ({torch.cuda.get_device_name()})",
                          ["case", "experts / max rows / rows", "floor us", "y rel-L2, serial == overlapped",
                           "implementation", "L2", "us", "x floor", "TFLOP/s", "note"],
                          left=["case", "implementation", "note"], caption=caption)
    for r in results:
        info = [f"{r.experts_touched} / {r.max_rows} / {r.rows}", f"{r.floor_us:.1f}",
                f"{r.y_rel_l2:.2e}, {'yes' if r.serial_equals_overlapped else 'NO'}"]
        for j, m in enumerate(r.measurements):
            table.add_row(r.case if j == 0 else "", *(info if j == 0 else ["", "", ""]), m.impl,
                          "cold" if m.cold else "warm", fmt(m.time_us, ".1f"), fmt(m.x_floor, ".2f"),
                          fmt(m.tflops, ".0f"), m.note)
        table.add_section()
    return {"shape": {"experts": e, "hidden": h, "intermediate": i, "topk": k}, "formula": caption}, table
