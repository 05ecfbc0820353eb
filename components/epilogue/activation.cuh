// SwiGLU with the optional activation clamp (DESIGN section 4), evaluated per (gate, up) pair in fp32.
// Every product is an explicit round-to-nearest multiply, so nvcc cannot contract it into something the
// reference does not compute.
#pragma once

#include "common/utils.cuh"

namespace megamoe::epilogue {

// gate = min(gate, c), up = clamp(up, -c, c): the DeepSeek / GPT-OSS limit (the gate is clamped from above
// only). kClamp = false compiles the clamp out.
template <bool kClamp>
MEGAMOE_DEVICE void clamp_gate_up(float& gate, float& up, float clamp) {
    if constexpr (kClamp) {
        gate = fminf(gate, clamp);
        up = fminf(fmaxf(up, -clamp), clamp);
    }
}

// 2^x by the MUFU with denormal results flushed to zero (ex2.approx.ftz): __expf's ex2.approx without .ftz adds a
// compare and two predicated multiplies per call to produce denormal results for x < -126 (96 of the L1
// epilogue's ~630 instructions per warp; T 4096 2-9 us faster on an H100, notes/fused.md).
MEGAMOE_DEVICE float exp2_approx_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// silu(gate) = gate * sigmoid(gate).
// Exact: gate * (1 / (1 + expf(-gate))) with the accurate expf and an IEEE reciprocal, the formula of the
// reference (torch.sigmoid = 1 / (1 + exp(-x))). Fast: gate / (1 + __expf(-gate)) with the MUFU exponential and
// an approximate division (x * rcp.approx(y)); for gate <= -88 the denominator is inf and the result -0.
template <bool kFastMath>
MEGAMOE_DEVICE float silu(float gate) {
    // NOTES: __expf(-gate) is ex2.approx(-gate * log2(e)), the same multiply and MUFU as here for arguments >= -126
    // (gate <= 87.3); above that 2^x is denormal, or 0 flushed, and 1 + either is exactly 1. So the denominator,
    // and silu, are bit-identical to __fdividef(gate, 1 + __expf(-gate)).
    if constexpr (kFastMath)
        return __fdividef(gate, 1.0f + exp2_approx_ftz(__fmul_rn(gate, -1.4426950408889634f)));
    else
        return __fmul_rn(gate, __frcp_rn(__fadd_rn(1.0f, expf(-gate))));
}

// v = silu(gate) * up * weight, the reference's order of multiplies (megamoe.reference.swiglu).
template <bool kClamp, bool kFastMath>
MEGAMOE_DEVICE float swiglu_weighted(float gate, float up, float weight, float clamp) {
    clamp_gate_up<kClamp>(gate, up, clamp);
    return __fmul_rn(__fmul_rn(silu<kFastMath>(gate), up), weight);
}

}  // namespace megamoe::epilogue
