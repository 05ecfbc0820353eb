// mbarrier wrappers (shared::cta), with a bounded wait.
#pragma once

#include "timeout.cuh"

namespace megamoe::ptx {

MEGAMOE_DEVICE void mbarrier_init(uint64_t* bar, uint32_t arrive_count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(arrive_count) : "memory");
}

// Arrive where `pred` holds: a predicated instruction, not a branch (a branch there left ptxas short of registers in
// the L2-mode consumer: 604 B of spills, session 10).
MEGAMOE_DEVICE void mbarrier_arrive_if_at(uint32_t bar_addr, bool pred) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %1, 0;\n"
        "@p mbarrier.arrive.shared::cta.b64 _, [%0];\n"
        "}\n" ::"r"(bar_addr), "r"(static_cast<uint32_t>(pred))
        : "memory");
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

// Wait for the phase with the given parity to complete; time out with a diagnostic (kPrint: see
// megamoe_report_timeout; false in warpgroups that issue WGMMA).
template <bool kPrint = true>
MEGAMOE_DEVICE void mbarrier_wait(const DeviceEnv& env, const char* tag, uint64_t* bar, uint32_t parity) {
    bounded_wait<kPrint>(
        env, tag, [&]() { return mbarrier_try_wait_parity(bar, parity); },
        [&]() { return make_longlong3(parity, static_cast<int64_t>(*bar), 0); });
}

}  // namespace megamoe::ptx
