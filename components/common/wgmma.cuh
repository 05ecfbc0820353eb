// WGMMA (sm_90a): shared-memory matrix descriptors with the 128 B swizzle, FP8 e4m3 x e4m3 -> f32
// m64n128k32, the fence / commit / wait protocol, and setmaxnreg.
#pragma once

#include "utils.cuh"

namespace megamoe::ptx {

// Shared-memory matrix descriptor of a K-major operand tile stored with the 128 B swizzle: rows of
// 128 B (one BLOCK_K = 128 FP8 row), 8-row core groups 1024 B apart. Fields (PTX ISA "matrix
// descriptor"): start address >> 4 in bits [0, 14), leading-dimension byte offset >> 4 in [16, 30)
// (unused for swizzled K-major layouts whose K extent fits in the swizzle atom: set to 1), stride-
// dimension byte offset >> 4 in [32, 46) (1024 B between 8-row groups), base offset [49, 52) (0: tiles
// are 1024 B aligned), swizzle mode in [62, 64) (1 = 128 B).
// smem_address: the tile's shared-window address (smem_addr).
MEGAMOE_DEVICE uint64_t make_smem_desc_k_major_sw128_at(uint32_t smem_address) {
    const uint64_t addr = smem_address;
    return ((addr & 0x3ffff) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

// Advance a descriptor's start address by `num_bytes` (a multiple of 16; K steps of 32 FP8 = 32 B stay
// inside the 128 B swizzle row: the hardware applies the swizzle to the advanced address).
MEGAMOE_DEVICE uint64_t advance_smem_desc(uint64_t desc, uint32_t num_bytes) {
    return desc + (num_bytes >> 4);
}

// Order register accesses to accumulators before the next wgmma reads or writes them.
MEGAMOE_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }

MEGAMOE_DEVICE void wgmma_commit_group() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }

template <int kNumPending>
MEGAMOE_DEVICE void wgmma_wait_group() {
    static_assert(kNumPending >= 0 and kNumPending <= 7, "wgmma.wait_group takes 0..7");
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kNumPending) : "memory");
}

// Keeps the compiler from moving accesses of an accumulator register across wgmma fences / waits.
MEGAMOE_DEVICE void fence_operand(float& reg) { asm volatile("" : "+f"(reg)::"memory"); }

template <int kNumRegs>
MEGAMOE_DEVICE void fence_operands(float (&regs)[kNumRegs]) {
    #pragma unroll
    for (int i = 0; i < kNumRegs; ++ i)
        fence_operand(regs[i]);
}

// The 64 accumulator operands of an m64n128 WGMMA: their placeholders and their (read-write) constraints
#define MEGAMOE_WGMMA_N128_PLACEHOLDERS                      \
    "{%0, %1, %2, %3, %4, %5, %6, %7, "                      \
    "%8, %9, %10, %11, %12, %13, %14, %15, "                 \
    "%16, %17, %18, %19, %20, %21, %22, %23, "               \
    "%24, %25, %26, %27, %28, %29, %30, %31, "               \
    "%32, %33, %34, %35, %36, %37, %38, %39, "               \
    "%40, %41, %42, %43, %44, %45, %46, %47, "               \
    "%48, %49, %50, %51, %52, %53, %54, %55, "               \
    "%56, %57, %58, %59, %60, %61, %62, %63}"
#define MEGAMOE_WGMMA_N128_ACCUM \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// D(64x128, f32) (+)= A(64x32, e4m3, smem) * B(128x32, e4m3, smem)^T; kAccumulate false overwrites D (scale-d an
// immediate: no predicate register).
// Which thread holds which values of D: common/acc_fragment.cuh.
// NOTES: D stays read-write ("+f") even when overwritten. Declared write-only ("=f"), the overwritten partial
// would be dead between its promotion and its next group, but ptxas then re-places the accumulator blocks
// across loop back edges and spills whole partials (measured: 556-584 B of spills in the L2-mode consumer).
struct WGMMA_M64N128K32_E4M3 {
    static constexpr uint32_t M = 64, N = 128, K = 32;
    static constexpr uint32_t kNumAccum = M * N / 128;

    template <bool kAccumulate>
    MEGAMOE_DEVICE static void mma(uint64_t desc_a, uint64_t desc_b, float (&d)[kNumAccum]) {
        asm volatile("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " MEGAMOE_WGMMA_N128_PLACEHOLDERS
                     ", %64, %65, %66, 1, 1;\n"
                     : MEGAMOE_WGMMA_N128_ACCUM
                     : "l"(desc_a), "l"(desc_b), "n"(kAccumulate ? 1 : 0));
    }
};

// Register reallocation between warpgroups (needs a register cap at kernel entry: __launch_bounds__
// with min blocks 1; each warpgroup role must execute it on one uniform branch).
template <uint32_t kNumRegs>
MEGAMOE_DEVICE void setmaxnreg_inc() {
    static_assert(kNumRegs % 8 == 0 and kNumRegs >= 24 and kNumRegs <= 256, "setmaxnreg: multiple of 8 in [24, 256]");
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kNumRegs));
}

template <uint32_t kNumRegs>
MEGAMOE_DEVICE void setmaxnreg_dec() {
    static_assert(kNumRegs % 8 == 0 and kNumRegs >= 24 and kNumRegs <= 256, "setmaxnreg: multiple of 8 in [24, 256]");
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kNumRegs));
}

}  // namespace megamoe::ptx
