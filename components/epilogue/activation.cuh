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

// silu(gate) = gate * sigmoid(gate).
// Exact: gate * (1 / (1 + expf(-gate))) with the accurate expf and an IEEE reciprocal, the formula of the
// reference (torch.sigmoid = 1 / (1 + exp(-x))). Fast: gate / (1 + __expf(-gate)) with the MUFU exponential and
// an approximate division (x * rcp.approx(y)); for gate <= -88 the denominator is inf and the result -0.
template <bool kFastMath>
MEGAMOE_DEVICE float silu(float gate) {
    if constexpr (kFastMath)
        return __fdividef(gate, 1.0f + __expf(-gate));
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
