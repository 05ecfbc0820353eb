// The thread layout every 384-thread kernel of the fused design shares (DESIGN section 5): WG0 = 2 dispatch
// warps + the TMA-A and TMA-B warps, WG1 and WG2 = math/epilogue; registers re-split with setmaxnreg; one CTA
// per SM with up to the SM90 per-block shared-memory limit.
#pragma once

#include "utils.cuh"

namespace megamoe {

constexpr uint32_t kNumThreads = 384;
constexpr uint32_t kTmaAWarpIdx = 2;
constexpr uint32_t kTmaBWarpIdx = 3;
constexpr uint32_t kFirstMathThread = 128;
constexpr uint32_t kNumProducerRegs = 40;
constexpr uint32_t kNumMathRegs = 224;
constexpr uint32_t kSmemLimit = 232448;
// Registers allocated at launch: 384 threads x the __launch_bounds__(384, 1) cap of 168
constexpr uint32_t kLaunchRegisterBudget = kNumThreads * 168;
static_assert(kNumProducerRegs * 128 + kNumMathRegs * 256 <= 65536, "register file after setmaxnreg");

}  // namespace megamoe
