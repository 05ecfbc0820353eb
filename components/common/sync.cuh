// Intra-CTA synchronization: elect-one and named barriers.
#pragma once

#include "utils.cuh"

namespace megamoe::ptx {

// One lane of the (fully active) warp returns true.
MEGAMOE_DEVICE bool elect_one_sync() {
    uint32_t pred = 0;
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "elect.sync _|p, 0xffffffff;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(pred));
    return pred != 0;
}

// NOTES: named barrier 0 is what __syncthreads() uses; the kernel's own barriers start at 1
// (DESIGN section 5). kNumThreads must be a multiple of the warp size.
template <uint32_t kBarrierIdx, uint32_t kNumThreads>
MEGAMOE_DEVICE void named_barrier_sync() {
    static_assert(kBarrierIdx >= 1 and kBarrierIdx < 16, "named barriers 1..15 (0 is __syncthreads)");
    static_assert(kNumThreads % 32 == 0, "named barrier thread count must be a multiple of 32");
    asm volatile("bar.sync %0, %1;" ::"n"(kBarrierIdx), "n"(kNumThreads) : "memory");
}

// The same with the barrier picked at run time (e.g. one per warpgroup): barrier_idx in 1..15
template <uint32_t kNumThreads>
MEGAMOE_DEVICE void named_barrier_sync(uint32_t barrier_idx) {
    static_assert(kNumThreads % 32 == 0, "named barrier thread count must be a multiple of 32");
    asm volatile("bar.sync %0, %1;" ::"r"(barrier_idx), "n"(kNumThreads) : "memory");
}

template <uint32_t kBarrierIdx, uint32_t kNumThreads>
MEGAMOE_DEVICE void named_barrier_arrive() {
    static_assert(kBarrierIdx >= 1 and kBarrierIdx < 16, "named barriers 1..15 (0 is __syncthreads)");
    static_assert(kNumThreads % 32 == 0, "named barrier thread count must be a multiple of 32");
    asm volatile("bar.arrive %0, %1;" ::"n"(kBarrierIdx), "n"(kNumThreads) : "memory");
}

}  // namespace megamoe::ptx
