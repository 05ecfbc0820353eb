// The L1 -> L2 requant of DESIGN section 4, per row and 64 output columns: the FP8 group quantization of
// common/fp8.cuh (sf = a / 448, q = e4m3_rn_satfinite(v * (448 / a)), IEEE divisions) over the 4 lanes of a quad.
#pragma once

#include "common/fp8.cuh"

namespace megamoe::epilogue {

// Max over the 4 lanes of a quad (the lanes that hold one accumulator row): two xor shuffles.
MEGAMOE_DEVICE float quad_max(float value) {
    value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, 1));
    value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, 2));
    return value;
}

}  // namespace megamoe::epilogue
