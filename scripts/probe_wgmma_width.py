"""How the WGMMA tile width and the promotion scheme alone set the FP8 rate on the H200 (issue: GEMM at prefill).

No TMA, no pipeline: both math warpgroups of every CTA (132 CTAs, 384 threads as in the GEMM kernel) run K blocks of
4 x wgmma m64nNk32 on operands resident in shared memory (random e4m3 bytes, so the tensor cores switch as with real
data), promoted as the GEMM consumer does:
  none  accumulate in the WGMMA accumulator (no promotion: the tensor pipe's bound for this width)
  one   one partial: issue, wait, promote (acc += d * scale)
  two   two partials: block b runs while block b - 1's partial is promoted (gemm/consumer.cuh, L1 mode)
  one64 as one, per 64-K half with its own scale (L2 mode's per-64 activation SF: twice the promotions)
  two64 as two, per 64-K half: half h runs while half h - 1 is promoted (gemm/consumer.cuh, L2 mode)
Each variant runs back to back for `--seconds` (after 1 s of warm-up) while nvidia-smi samples power and the SM
clock; the burst rate is one launch after a 1 s idle gap. The GEMM's rate under the power cap is bounded by these.

Usage: PYTHONPATH=python python3 scripts/probe_wgmma_width.py [--seconds 3] [--compile-only]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime

from rich.console import Console
from rich.table import Table

from megamoe.jit import compiler, runtime


@dataclass(frozen=True)
class Variant:
    n: int
    promote: str  # none | one | two | one64 | two64

    @property
    def name(self) -> str:
        return f"megamoe_probe_wgmma_n{self.n}_{self.promote}"

    @property
    def accum_regs(self) -> int:
        per = self.n // 2
        return per * {"none": 1, "one": 2, "two": 3, "one64": 2, "two64": 3}[self.promote]


VARIANTS = (Variant(128, "none"), Variant(128, "one"), Variant(128, "two"),
            Variant(192, "none"), Variant(192, "one"), Variant(256, "none"), Variant(128, "one64"),
            Variant(128, "two64"))
NUM_CTAS = 132
K_STEPS = 4  # wgmma k32 steps per 128-K block


def _source(v: Variant) -> str:
    regs = v.n // 2
    placeholders = "{" + ", ".join(f"%{i}" for i in range(regs)) + "}"
    operands = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    return f"""
#include "common/wgmma.cuh"
using namespace megamoe;

template <bool kAccumulate>
__device__ __forceinline__ void mma(uint64_t desc_a, uint64_t desc_b, float (&d)[{regs}]) {{
    asm volatile("wgmma.mma_async.sync.aligned.m64n{v.n}k32.f32.e4m3.e4m3 {placeholders}, %{regs}, %{regs + 1}, "
                 "%{regs + 2}, 1, 1;\\n"
                 : {operands}
                 : "l"(desc_a), "l"(desc_b), "n"(kAccumulate ? 1 : 0));
}}

// K steps [kFirst, kFirst + kSteps) of a 128-K block into d (the first overwrites d unless kKeep), one group
template <bool kKeep, uint32_t kFirst = 0, uint32_t kSteps = {K_STEPS}>
__device__ __forceinline__ void issue(uint64_t desc_a, uint64_t desc_b, float (&d)[{regs}]) {{
    ptx::wgmma_fence();
    #pragma unroll
    for (uint32_t k = kFirst; k < kFirst + kSteps; ++ k) {{
        const uint64_t a = ptx::advance_smem_desc(desc_a, k * 32), b = ptx::advance_smem_desc(desc_b, k * 32);
        if (k == kFirst and not kKeep) mma<false>(a, b, d); else mma<true>(a, b, d);
    }}
    ptx::wgmma_commit_group();
}}

__device__ __forceinline__ void promote(float (&acc)[{regs}], const float (&d)[{regs}], float s) {{
    #pragma unroll
    for (uint32_t i = 0; i < {regs}; ++ i) acc[i] = fmaf(d[i], s, acc[i]);
}}

// As the GEMM consumer promotes: a thread's accumulators hold two rows (r, r + 8), each with its own scale
__device__ __forceinline__ void promote_rows(float (&acc)[{regs}], const float (&d)[{regs}], float s0, float s1) {{
    #pragma unroll
    for (uint32_t i = 0; i < {regs}; ++ i) acc[i] = fmaf(d[i], (i / 2) % 2 ? s1 : s0, acc[i]);
}}

extern "C" __global__ void __launch_bounds__(384, 1)
{v.name}(const uint4* src, float* out, uint32_t num_blocks) {{
    extern __shared__ __align__(1024) uint8_t smem[];
    constexpr uint32_t kBytes = 2 * 64 * 128 + {v.n} * 128;
    for (uint32_t i = threadIdx.x; i < kBytes / 16; i += 384)
        reinterpret_cast<uint4*>(smem)[i] = src[i];
    __syncthreads();
    const uint32_t warp = threadIdx.x / 32;
    if (warp < 4) {{
        ptx::setmaxnreg_dec<40>();
        return;
    }}
    ptx::setmaxnreg_inc<232>();
    const uint32_t wg = warp / 4 - 1, base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    const uint64_t desc_a = ptx::make_smem_desc_k_major_sw128_at(base + wg * 64 * 128);
    const uint64_t desc_b = ptx::make_smem_desc_k_major_sw128_at(base + 2 * 64 * 128);
    [[maybe_unused]] const float s = 1.0f + threadIdx.x * 1e-7f;
    float acc[{regs}];
    #pragma unroll
    for (uint32_t i = 0; i < {regs}; ++ i) acc[i] = 0.0f;
""" + {
        "none": f"""
    #pragma unroll 1
    for (uint32_t b = 0; b < num_blocks; ++ b) {{
        issue<true>(desc_a, desc_b, acc);
        ptx::wgmma_wait_group<0>();
    }}
    ptx::fence_operands(acc);
""",
        "one": f"""
    float d[{regs}];
    #pragma unroll 1
    for (uint32_t b = 0; b < num_blocks; ++ b) {{
        issue<false>(desc_a, desc_b, d);
        ptx::wgmma_wait_group<0>();
        ptx::fence_operands(d);
        promote(acc, d, s);
    }}
""",
        "two": f"""
    float d0[{regs}], d1[{regs}];
    #pragma unroll
    for (uint32_t i = 0; i < {regs}; ++ i) d1[i] = 0.0f;
    #pragma unroll 1
    for (uint32_t b = 0; b < num_blocks; b += 2) {{
        issue<false>(desc_a, desc_b, d0);
        promote(acc, d1, s);
        ptx::wgmma_wait_group<0>();
        ptx::fence_operands(d0);
        issue<false>(desc_a, desc_b, d1);
        promote(acc, d0, s);
        ptx::wgmma_wait_group<0>();
        ptx::fence_operands(d1);
    }}
    promote(acc, d1, s);
""",
        "one64": f"""
    float d[{regs}];
    #pragma unroll 1
    for (uint32_t b = 0; b < num_blocks; ++ b) {{
        issue<false, 0, 2>(desc_a, desc_b, d);
        ptx::wgmma_wait_group<0>();
        ptx::fence_operands(d);
        promote_rows(acc, d, s, s + 1.0f);
        issue<false, 2, 2>(desc_a, desc_b, d);
        ptx::wgmma_wait_group<0>();
        ptx::fence_operands(d);
        promote_rows(acc, d, s + 2.0f, s + 3.0f);
    }}
""",
        "two64": f"""
    float d0[{regs}], d1[{regs}];
    #pragma unroll
    for (uint32_t i = 0; i < {regs}; ++ i) d1[i] = 0.0f;
    #pragma unroll 1
    for (uint32_t b = 0; b < num_blocks; ++ b) {{
        issue<false, 0, 2>(desc_a, desc_b, d0);
        promote_rows(acc, d1, s + 2.0f, s + 3.0f);
        ptx::wgmma_wait_group<0>();
        ptx::fence_operands(d0);
        issue<false, 2, 2>(desc_a, desc_b, d1);
        promote_rows(acc, d0, s, s + 1.0f);
        ptx::wgmma_wait_group<0>();
        ptx::fence_operands(d1);
    }}
    promote_rows(acc, d1, s + 2.0f, s + 3.0f);
""",
    }[v.promote] + f"""
    float sum = 0.0f;
    #pragma unroll
    for (uint32_t i = 0; i < {regs}; ++ i) sum += acc[i];
    out[blockIdx.x * 256 + threadIdx.x - 128] = sum;
}}
"""


def compile_variant(v: Variant) -> compiler.CompileResult:
    return compiler.build(v.name, _source(v))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--compile-only", action="store_true")
    args = parser.parse_args()
    console = Console(width=150)
    builds = {v: compile_variant(v) for v in VARIANTS}
    for v, b in builds.items():
        f = b.functions[0] if b.functions else None
        console.print(f"{v.name}: {f}")
    if args.compile_only:
        return

    import torch

    src = torch.randn(2 * 64 * 128 + 256 * 128, device="cuda").to(torch.float8_e4m3fn).view(torch.uint8)
    out = torch.empty(NUM_CTAS * 256, device="cuda")
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "100"], stdout=subprocess.PIPE, text=True)
    rows = []
    for v, b in builds.items():
        kernel = runtime.load(b, 384, cooperative=False)
        smem = 2 * 64 * 128 + v.n * 128
        num_blocks = 4096  # ~10 ms per launch at the dense rate
        flops = NUM_CTAS * 2 * num_blocks * K_STEPS * 2.0 * 64 * v.n * 32
        launch = lambda: kernel.launch(NUM_CTAS, [runtime.ptr(src), runtime.ptr(out), runtime.u32(num_blocks)], smem)
        time.sleep(1.0)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        launch()
        end.record()
        end.synchronize()
        burst_us = begin.elapsed_time(end) * 1e3
        t_start = time.time()
        while time.time() - t_start < 1.0:
            launch()
        torch.cuda.synchronize()
        t0 = time.time()
        calls = 0
        begin.record()
        while time.time() - t0 < args.seconds:
            for _ in range(10):
                launch()
            calls += 10
            end.record()
            end.synchronize()
        rows.append((v, t0, time.time(), burst_us, begin.elapsed_time(end) * 1e3 / calls, flops))
    smi.terminate()
    samples = []
    for line in smi.communicate()[0].splitlines():
        stamp, clock, power = (x.strip() for x in line.split(","))
        samples.append((datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp(), float(clock), float(power)))

    table = Table(title=f"wgmma m64nNk32 e4m3 from shared memory, 132 CTAs x 2 math warpgroups, {args.seconds:.0f} s "
                        f"sustained per variant")
    for col in ("N", "promotion", "accum regs", "burst TFLOP/s", "sustained TFLOP/s", "median W", "median SM MHz",
                "pJ / FLOP", "FLOP / SM clock"):
        table.add_column(col, justify="right")
    for v, t0, t1, burst_us, us, flops in rows:
        inside = [(c, p) for t, c, p in samples if t0 + 0.5 <= t <= t1]
        clock = statistics.median(c for c, _ in inside) if inside else float("nan")
        power = statistics.median(p for _, p in inside) if inside else float("nan")
        rate = flops / us * 1e6
        table.add_row(str(v.n), v.promote, str(v.accum_regs), f"{flops / burst_us / 1e6:.0f}", f"{rate / 1e12:.0f}",
                      f"{power:.0f}", f"{clock:.0f}", f"{power / rate * 1e12:.3f}",
                      f"{rate / (clock * 1e6) / NUM_CTAS:.0f}")
    console.print(table)


if __name__ == "__main__":
    main()
