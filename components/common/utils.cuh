// Small compile-time and device helpers shared by every component.
#pragma once

#include <cstdint>
#include <cstdio>

#define MEGAMOE_DEVICE __device__ __forceinline__
#define MEGAMOE_HOST_DEVICE __host__ __device__ __forceinline__

#define MEGAMOE_STRINGIFY_IMPL(x) #x
#define MEGAMOE_STRINGIFY(x) MEGAMOE_STRINGIFY_IMPL(x)
// Device assertion: prints where and what, then traps. The message is one literal (printf without
// arguments), so it costs no stack frame.
#define MEGAMOE_DEVICE_ASSERT(cond)                                                                       \
    do {                                                                                                  \
        if (not(cond)) {                                                                                  \
            printf(__FILE__ ":" MEGAMOE_STRINGIFY(__LINE__) ": megamoe device assertion failed: " #cond "\n"); \
            __trap();                                                                                     \
        }                                                                                                 \
    } while (0)

namespace megamoe {

template <typename T>
MEGAMOE_HOST_DEVICE constexpr T ceil_div(T a, T b) { return (a + b - 1) / b; }

template <typename T>
MEGAMOE_HOST_DEVICE constexpr T align_up(T a, T b) { return ceil_div(a, b) * b; }

template <typename T>
MEGAMOE_HOST_DEVICE constexpr bool is_pow2(T a) { return a > 0 and (a & (a - 1)) == 0; }

MEGAMOE_DEVICE uint32_t lane_idx() {
    uint32_t lane;
    asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
    return lane;
}

// Warp index, made warp-uniform for the compiler (it cannot prove threadIdx.x / 32 is uniform).
MEGAMOE_DEVICE uint32_t warp_idx() { return __shfl_sync(0xffffffffu, threadIdx.x / 32, 0); }

// A volatile shared-memory load: re-read at every use, never forwarded from an earlier store or value. The fused
// kernel keeps its CTA index and grid size in shared memory and reads them this way after its role split: ptxas
// otherwise keeps the prologue's copy of %ctaid / %nctaid live across the 40-register roles, which then spill it.
MEGAMOE_DEVICE uint32_t ld_volatile_shared(const uint32_t* ptr) {
    uint32_t v;
    asm volatile("ld.volatile.shared.u32 %0, [%1];" : "=r"(v) : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(ptr))));
    return v;
}

// 16 B at shared address `addr`, re-read at every use (one instruction: its address stays one register).
MEGAMOE_DEVICE uint4 ld_volatile_shared_v4(uint32_t addr) {
    uint4 v;
    asm volatile("ld.volatile.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}

// Bring the line holding `ptr` into this SM's L1 (a hint: no register waits for it). Only for data no other
// thread of the same launch writes (a later weak load could then hit a stale line).
MEGAMOE_DEVICE void prefetch_global_l1(const void* ptr) {
    asm volatile("prefetch.global.L1 [%0];" ::"l"(ptr));
}

MEGAMOE_DEVICE uint32_t smem_addr(const void* ptr) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

}  // namespace megamoe
