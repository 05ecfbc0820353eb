// Consumer side of the GEMM pipeline: a math warpgroup runs WGMMA over each 128-K block into a fresh
// partial accumulator, then promotes it into the fp32 accumulator with the activation and weight scales:
// acc += partial * sfa[row] * sfb (DESIGN section 4: promotion per block).
#pragma once

#include "common/wgmma.cuh"
#include "gemm/kblock_trace.cuh"
#include "gemm/pipeline.cuh"
#include "gemm/traits.cuh"

namespace megamoe::gemm {

using WGMMA = ptx::WGMMA_M64N128K32_E4M3;

// Where this thread's accumulator values sit in the tile (see WGMMA_M64N128K32_E4M3's fragment).
struct Fragment {
    uint32_t row;  // tile row of d[4 j + 0, 1]; d[4 j + 2, 3] is row + 8
    uint32_t col;  // tile column of d[4 j + 0] is col + 8 j; d[4 j + 1] is one to the right

    MEGAMOE_DEVICE static Fragment of(uint32_t math_wg_idx, uint32_t thread_in_wg) {
        const uint32_t warp_in_wg = thread_in_wg / 32, lane = thread_in_wg % 32;
        return {math_wg_idx * 64 + warp_in_wg * 16 + lane / 4, (lane % 4) * 2};
    }
};

// The weight SFs of one tile, one float per K block, read with __ldg once per tile and held in registers: lane l
// of every warp holds K blocks l and l + 32; a K block's SF is a warp shuffle away. (Read per K block with __ldg
// instead, the load, its 64-bit address arithmetic and the wait for it cost ~9% of the math warps' samples: ncu,
// session 9.) Load it early (before the previous tile's epilogue) to hide the latency.
struct WeightScales {
    float first_lo, first_hi;    // L1: gate row; L2: the tile's row
    float second_lo, second_hi;  // L1: up row; L2: unused

    // w_sf is [E, N / 128, K / 128]. L1 (interleaved tile n holds gate rows [64 n, 64 n + 64) and up rows
    // [I + 64 n, ...)): gate SF row n / 2, up SF row I / 128 + n / 2.
    template <typename T>
    MEGAMOE_DEVICE static WeightScales load(const float* w_sf, uint32_t expert_idx, uint32_t n_block_idx,
                                            uint32_t lane) {
        static_assert(T::kNumKBlocks <= 64, "a tile's weight SFs fit two registers per lane and row (K <= 8192)");
        const float* expert_sf = w_sf + expert_idx * T::kNumNBlocks * T::kNumKBlocks;
        const float* first = expert_sf + (T::kScaleMode == ScaleMode::kL1GateUp ? n_block_idx / 2 : n_block_idx) *
                                             T::kNumKBlocks;
        // One row's K blocks lane and lane + 32 (0 past the row's end)
        const auto load_row = [lane](const float* row, float& lo, float& hi) {
            lo = lane < T::kNumKBlocks ? __ldg(row + lane) : 0.0f;
            hi = lane + 32 < T::kNumKBlocks ? __ldg(row + lane + 32) : 0.0f;
        };
        WeightScales ws;
        load_row(first, ws.first_lo, ws.first_hi);
        if constexpr (T::kScaleMode == ScaleMode::kL1GateUp) {
            load_row(first + (T::kNumNBlocks / 2) * T::kNumKBlocks, ws.second_lo, ws.second_hi);
        } else {
            ws.second_lo = ws.first_lo;
            ws.second_hi = ws.first_hi;
        }
        return ws;
    }

    // Branch-free (may run while WGMMA is in flight): a select and a shuffle
    MEGAMOE_DEVICE float first_at(uint32_t k_block_idx) const {
        return __shfl_sync(0xffffffffu, k_block_idx < 32 ? first_lo : first_hi, k_block_idx % 32);
    }
    MEGAMOE_DEVICE float second_at(uint32_t k_block_idx) const {
        return __shfl_sync(0xffffffffu, k_block_idx < 32 ? second_lo : second_hi, k_block_idx % 32);
    }
};

// Issue the WGMMAs of K steps [kFirst, kLast) of the stage into `d` (the first one overwrites d).
template <typename T, uint32_t kFirst, uint32_t kLast>
MEGAMOE_DEVICE void issue_k_steps(uint64_t desc_a, uint64_t desc_b, float (&d)[WGMMA::kNumAccum]) {
    #pragma unroll
    for (uint32_t k = kFirst; k < kLast; ++ k)
        WGMMA::mma(ptx::advance_smem_desc(desc_a, k * T::WGMMA_K), ptx::advance_smem_desc(desc_b, k * T::WGMMA_K), d,
                   k != kFirst);
}

// acc[4 j + 0, 1] += d * scale(row r, chunk j), acc[4 j + 2, 3] += d * scale(row r + 8, chunk j), where the
// scale of an even chunk is `*_even` (L1: gate columns) and of an odd chunk `*_odd` (L1: up columns).
MEGAMOE_DEVICE void promote(float (&acc)[WGMMA::kNumAccum], const float (&d)[WGMMA::kNumAccum], float row0_even,
                            float row0_odd, float row8_even, float row8_odd) {
    #pragma unroll
    for (uint32_t j = 0; j < WGMMA::N / 8; ++ j) {
        const float s0 = j % 2 == 0 ? row0_even : row0_odd;
        const float s8 = j % 2 == 0 ? row8_even : row8_odd;
        acc[4 * j + 0] = fmaf(d[4 * j + 0], s0, acc[4 * j + 0]);
        acc[4 * j + 1] = fmaf(d[4 * j + 1], s0, acc[4 * j + 1]);
        acc[4 * j + 2] = fmaf(d[4 * j + 2], s8, acc[4 * j + 2]);
        acc[4 * j + 3] = fmaf(d[4 * j + 3], s8, acc[4 * j + 3]);
    }
}

// What one K block's WGMMAs and promotion read besides the accumulators: the stage's descriptors, the
// activation SFs of this thread's two rows (per 64 K in L2 mode: lo, hi) and the weight SFs.
struct BlockOperands {
    uint64_t desc_a, desc_b;
    float sfa0_lo, sfa8_lo, sfa0_hi, sfa8_hi;
    float sfb_even, sfb_odd;
};

// Read the operands of K block `k_block_idx` from the stage at `state` (its full barrier already waited for).
template <typename T>
MEGAMOE_DEVICE BlockOperands read_operands(const GemmSmem<T>& smem, const PipelineState<T::kNumStages>& state,
                                           const WeightScales& weight_scales, uint32_t k_block_idx,
                                           uint32_t a_offset, uint32_t sf_row0, uint32_t sf_row8) {
    constexpr uint32_t kHiOffset = T::kScaleMode == ScaleMode::kL2Per64 ? T::BLOCK_M : 0;
    const float* sfa = smem.sfa(state.stage);
    BlockOperands ops;
    ops.desc_a = ptx::make_smem_desc_k_major_sw128_at(smem.a_addr(state.stage) + a_offset);
    ops.desc_b = ptx::make_smem_desc_k_major_sw128_at(smem.b_addr(state.stage));
    ops.sfa0_lo = sfa[sf_row0];
    ops.sfa8_lo = sfa[sf_row8];
    ops.sfa0_hi = sfa[kHiOffset + sf_row0];
    ops.sfa8_hi = sfa[kHiOffset + sf_row8];
    ops.sfb_even = weight_scales.first_at(k_block_idx);
    ops.sfb_odd = T::kScaleMode == ScaleMode::kL1GateUp ? weight_scales.second_at(k_block_idx) : ops.sfb_even;
    return ops;
}

// One K block: issue its WGMMAs, and while they run wait for the next stage and read its operands
// (kPrefetch: not for the tile's last block, whose successor belongs to a tile that may not exist), then promote.
// NOTES: L2 mode computes each 128-K block as its two per-64 SF halves into two partials, committed as two
// WGMMA groups, to promote the first half while the tensor cores still run the second (wait_group 1); ptxas
// however sinks most of those FFMAs below wait_group 0, which has no register dependency on them (notes/gemm.md,
// session 8). The same split in L1 mode (both halves with the block's scale) measured slower on the H200 (943 vs
// 991 TFLOP/s at 32 x 1536 x 4096 x 4096: twice the promotion FMAs), so L1 keeps one group per block.
// Each warp releases the stage after its wait_group 0 (its reads of the stage are complete); the empty barrier
// counts every math warp. Between the first WGMMA and the last wait only branch-free code may run: a C++ branch
// or loop while WGMMA is in flight makes ptxas serialize the pipeline (C7518). Hence the next stage's wait is
// one asm block (ptx::mbarrier_wait_inline_at) whose timeout is reported after the WGMMA wait.
template <typename T, bool kPrefetch, bool kTrace>
MEGAMOE_DEVICE void consume_k_block(const Pipeline<T::kNumStages>& pipeline, PipelineState<T::kNumStages>& state,
                                    const GemmSmem<T>& smem, const WeightScales& weight_scales,
                                    uint32_t k_block_idx, uint32_t a_offset, uint32_t sf_row0, uint32_t sf_row8,
                                    uint32_t lane, BlockOperands& ops, float (&acc)[WGMMA::kNumAccum],
                                    float (&d_lo)[WGMMA::kNumAccum], const DeviceEnv& env,
                                    KBlockTrace<kTrace>* trace) {
    if constexpr (kTrace)
        trace->mark(KBlockEvent::kIssue);
    const BlockOperands cur = ops;
    PipelineState<T::kNumStages> next = state;
    next.advance();
    uint64_t waited_ns = 0;
    if constexpr (T::kScaleMode == ScaleMode::kL1GateUp) {
        // One group over the whole block, one promotion
        ptx::fence_operands(d_lo);
        ptx::wgmma_fence();
        issue_k_steps<T, 0, T::kNumKSteps>(cur.desc_a, cur.desc_b, d_lo);
        ptx::wgmma_commit_group();
        if constexpr (kPrefetch) {
            waited_ns = pipeline.consumer_wait_inline(env, next);
            ops = read_operands<T>(smem, next, weight_scales, k_block_idx + 1, a_offset, sf_row0, sf_row8);
        }
        ptx::wgmma_wait_group<0>();
        ptx::fence_operands(d_lo);
        if constexpr (kTrace)
            trace->mark(KBlockEvent::kDone);
        pipeline.consumer_release(state, lane);
        promote(acc, d_lo, cur.sfa0_lo * cur.sfb_even, cur.sfa0_lo * cur.sfb_odd, cur.sfa8_lo * cur.sfb_even,
                cur.sfa8_lo * cur.sfb_odd);
    } else {
        // Two groups, one per 64-K SF half; the first half's promotion may overlap the second half (see NOTES)
        float d_hi[WGMMA::kNumAccum];
        ptx::fence_operands(d_lo);
        ptx::fence_operands(d_hi);
        ptx::wgmma_fence();
        issue_k_steps<T, 0, T::kNumKSteps / 2>(cur.desc_a, cur.desc_b, d_lo);
        ptx::wgmma_commit_group();
        issue_k_steps<T, T::kNumKSteps / 2, T::kNumKSteps>(cur.desc_a, cur.desc_b, d_hi);
        ptx::wgmma_commit_group();
        if constexpr (kPrefetch) {
            waited_ns = pipeline.consumer_wait_inline(env, next);
            ops = read_operands<T>(smem, next, weight_scales, k_block_idx + 1, a_offset, sf_row0, sf_row8);
        }
        ptx::wgmma_wait_group<1>();
        ptx::fence_operands(d_lo);
        promote(acc, d_lo, cur.sfa0_lo * cur.sfb_even, cur.sfa0_lo * cur.sfb_odd, cur.sfa8_lo * cur.sfb_even,
                cur.sfa8_lo * cur.sfb_odd);
        ptx::wgmma_wait_group<0>();
        ptx::fence_operands(d_hi);
        if constexpr (kTrace)
            trace->mark(KBlockEvent::kDone);
        pipeline.consumer_release(state, lane);
        promote(acc, d_hi, cur.sfa0_hi * cur.sfb_even, cur.sfa0_hi * cur.sfb_odd, cur.sfa8_hi * cur.sfb_even,
                cur.sfa8_hi * cur.sfb_odd);
    }
    if (waited_ns != 0)
        pipeline.report_full_timeout(env, next, waited_ns);
    if constexpr (kTrace) {
        trace->mark(KBlockEvent::kPromoted);
        trace->next();
    }
    state = next;
}

// Accumulate one tile into `acc` (which the caller zeroes): all K blocks, promoted per block.
// kFeedOnly (profiling): wait for each stage and release it without any math, to measure what the producers
// alone sustain.
template <typename T, bool kTrace = false, bool kFeedOnly = false>
MEGAMOE_DEVICE void consume_tile(const Pipeline<T::kNumStages>& pipeline, PipelineState<T::kNumStages>& state,
                                 const GemmSmem<T>& smem, const WeightScales& weight_scales,
                                 uint32_t math_wg_idx, uint32_t thread_in_wg, float (&acc)[WGMMA::kNumAccum],
                                 const DeviceEnv& env, KBlockTrace<kTrace>* trace = nullptr) {
    const Fragment frag = Fragment::of(math_wg_idx, thread_in_wg);
    const uint32_t lane = thread_in_wg % 32;
    const uint32_t a_offset = math_wg_idx * T::WGMMA_M * T::BLOCK_K;
    // BLOCK_M = 32: warps 2, 3 hold WGMMA rows 32..63, which are discarded; `% BLOCK_M` keeps their SF reads
    // inside the stage without a branch
    const uint32_t sf_row0 = frag.row % T::BLOCK_M, sf_row8 = (frag.row + 8) % T::BLOCK_M;

    if constexpr (kFeedOnly) {
        for (uint32_t k_block_idx = 0; k_block_idx < T::kNumKBlocks; ++ k_block_idx) {
            pipeline.consumer_wait(env, state);
            pipeline.consumer_release(state, lane);
            state.advance();
        }
        return;
    }

    // The first block's stage is waited for here; every later one while its predecessor's WGMMAs run
    pipeline.consumer_wait(env, state);
    if constexpr (kTrace)
        trace->mark(KBlockEvent::kStageReady);
    BlockOperands ops = read_operands<T>(smem, state, weight_scales, 0, a_offset, sf_row0, sf_row8);
    float d_lo[WGMMA::kNumAccum];
    #pragma unroll 1
    for (uint32_t k_block_idx = 0; k_block_idx + 1 < T::kNumKBlocks; ++ k_block_idx)
        consume_k_block<T, true>(pipeline, state, smem, weight_scales, k_block_idx, a_offset, sf_row0, sf_row8,
                                 lane, ops, acc, d_lo, env, trace);
    consume_k_block<T, false>(pipeline, state, smem, weight_scales, T::kNumKBlocks - 1, a_offset, sf_row0, sf_row8,
                              lane, ops, acc, d_lo, env, trace);
}

}  // namespace megamoe::gemm
