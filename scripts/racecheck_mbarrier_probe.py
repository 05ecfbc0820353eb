"""Does compute-sanitizer's racecheck model mbarrier ordering? A two-warp kernel hands one shared-memory word from
warp 0 to warp 1 through an mbarrier exactly as the fused kernel's task queue does (generic store, arrive; try_wait,
generic load), with no other synchronization between them; racecheck reporting a hazard here means its reports on
the task queue (notes/fused.md) are that tool limitation. Run on the GPU machine (PYTHONPATH=python):
  compute-sanitizer --tool racecheck python3 scripts/racecheck_mbarrier_probe.py"""
from __future__ import annotations

import torch

from megamoe.jit import compiler, runtime

SOURCE = r"""
#include "common/fence.cuh"
#include "common/mbarrier.cuh"
extern "C" __global__ void __launch_bounds__(64, 1) mbarrier_probe(uint32_t* out) {
    __shared__ uint64_t bar;
    __shared__ uint32_t word;
    if (threadIdx.x == 0) {
        megamoe::ptx::mbarrier_init(&bar, 1);
        megamoe::ptx::fence_mbarrier_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        word = 42u;
        megamoe::ptx::mbarrier_arrive_if_at(megamoe::smem_addr(&bar), true);
    } else if (threadIdx.x == 32) {
        // bounded (1 s): a wait that times out reports -1 instead of the word
        const uint64_t waited = megamoe::ptx::mbarrier_wait_inline_at(megamoe::smem_addr(&bar), 0, 1000000000ull);
        out[0] = waited != 0 ? 0xffffffffu : *reinterpret_cast<volatile uint32_t*>(&word);
    }
}
"""


def main() -> None:
    kernel = runtime.load(compiler.build("mbarrier_probe", SOURCE), 64, cooperative=False)
    out = torch.zeros(1, dtype=torch.int32, device="cuda")
    kernel.launch(1, [runtime.ptr(out)], 0)
    torch.cuda.synchronize()
    print(f"mbarrier_probe: warp 1 read {int(out[0])} (expected 42)")


if __name__ == "__main__":
    main()
