// The one kernel skeleton of the 384-thread design (DESIGN 5): after a kernel's common prologue, every warp runs
// the function of its role, with the register budget of its role. The GEMM and expert-FFN unit kernels and the
// fused kernel all enter their roles here, so the role table and the setmaxnreg split exist once.
//
//   warps 0-1    dispatch  (40 registers)   pull rows in the fused kernel; idle in the GEMM-only kernels
//   warp  2      TMA-A     (40 registers)   activation tiles + their SFs
//   warp  3      TMA-B     (40 registers)   weight tiles
//   WG1 (+ WG2)  math      (224 registers)  WGMMA consumers + epilogues; WG2 joins at BLOCK_M = 128
//   WG2 spare    (BLOCK_M <= 64)            gives its registers back, or keeps them for later work (the fused
//                                           kernel's top-k reduce)
#pragma once

#include "warp_roles.cuh"
#include "wgmma.cuh"

namespace megamoe {

constexpr uint32_t kNumDispatchWarps = 2;
static_assert(kNumDispatchWarps <= kTmaAWarpIdx and kTmaAWarpIdx < kTmaBWarpIdx and kTmaBWarpIdx < 4,
              "WG0 = dispatch warps, then the TMA-A and TMA-B warps");

enum class SpareWarpgroup : uint32_t {
    kReleaseRegisters = 0,  // setmaxnreg.dec to the producers' budget, then run `spare`
    kKeepRegisters = 1,     // keep the launch budget (168: __launch_bounds__(384, 1)) for `spare`
};

// Run the calling warp's role. The role functions take (warp_idx) for dispatch, nothing for the TMA warps (every
// lane calls them: lane 0 issues), (math_wg_idx, thread_in_wg) for the math warpgroups and the spare one.
// NOTES: setmaxnreg is executed by all warps of a warpgroup on one uniform branch (the role is warp-uniform).
// The registers after the split: 128 x 40 + 256 x 224 = 62464 of 65536 with two math warpgroups; with one math
// warpgroup and a spare that keeps its 168, 128 x (40 + 224 + 168) = 55296.
template <uint32_t kNumMathWarpgroups, SpareWarpgroup kSpare, uint32_t kWg0Regs = kNumProducerRegs,
          typename Dispatch, typename TmaA, typename TmaB, typename Math, typename Spare>
MEGAMOE_DEVICE void run_warp_roles(const Dispatch& dispatch, const TmaA& tma_a, const TmaB& tma_b,
                                   const Math& math, const Spare& spare) {
    static_assert(kNumMathWarpgroups == 1 or kNumMathWarpgroups == 2, "one or two math warpgroups");
    const uint32_t warp = warp_idx();
    static_assert(kWg0Regs * 128 + kNumMathRegs * 256 <= kLaunchRegisterBudget, "register file after setmaxnreg");
    if (warp < 4) {
        ptx::setmaxnreg_dec<kWg0Regs>();
        if (warp < kNumDispatchWarps)
            dispatch(warp);
        else if (warp == kTmaAWarpIdx)
            tma_a();
        else
            tma_b();
    } else if (kNumMathWarpgroups == 2 or warp < 8) {
        // (with two math warpgroups the spare branch is not compiled at all: as dead code ptxas cannot prove
        // unreachable, the spare's 168-register region changed the allocation elsewhere and spilled)
        ptx::setmaxnreg_inc<kNumMathRegs>();
        math(warp / 4 - 1, threadIdx.x % 128);
    } else {
        if constexpr (kSpare == SpareWarpgroup::kReleaseRegisters)
            ptx::setmaxnreg_dec<kNumProducerRegs>();
        spare(warp / 4 - 1, threadIdx.x % 128);
    }
}

// A role with nothing to do
struct NoRole {
    template <typename... Args>
    MEGAMOE_DEVICE void operator()(Args...) const {}
};

}  // namespace megamoe
