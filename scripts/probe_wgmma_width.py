"""How the WGMMA tile width and the promotion scheme alone set the FP8 rate on the H200 (issue: GEMM at prefill).

No TMA, no pipeline: both math warpgroups of every CTA (132 CTAs, 384 threads as in the GEMM kernel) run K blocks of
4 x wgmma m64nNk32 on operands resident in shared memory (random e4m3 bytes, so the tensor cores switch as with real
data), promoted as the GEMM consumer does:
  none  accumulate in the WGMMA accumulator (no promotion: the tensor pipe's bound for this width)
  one   one partial: issue, wait, promote (acc += d * scale)
  two   two partials: block b runs while block b - 1's partial is promoted (gemm/consumer.cuh, L1 mode)
  one64 as one, per 64-K half with its own scale (L2 mode's per-64 activation SF: twice the promotions)
  two64 as two, per 64-K half: half h runs while half h - 1 is promoted (gemm/consumer.cuh, L2 mode)
  pair64 per 64-K half, both halves' groups issued back to back, waited for, then both promoted
         (the promote-after-wait consumer of L2 mode, measured and removed: notes/gemm.md)
fill  (a second table) warp 0 streams 16 KB bulk copies (L2-resident source) into a ring of 4 buffers beside the
      operands while the WGMMAs run, one copy per `interval` SM clocks (0: as fast as they complete): the GEMM's
      TMA fill of its stages (A + B, 32 KB per 128-K block of both warpgroups) competes with the WGMMAs' operand
      reads for shared-memory bandwidth. Rates from clock64 inside the kernel: FLOP and bytes per SM clock.
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
    promote: str  # none | one | two | one64 | two64 | pair64
    fill_interval: int = -1  # -1: no fill; else SM clocks between 16 KB bulk copies into shared memory (0: unpaced)

    @property
    def name(self) -> str:
        fill = "" if self.fill_interval < 0 else f"_fill{self.fill_interval}"
        return f"megamoe_probe_wgmma_n{self.n}_{self.promote}{fill}"

    @property
    def accum_regs(self) -> int:
        per = self.n // 2
        return per * {"none": 1, "one": 2, "two": 3, "one64": 2, "two64": 3, "pair64": 3}[self.promote]


VARIANTS = (Variant(128, "none"), Variant(128, "one"), Variant(128, "two"),
            Variant(192, "none"), Variant(192, "one"), Variant(256, "none"), Variant(128, "one64"),
            Variant(128, "two64"), Variant(128, "pair64"))
# The fill's effect on the L1 consumer (two partials) and on the bare tensor pipe: unpaced, and paced near the GEMM's
# own fill (32 KB per 128-K block, whose WGMMAs take 512 tensor clocks: 64 B per clock) and half of it; and on a
# 192-wide tile with one partial (the widest L1 tile whose partial and accumulator fit the registers; its fill is
# 40 KB per 768 tensor clocks: 16 KB per 315); and on the L2 schemes (per-64 promotion: two64, pair64)
FILL_VARIANTS = tuple(Variant(128, promote, interval) for promote in ("none", "two") for interval in (0, 256, 512)) + (
    Variant(192, "one", 0), Variant(192, "one", 320), Variant(128, "two64", 256), Variant(128, "pair64", 256))
FILL_BYTES = 16384
FILL_SRC_BYTES = 1 << 22  # 4 MB read round robin: L2-resident, as most of the GEMM's operand loads
NUM_CTAS = 132
K_STEPS = 4  # wgmma k32 steps per 128-K block


def _source(v: Variant) -> str:
    regs = v.n // 2
    placeholders = "{" + ", ".join(f"%{i}" for i in range(regs)) + "}"
    operands = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    return f"""
#include "common/fence.cuh"
#include "common/mbarrier.cuh"
#include "common/tma.cuh"
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
{v.name}(const uint4* src, float* out, uint32_t num_blocks, const uint8_t* fill_src,
          unsigned long long* clocks) {{
    extern __shared__ __align__(1024) uint8_t smem[];
    constexpr uint32_t kBytes = 2 * 64 * 128 + {v.n} * 128;
    constexpr uint32_t kFillOffset = (kBytes + 1023) / 1024 * 1024, kNumFill = 4, kFillBytes = {FILL_BYTES};
    uint64_t* fill_bars = reinterpret_cast<uint64_t*>(smem + kFillOffset + kNumFill * kFillBytes);
    uint32_t* done = reinterpret_cast<uint32_t*>(fill_bars + kNumFill);
    for (uint32_t i = threadIdx.x; i < kBytes / 16; i += 384)
        reinterpret_cast<uint4*>(smem)[i] = src[i];
    if (threadIdx.x == 0) {{
        for (uint32_t i = 0; i < kNumFill; ++ i)
            ptx::mbarrier_init(fill_bars + i, 1);
        *done = 0;
        ptx::fence_mbarrier_init();
    }}
    __syncthreads();
    const uint32_t warp = threadIdx.x / 32;
    if (warp < 4) {{
        ptx::setmaxnreg_dec<40>();
        if ({int(v.fill_interval >= 0)} and threadIdx.x == 0) {{
            // Stream 16 KB copies round robin through the ring until both math warpgroups are done
            const unsigned long long start = clock64();
            unsigned long long next = start, num_copies = 0;
            uint32_t chunk = blockIdx.x * 7;
            while (*reinterpret_cast<volatile uint32_t*>(done) < 2) {{
                const uint32_t slot = num_copies % kNumFill;
                if (num_copies >= kNumFill)
                    while (not ptx::mbarrier_try_wait_parity(fill_bars + slot, (num_copies / kNumFill - 1) & 1)) {{}}
                if ({v.fill_interval} > 0) {{
                    while (clock64() < next) {{}}
                    next += {max(v.fill_interval, 0)};
                }}
                ptx::mbarrier_arrive_expect_tx(fill_bars + slot, kFillBytes);
                chunk = (chunk + 1) % ({FILL_SRC_BYTES} / kFillBytes);
                ptx::bulk_load_1d(smem + kFillOffset + slot * kFillBytes, fill_src + chunk * kFillBytes, kFillBytes,
                                  fill_bars + slot);
                ++ num_copies;
            }}
            for (unsigned long long c = num_copies > kNumFill ? num_copies - kNumFill : 0; c < num_copies; ++ c)
                while (not ptx::mbarrier_try_wait_parity(fill_bars + c % kNumFill, (c / kNumFill) & 1)) {{}}
            clocks[blockIdx.x * 4 + 2] = clock64() - start;
            clocks[blockIdx.x * 4 + 3] = num_copies * kFillBytes;
        }}
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
    const unsigned long long math_start = clock64();
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
        "pair64": f"""
    float d0[{regs}], d1[{regs}];
    #pragma unroll 1
    for (uint32_t b = 0; b < num_blocks; ++ b) {{
        issue<false, 0, 2>(desc_a, desc_b, d0);
        issue<false, 2, 2>(desc_a, desc_b, d1);
        ptx::wgmma_wait_group<0>();
        ptx::fence_operands(d0);
        ptx::fence_operands(d1);
        promote_rows(acc, d0, s, s + 1.0f);
        promote_rows(acc, d1, s + 2.0f, s + 3.0f);
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
    if (threadIdx.x % 128 == 0) {{
        if (wg == 0)
            clocks[blockIdx.x * 4] = clock64() - math_start;
        atomicAdd(done, 1u);
    }}
    float sum = 0.0f;
    #pragma unroll
    for (uint32_t i = 0; i < {regs}; ++ i) sum += acc[i];
    out[blockIdx.x * 256 + threadIdx.x - 128] = sum;
}}
"""


def compile_variant(v: Variant) -> compiler.CompileResult:
    return compiler.build(v.name, _source(v))


def smem_bytes(v: Variant) -> int:
    """Operands, the fill ring and its barriers (the kernel's carve-up)."""
    return -(-(2 * 64 * 128 + v.n * 128) // 1024) * 1024 + 4 * FILL_BYTES + 4 * 8 + 16


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--fill", action="store_true", help="only the shared-memory fill table (and its baselines)")
    args = parser.parse_args()
    console = Console(width=150)
    baselines = (Variant(128, "none"), Variant(128, "two"), Variant(192, "one"), Variant(128, "two64"),
                 Variant(128, "pair64"))
    variants = baselines + FILL_VARIANTS if args.fill else VARIANTS
    builds = {v: compile_variant(v) for v in variants}
    for v, b in builds.items():
        f = b.functions[0] if b.functions else None
        console.print(f"{v.name}: {f}")
    if args.compile_only:
        return

    import torch

    src = torch.randn(2 * 64 * 128 + 256 * 128, device="cuda").to(torch.float8_e4m3fn).view(torch.uint8)
    fill_src = torch.randint(0, 256, (FILL_SRC_BYTES,), device="cuda", dtype=torch.uint8)
    out = torch.empty(NUM_CTAS * 256, device="cuda")
    clocks = torch.zeros(NUM_CTAS, 4, device="cuda", dtype=torch.int64)
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "100"], stdout=subprocess.PIPE, text=True)
    rows = []
    for v, b in builds.items():
        kernel = runtime.load(b, 384, cooperative=False)
        num_blocks = 4096  # ~10 ms per launch at the dense rate
        flops = NUM_CTAS * 2 * num_blocks * K_STEPS * 2.0 * 64 * v.n * 32
        launch = lambda: kernel.launch(NUM_CTAS, [runtime.ptr(src), runtime.ptr(out), runtime.u32(num_blocks),
                                                  runtime.ptr(fill_src), runtime.ptr(clocks)], smem_bytes(v))
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
        c = clocks.double().median(dim=0).values.tolist()  # the last launch: median over the CTAs
        rows.append((v, t0, time.time(), burst_us, begin.elapsed_time(end) * 1e3 / calls, flops, c))
    smi.terminate()
    samples = []
    for line in smi.communicate()[0].splitlines():
        stamp, clock, power = (x.strip() for x in line.split(","))
        samples.append((datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp(), float(clock), float(power)))

    table = Table(title=f"wgmma m64nNk32 e4m3 from shared memory, 132 CTAs x 2 math warpgroups, {args.seconds:.0f} s "
                        f"sustained per variant")
    for col in ("N", "promotion", "fill every (clk)", "accum regs", "burst TFLOP/s", "sustained TFLOP/s", "median W",
                "median SM MHz", "pJ / FLOP", "FLOP / SM clock", "in-kernel FLOP / clock", "fill B / clock"):
        table.add_column(col, justify="right")
    for v, t0, t1, burst_us, us, flops, c in rows:
        inside = [(c, p) for t, c, p in samples if t0 + 0.5 <= t <= t1]
        clock = statistics.median(c for c, _ in inside) if inside else float("nan")
        power = statistics.median(p for _, p in inside) if inside else float("nan")
        rate = flops / us * 1e6
        fill = "-" if v.fill_interval < 0 else ("unpaced" if v.fill_interval == 0 else str(v.fill_interval))
        table.add_row(str(v.n), v.promote, fill, str(v.accum_regs), f"{flops / burst_us / 1e6:.0f}",
                      f"{rate / 1e12:.0f}", f"{power:.0f}", f"{clock:.0f}", f"{power / rate * 1e12:.3f}",
                      f"{rate / (clock * 1e6) / NUM_CTAS:.0f}", f"{flops / NUM_CTAS / c[0]:.0f}",
                      "-" if v.fill_interval < 0 else f"{c[3] / c[2]:.1f}")
    console.print(table)


if __name__ == "__main__":
    main()
