// The fused layer's input fill: BF16 hidden states -> FP8 e4m3 with one float SF per 1 x 128 group (DESIGN
// section 4, bit-identical to megamoe.quant.per_token_cast_to_fp8), written straight into the symmetric buffer's
// x / x_sf, and the routing (top-k ids as int32 or int64, weights as float32 times a scaling factor) into its
// topk_idx (int64) / topk_weights. One CTA per row: rows past the token count get the routing of no token (ids
// -1, weights 0), which a caller that pads its batch asks for (DeepGEMM's mega_moe_pre_dispatch_sm90 semantics).
// One warp per 128-column group at a time.
#pragma once

#include <cuda_bf16.h>

#include "common/fp8.cuh"

namespace megamoe::input {

struct CastArgs {
    const __nv_bfloat16* x;      // [T, H]
    const void* topk_idx;        // [T, K] int32 or int64 (kIdx64)
    const float* topk_weights;   // [T, K]
    uint8_t* out_x;              // [T, H] e4m3
    float* out_sf;               // [T, H / 128]
    int64_t* out_topk_idx;       // [T, K]
    float* out_topk_weights;     // [T, K]
    float routed_scaling_factor; // multiplies every weight (1: the weights as they are)
    uint32_t num_tokens;         // rows [0, T) are tokens; the grid's rows past them are cleared
};

template <uint32_t kNumThreads, uint32_t kHidden, uint32_t kNumTopk, bool kIdx64>
MEGAMOE_DEVICE void cast_row(const CastArgs& args, uint32_t token) {
    static_assert(kNumThreads % 32 == 0 and kNumTopk <= kNumThreads, "whole warps; a thread per top-k slot");
    static_assert(kHidden % 128 == 0, "1 x 128 groups");
    constexpr uint32_t kNumGroups = kHidden / 128;
    // A row past the tokens: no expert
    if (token >= args.num_tokens) {
        if (threadIdx.x < kNumTopk) {
            const uint64_t slot = static_cast<uint64_t>(token) * kNumTopk + threadIdx.x;
            args.out_topk_idx[slot] = -1;
            args.out_topk_weights[slot] = 0.0f;
        }
        return;
    }
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const uint64_t row = static_cast<uint64_t>(token) * kHidden;

    // Each lane holds 4 consecutive values of the group: the amax over the warp, then 4 codes per lane
    for (uint32_t g = warp; g < kNumGroups; g += kNumThreads / 32) {
        const uint2 raw = __ldg(reinterpret_cast<const uint2*>(args.x + row + g * 128) + lane);
        const float2 v01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
        const float2 v23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
        float amax = fmaxf(fmaxf(fabsf(v01.x), fabsf(v01.y)), fmaxf(fabsf(v23.x), fabsf(v23.y)));
        #pragma unroll
        for (uint32_t offset = 16; offset > 0; offset /= 2)
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
        const fp8::GroupScales scales = fp8::group_scales(amax);
        const uint32_t codes = fp8::quantize_pair(v01.x, v01.y, scales.inv) |
                               fp8::quantize_pair(v23.x, v23.y, scales.inv) << 16;
        reinterpret_cast<uint32_t*>(args.out_x + row + g * 128)[lane] = codes;
        if (lane == 0)
            args.out_sf[static_cast<uint64_t>(token) * kNumGroups + g] = scales.sf;
    }
    // The routing: one thread per slot
    if (threadIdx.x < kNumTopk) {
        const uint64_t slot = static_cast<uint64_t>(token) * kNumTopk + threadIdx.x;
        args.out_topk_idx[slot] = kIdx64 ? static_cast<const int64_t*>(args.topk_idx)[slot]
                                         : static_cast<int64_t>(static_cast<const int32_t*>(args.topk_idx)[slot]);
        args.out_topk_weights[slot] = __fmul_rn(args.topk_weights[slot], args.routed_scaling_factor);
    }
}

}  // namespace megamoe::input
