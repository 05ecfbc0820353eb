// mbarrier wrappers (shared::cta), with a bounded wait.
#pragma once

#include "timeout.cuh"

namespace megamoe::ptx {

MEGAMOE_DEVICE void mbarrier_init(uint64_t* bar, uint32_t arrive_count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(arrive_count) : "memory");
}

// Arrive where `pred` holds: a predicated instruction, not a branch (a branch there left ptxas short of registers in
// the L2-mode consumer: measured 604 B of spills).
MEGAMOE_DEVICE void mbarrier_arrive_if_at(uint32_t bar_addr, bool pred) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %1, 0;\n"
        "@p mbarrier.arrive.shared::cta.b64 _, [%0];\n"
        "}\n" ::"r"(bar_addr), "r"(static_cast<uint32_t>(pred))
        : "memory");
}

// Arrive `count` times at once
MEGAMOE_DEVICE void mbarrier_arrive_count_at(uint32_t bar_addr, uint32_t count) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;" ::"r"(bar_addr), "r"(count) : "memory");
}

// Arrive and add `num_bytes` to the transaction count the current phase waits for (TMA completes them).
MEGAMOE_DEVICE void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t num_bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(num_bytes)
                 : "memory");
}

MEGAMOE_DEVICE bool mbarrier_try_wait_parity(uint64_t* bar, uint32_t parity) {
    uint32_t done;
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
    return done != 0;
}

// Wait for the phase with the given parity to complete; time out with a diagnostic (kPrint, kSite: see
// megamoe_report_timeout; false and kInline in warpgroups that issue WGMMA).
template <bool kPrint = true, ReportSite kSite = ReportSite::kCall>
MEGAMOE_DEVICE void mbarrier_wait(const DeviceEnv& env, const char* tag, uint64_t* bar, uint32_t parity) {
    bounded_wait<kPrint, kSite>(
        env, tag, [&]() { return mbarrier_try_wait_parity(bar, parity); },
        [&]() { return make_longlong3(parity, static_cast<int64_t>(*bar), 0); });
}

// Wait for the phase with the given parity entirely inside one asm block, polling %globaltimer there: no C++
// loop or branch, so it may run while a WGMMA group is in flight (a C++ spin loop with its trap path there makes
// ptxas serialize the pipeline, C7518). Returns 0 once the phase completed, or the ns waited once that exceeded
// timeout_ns: the caller reports the timeout (megamoe_report_timeout) after its WGMMA wait.
MEGAMOE_DEVICE uint64_t mbarrier_wait_inline_at(uint32_t bar_addr, uint32_t parity, uint64_t timeout_ns) {
    uint64_t waited;
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        ".reg .u64 t0, t1;\n"
        "mov.u64 %0, 0;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "@p bra MEGAMOE_INLINE_WAIT_DONE;\n"
        "mov.u64 t0, %%globaltimer;\n"
        "MEGAMOE_INLINE_WAIT_LOOP:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "@p bra MEGAMOE_INLINE_WAIT_DONE;\n"
        "mov.u64 t1, %%globaltimer;\n"
        "sub.u64 t1, t1, t0;\n"
        "setp.le.u64 p, t1, %3;\n"
        "@p bra MEGAMOE_INLINE_WAIT_LOOP;\n"
        "mov.u64 %0, t1;\n"
        "MEGAMOE_INLINE_WAIT_DONE:\n"
        "}\n"
        : "=l"(waited)
        : "r"(bar_addr), "r"(parity), "l"(timeout_ns)
        : "memory");
    return waited;
}

}  // namespace megamoe::ptx
