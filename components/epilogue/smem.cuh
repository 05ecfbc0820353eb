// Shared-memory stores of the epilogue: 16-byte st.shared / ld.shared, stmatrix (on sm_90a only .m8n8 .b16
// exists), BF16 packing, and the 4 x 4 word transpose across a quad that turns the accumulator's scattered FP8
// pairs into whole 16-byte row chunks.
#pragma once

#include "common/utils.cuh"

namespace megamoe::epilogue {

MEGAMOE_DEVICE void st_shared_v4(uint32_t addr, uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(w0), "r"(w1), "r"(w2), "r"(w3)
                 : "memory");
}

MEGAMOE_DEVICE uint4 ld_shared_v4(uint32_t addr) {
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr)
                 : "memory");
    return v;
}

// Four 8x8 b16 matrices: lanes 8 m .. 8 m + 7 give the row addresses (16 B each) of matrix m; register m of
// lane l holds elements (row l / 4, columns 2 (l % 4), +1) of matrix m, the first in the low half.
MEGAMOE_DEVICE void stmatrix_x4(uint32_t addr, uint32_t m0, uint32_t m1, uint32_t m2, uint32_t m3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(m0), "r"(m1),
                 "r"(m2), "r"(m3)
                 : "memory");
}

// Two fp32 -> BF16 (round to nearest even), `lo` in the low half.
MEGAMOE_DEVICE uint32_t pack_bf16x2(float lo, float hi) {
    uint32_t packed;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
    return packed;
}

// 4 x 4 transpose of 32-bit words across the lanes of a quad: lane q holds w[c] meant for lane c and gets
// t[s] = lane s's w[q]. Two exchanges (lane q ^ 2, then q ^ 1), two words each; the selects only route.
MEGAMOE_DEVICE void quad_transpose(const uint32_t (&w)[4], uint32_t (&t)[4], uint32_t quad_lane) {
    const bool b1 = (quad_lane & 2) != 0, b0 = (quad_lane & 1) != 0;

    // Exchange with lane q ^ 2 the two words whose destination differs from q in bit 1
    const uint32_t keep_lo = b1 ? w[2] : w[0];  // for lane (q & 2) | 0, from q
    const uint32_t keep_hi = b1 ? w[3] : w[1];  // for lane (q & 2) | 1, from q
    const uint32_t recv_lo = __shfl_xor_sync(0xffffffffu, b1 ? w[0] : w[2], 2);  // for (q & 2) | 0, from q ^ 2
    const uint32_t recv_hi = __shfl_xor_sync(0xffffffffu, b1 ? w[1] : w[3], 2);  // for (q & 2) | 1, from q ^ 2

    // Exchange with lane q ^ 1 the two words meant for it
    const uint32_t own_self = b0 ? keep_hi : keep_lo;   // from q
    const uint32_t own_other = b0 ? recv_hi : recv_lo;  // from q ^ 2
    const uint32_t got_self = __shfl_xor_sync(0xffffffffu, b0 ? keep_lo : keep_hi, 1);   // from q ^ 1
    const uint32_t got_other = __shfl_xor_sync(0xffffffffu, b0 ? recv_lo : recv_hi, 1);  // from q ^ 3

    // Order by source lane: e_* come from lanes with bit 1 equal to q's, f_* from the other pair
    const uint32_t e_even = b0 ? got_self : own_self, e_odd = b0 ? own_self : got_self;
    const uint32_t f_even = b0 ? got_other : own_other, f_odd = b0 ? own_other : got_other;
    t[0] = b1 ? f_even : e_even;
    t[1] = b1 ? f_odd : e_odd;
    t[2] = b1 ? e_even : f_even;
    t[3] = b1 ? e_odd : f_odd;
}

}  // namespace megamoe::epilogue
