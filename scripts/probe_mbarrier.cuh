// Bare mbarrier and stage-ring helpers of the standalone probes (scripts/probe_*.cu: no torch, no project headers,
// no timeouts).
#pragma once
#include <cstdint>

__device__ __forceinline__ uint32_t sa(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void bar_init(uint64_t* b, uint32_t c) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(sa(b)), "r"(c));
}
__device__ __forceinline__ void bar_expect(uint64_t* b, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sa(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bar_arrive(uint64_t* b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(sa(b)) : "memory");
}
__device__ __forceinline__ void bar_wait(uint64_t* b, uint32_t parity) {
    uint32_t done = 0;
    while (!done)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(sa(b)), "r"(parity) : "memory");
}

// Thread 0: a ring of `stages` full barriers at `full`, then as many empty barriers (arrive count 1 each)
__device__ __forceinline__ void init_ring_barriers(uint64_t* full, uint32_t stages) {
    for (uint32_t i = 0; i < 2 * stages; ++ i)
        bar_init(full + i, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// The next stage of a ring of `stages`, flipping the phase at the wrap
__device__ __forceinline__ void ring_advance(uint32_t& stage, uint32_t& phase, uint32_t stages) {
    if (++ stage == stages) { stage = 0; phase ^= 1; }
}
// One non-tensor bulk copy global -> shared, completing on `bar`
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(sa(dst)), "l"(src), "r"(bytes), "r"(sa(bar)) : "memory");
}
