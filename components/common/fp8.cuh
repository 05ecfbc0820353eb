// FP8 (e4m3) quantization of DESIGN section 4, per group of values: amax = max |v|, a = max(amax, 1e-10),
// sf = a / 448, q = e4m3_rn_satfinite(v * (448 / a)). Both quotients are IEEE divisions (never fast math), so the
// codes and SFs are bit-identical to megamoe.quant's.
#pragma once

#include "utils.cuh"

namespace megamoe::fp8 {

constexpr float kFp8Max = 448.0f;
constexpr float kSfEpsilon = 1e-10f;

// The scale factor stored with a group and the multiplier that maps its values into the FP8 range.
struct GroupScales {
    float sf;   // a / 448
    float inv;  // 448 / a
};

MEGAMOE_DEVICE GroupScales group_scales(float amax) {
    const float a = fmaxf(amax, kSfEpsilon);
    return {__fdiv_rn(a, kFp8Max), __fdiv_rn(kFp8Max, a)};
}

// Two fp32 values -> two e4m3 codes, round to nearest even, saturating to +-448 (NaN stays NaN):
// `lo` in bits [0, 8), `hi` in bits [8, 16) (cvt puts its first source in the upper byte).
MEGAMOE_DEVICE uint32_t cvt_e4m3x2(float lo, float hi) {
    uint16_t packed;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
    return packed;
}

// q pair of (v_lo, v_hi) with the group's multiplier: one fp32 multiply each, then the conversion.
MEGAMOE_DEVICE uint32_t quantize_pair(float v_lo, float v_hi, float inv) {
    return cvt_e4m3x2(__fmul_rn(v_lo, inv), __fmul_rn(v_hi, inv));
}

}  // namespace megamoe::fp8
