// Phase timestamps for profiling a persistent kernel from the inside: for each phase, the earliest and the latest
// %globaltimer reading at which a warp finished it (ns). Off unless the kernel is handed a buffer.
#pragma once

#include "timeout.cuh"

namespace megamoe {

// `times` holds 2 x num_phases u64: [2 p] = min, [2 p + 1] = max over the warps that marked phase p. The host
// fills the mins with ~0 and the maxes with 0 before the launch (megamoe/jit/diagnostics.py: PhaseTimes).
struct PhaseTimer {
    unsigned long long* times;  // nullptr: timing off (one predictable branch per mark)

    // Lane 0 of the calling warp marks the end of `phase` now
    MEGAMOE_DEVICE void mark(uint32_t phase, uint32_t lane) const {
        if (times != nullptr and lane == 0) {
            const unsigned long long now = globaltimer_ns();
            atomicMin(times + 2 * phase, now);
            atomicMax(times + 2 * phase + 1, now);
        }
    }
};

}  // namespace megamoe
