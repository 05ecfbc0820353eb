// Consumer side of the GEMM pipeline: a math warpgroup runs WGMMA over each 128-K block into a fresh
// partial accumulator, then promotes it into the fp32 accumulator with the activation and weight scales:
// acc += partial * sfa[row] * sfb (DESIGN section 4: promotion per block).
#pragma once

#include <type_traits>
#include <utility>

#include "common/acc_fragment.cuh"
#include "common/wgmma.cuh"
#include "gemm/kblock_trace.cuh"
#include "gemm/pipeline.cuh"
#include "gemm/traits.cuh"

namespace megamoe::gemm {

using WGMMA = ptx::WGMMA_M64N128K32_E4M3;

// The weight SFs of one tile, one float per K block, read with __ldg once per tile and held in registers: lane l
// of every warp holds K blocks l and l + 32; a K block's SF is a warp shuffle away. (Read per K block with __ldg
// instead, the load, its 64-bit address arithmetic and the wait for it cost ~9% of the math warps' samples: ncu,
// prefill 32 x 1536 x 4096 x 4096.) Load it early (before the previous tile's epilogue) to hide the latency.
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
            // Unused in L2 mode (the consumer reads first_at for both halves). NOTES: not a copy of first_*: a
            // register copy waits for the loads, which took 700-1800 SM clocks under the GEMM's traffic in the
            // kernels that load the next task's SFs right after a mainloop.
            ws.second_lo = 0.0f;
            ws.second_hi = 0.0f;
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
    for (uint32_t k = kFirst; k < kLast; ++ k) {
        const uint64_t a = ptx::advance_smem_desc(desc_a, k * T::WGMMA_K);
        const uint64_t b = ptx::advance_smem_desc(desc_b, k * T::WGMMA_K);
        if (k == kFirst)
            WGMMA::mma<false>(a, b, d);
        else
            WGMMA::mma<true>(a, b, d);
    }
}

// The promotion scales of one WGMMA group for this thread's rows r and r + 8: sfa[row] * sfb of even 8-column
// chunks (L1: gate columns) and odd chunks (L1: up columns).
struct PromoteScales {
    float row0_even, row0_odd, row8_even, row8_odd;

    MEGAMOE_DEVICE static PromoteScales of(float sfa0, float sfa8, float sfb_even, float sfb_odd) {
        return {sfa0 * sfb_even, sfa0 * sfb_odd, sfa8 * sfb_even, sfa8 * sfb_odd};
    }
};

// acc[4 j + 0, 1] += d * scale(row r, chunk j), acc[4 j + 2, 3] += d * scale(row r + 8, chunk j).
MEGAMOE_DEVICE void promote(float (&acc)[WGMMA::kNumAccum], const float (&d)[WGMMA::kNumAccum],
                            const PromoteScales& s) {
    #pragma unroll
    for (uint32_t j = 0; j < WGMMA::N / 8; ++ j) {
        const float s0 = j % 2 == 0 ? s.row0_even : s.row0_odd;
        const float s8 = j % 2 == 0 ? s.row8_even : s.row8_odd;
        acc[4 * j + 0] = fmaf(d[4 * j + 0], s0, acc[4 * j + 0]);
        acc[4 * j + 1] = fmaf(d[4 * j + 1], s0, acc[4 * j + 1]);
        acc[4 * j + 2] = fmaf(d[4 * j + 2], s8, acc[4 * j + 2]);
        acc[4 * j + 3] = fmaf(d[4 * j + 3], s8, acc[4 * j + 3]);
    }
}

// Wait for and release the K blocks of one tile without any math (kFeedOnly profiling: the producers' rate).
template <typename T>
MEGAMOE_DEVICE void drain_tile(const Pipeline<T::kNumStages, T::kClusterN>& pipeline,
                               PipelineState<T::kNumStages>& state, uint32_t lane, const DeviceEnv& env) {
    for (uint32_t k_block_idx = 0; k_block_idx < T::kNumKBlocks; ++ k_block_idx) {
        pipeline.consumer_wait(env, state);
        pipeline.consumer_release(state, lane);
        state.advance();
    }
}

// f(std::integral_constant<uint32_t, i>{}) for each i of the sequence, in order (a compile-time unrolled loop)
template <typename F, uint32_t... kIdx>
MEGAMOE_DEVICE void for_each_index(std::integer_sequence<uint32_t, kIdx...>, const F& f) {
    (f(std::integral_constant<uint32_t, kIdx>{}), ...);
}

// step(kb, has_prev, has_next) for K blocks 0 .. kNumKBlocks - 1 (has_prev / has_next: std::integral_constant, so
// that no runtime branch runs while a group is in flight). Up to kMaxPeeled blocks every block is peeled; beyond,
// block 0, a loop of kLoopBlocks blocks per iteration (#pragma unroll 1), the middle blocks the loop left, the last.
// (ptxas spilled with short loops: 8-996 B for L2 mode's pair loop at 4, 5 and 7 blocks; L2 mode spilled whole
// partials around the back edge of a loop over single blocks, hence its pairs.)
template <uint32_t kNumKBlocks, uint32_t kMaxPeeled, uint32_t kLoopBlocks, typename Step>
MEGAMOE_DEVICE void walk_k_blocks(const Step& step) {
    constexpr std::true_type kYes{};
    constexpr std::false_type kNo{};
    step(0u, kNo, std::integral_constant<bool, (kNumKBlocks > 1)>{});
    if constexpr (kNumKBlocks > 1 and kNumKBlocks <= kMaxPeeled) {
        for_each_index(std::make_integer_sequence<uint32_t, kNumKBlocks - 2>{},
                       [&](auto idx) { step(decltype(idx)::value + 1, kYes, kYes); });
    } else if constexpr (kNumKBlocks > 1) {
        constexpr uint32_t kNumLeft = (kNumKBlocks - 2) % kLoopBlocks;
        #pragma unroll 1
        for (uint32_t kb = 1; kb + kLoopBlocks < kNumKBlocks; kb += kLoopBlocks)
            for_each_index(std::make_integer_sequence<uint32_t, kLoopBlocks>{},
                           [&](auto idx) { step(kb + decltype(idx)::value, kYes, kYes); });
        for_each_index(std::make_integer_sequence<uint32_t, kNumLeft>{},
                       [&](auto idx) { step(kNumKBlocks - 1 - kNumLeft + decltype(idx)::value, kYes, kYes); });
    }
    if constexpr (kNumKBlocks > 1)
        step(kNumKBlocks - 1, kYes, kNo);
}

// Accumulate one tile into `acc` (which the caller zeroes), promoted per WGMMA group (DESIGN section 4), with two
// partial accumulators so that each group runs while the previous group's partial is promoted: the tensor cores do
// not wait for this warpgroup's FFMAs (the other warpgroup's groups fill what remains). L1: block kb runs into one
// partial while block kb - 1's completed partial is promoted; L2: the block's first 64-K half runs while the
// previous block's second half is promoted, its second half while its first half is promoted. Under the H200's
// power cap this sustains ~4% more than promoting after each wait (scripts/power_gemm.py, notes/gemm.md).
// kPrefetch: while a block's last group runs (after the promotion), wait for the next block's stage and read its
// scales, so that the next group is issued right after the wait: the stage wait, the SF loads and shuffles leave
// the chain between two groups of a warpgroup (which the other warpgroup's group must cover: 128 tensor clocks
// in L2 mode).
// NOTES: every group is waited for (wait_group 0) before the next is issued, so no WGMMA is in flight across a
// branch or the loop's back edge: ptxas serializes the pipeline (C7514) when a loop carries a group in flight into
// code that reads the other partial. Promotions only read partials whose group completed, and run while a later
// group is in flight: a register anti-dependency (the next WGMMA into the same partial) keeps ptxas from sinking
// them below the next wait. A stage wait in flight is one asm block (no C++ loop or trap path there: C7518), whose
// timeout is reported after the group's wait; whether a next block exists is a compile-time fact of each call
// (the first and last blocks are peeled), never a branch in flight. Blocking stage waits run with nothing in flight.
// Every K-block count from 1 to 64 compiles without spills in both modes (ptxas, BLOCK_M 128: notes/gemm.md).
// kSkipPadding (with num_valid_rows, the tile's rows that belong to its expert): at BLOCK_M 128, warpgroup 1 of a
// tile of at most 64 rows (an expert's last m-block) returns at once, past the tile's stages, with `acc` as the
// caller set it: its rows are padding, which the epilogues write as zeros or not at all, so the output is the same.
// The TMA-B producer arrives on each stage's empty barrier for its warps (gemm/producer.cuh). Warpgroup 0 then has
// the tensor cores to itself: same-call A/B on an H100 (fused kernel, T 1024: a quarter of the m-blocks are such
// tiles) 463-468 -> 450-456 us, the expert-FFN unit kernel on the same rows 445-451 -> 435-441 (notes/fused.md).
// NOTES: warpgroup 1 skips ahead of the ring by the tile's K blocks; it must not wait on a stage of its next tile
// before warpgroup 0 is done with this one (a parity wait cannot tell phases two apart). Callers must join both
// warpgroups at a named barrier after this call (the expert-FFN and fused epilogues do; the standalone GEMM's
// per-warpgroup stores do not, so it does not skip), which warpgroup 0 reaches only after its last wait.
template <typename T, bool kTrace = false, bool kFeedOnly = false, bool kPrefetch = true, bool kSkipPadding = false>
MEGAMOE_DEVICE void consume_tile(const Pipeline<T::kNumStages, T::kClusterN>& pipeline,
                                 PipelineState<T::kNumStages>& state, const GemmSmem<T>& smem,
                                 const WeightScales& weight_scales, uint32_t math_wg_idx, uint32_t thread_in_wg,
                                 float (&acc)[WGMMA::kNumAccum], const DeviceEnv& env,
                                 KBlockTrace<kTrace>* trace = nullptr, uint32_t num_valid_rows = T::BLOCK_M) {
    constexpr bool kSkips = kSkipPadding and T::kNumMathWarpgroups > 1;
    static_assert(not kSkips or (T::kNumMathWarpgroups == 2 and T::kClusterN == 1), "one warpgroup may skip");
    if constexpr (kSkips) {
        // Warpgroup 1 with only padding rows: past the tile's stages, which warpgroup 0 releases for both
        if (T::second_warpgroup_idle(num_valid_rows) and math_wg_idx != 0) {
            state.template advance_by<T::kNumKBlocks>();
            return;
        }
    }
    constexpr bool kL1 = T::kScaleMode == ScaleMode::kL1GateUp;
    constexpr uint32_t kNumKBlocks = T::kNumKBlocks;
    constexpr uint32_t kHiOffset = kL1 ? 0 : T::BLOCK_M;
    // (std::integral_constant arguments: C++17 lambdas take no template parameter list)
    constexpr std::integral_constant<uint32_t, 0> kStepsBegin{};
    constexpr std::integral_constant<uint32_t, T::kNumKSteps / 2> kStepsMid{};
    constexpr std::integral_constant<uint32_t, T::kNumKSteps> kStepsEnd{};
    constexpr std::true_type kYes{};
    constexpr std::false_type kNo{};
    constexpr std::integral_constant<bool, (kNumKBlocks > 1)> kFirstHasNext{};
    const AccFragment frag = AccFragment::of(math_wg_idx, thread_in_wg);
    const uint32_t lane = thread_in_wg % 32;
    const uint32_t a_offset = math_wg_idx * T::WGMMA_M * T::BLOCK_K;
    // BLOCK_M = 32: warps 2, 3 hold WGMMA rows 32..63, which are discarded; `% BLOCK_M` keeps their SF reads
    // inside the stage without a branch
    const uint32_t sf_row0 = frag.row % T::BLOCK_M, sf_row8 = (frag.row + 8) % T::BLOCK_M;
    if constexpr (kFeedOnly) {
        drain_tile<T>(pipeline, state, lane, env);
        return;
    }

    // The promotion scales of block kb from the stage at `at`: L1 one set, L2 per 64-K half (branch-free)
    PromoteScales lo, hi;
    const auto read_scales = [&](const PipelineState<T::kNumStages>& at, uint32_t kb) {
        const float* sfa = smem.sfa(at.stage);
        const float sfb_even = weight_scales.first_at(kb);
        const float sfb_odd = kL1 ? weight_scales.second_at(kb) : sfb_even;
        lo = PromoteScales::of(sfa[sf_row0], sfa[sf_row8], sfb_even, sfb_odd);
        hi = PromoteScales::of(sfa[kHiOffset + sf_row0], sfa[kHiOffset + sf_row8], sfb_even, sfb_odd);
    };
    // Block kb's stage, unless the previous block prefetched it: wait with nothing in flight, read its scales
    // (traced as ready when its wait returned, or, prefetched, when this block starts)
    const auto acquire = [&](uint32_t kb, auto prefetched) {
        if constexpr (not decltype(prefetched)::value) {
            pipeline.consumer_wait(env, state);
            read_scales(state, kb);
        }
        if constexpr (kTrace) {
            trace->mark(KBlockEvent::kStageReady);
            trace->mark(KBlockEvent::kIssue);
        }
    };
    // In flight: wait for block kb + 1's stage and read its scales (its timeout is reported by `release`)
    uint64_t waited_ns = 0;
    const auto prefetch = [&](uint32_t kb, auto has_next) {
        if constexpr (kPrefetch and decltype(has_next)::value) {
            PipelineState<T::kNumStages> next = state;
            next.advance();
            waited_ns = pipeline.consumer_wait_inline(env, next);
            read_scales(next, kb + 1);
        }
    };
    // Issue K steps [first, last) of the stage into d as one group
    const auto issue = [&](auto first, auto last, float (&d)[WGMMA::kNumAccum]) {
        const uint64_t desc_a = ptx::make_smem_desc_k_major_sw128_at(smem.a_addr(state.stage) + a_offset);
        const uint64_t desc_b = ptx::make_smem_desc_k_major_sw128_at(smem.b_addr(state.stage));
        ptx::wgmma_fence();
        issue_k_steps<T, decltype(first)::value, decltype(last)::value>(desc_a, desc_b, d);
        ptx::wgmma_commit_group();
    };
    const auto complete = [&](float (&d)[WGMMA::kNumAccum]) {
        ptx::wgmma_wait_group<0>();
        ptx::fence_operands(d);
    };
    // The stage's last group completed: release it, trace the block, report a timed-out prefetch wait
    const auto release = [&](auto has_next) {
        pipeline.consumer_release(state, lane);
        if constexpr (kTrace) {
            trace->mark(KBlockEvent::kDone);
            trace->next();
        }
        state.advance();
        if constexpr (kPrefetch and decltype(has_next)::value)
            pipeline.report_full_timeout(env, state, waited_ns);
    };
    // (has_prev: false for block 0 only, which has no partial to promote; has_next: false for the last block. Both
    // std::integral_constant: a runtime branch there would run while a group is in flight)
    const auto prefetched = [](auto has_prev) {
        return std::integral_constant<bool, kPrefetch and decltype(has_prev)::value>{};
    };

    float d0[WGMMA::kNumAccum], d1[WGMMA::kNumAccum];
    if constexpr (kL1) {
        // Block kb into d_cur while block kb - 1's partial (d_prev, scales prev) is promoted
        PromoteScales prev;
        const auto step = [&](uint32_t kb, float (&d_cur)[WGMMA::kNumAccum], float (&d_prev)[WGMMA::kNumAccum],
                              auto has_prev, auto has_next) {
            acquire(kb, prefetched(has_prev));
            issue(kStepsBegin, kStepsEnd, d_cur);
            if constexpr (decltype(has_prev)::value)
                promote(acc, d_prev, prev);
            prev = lo;
            prefetch(kb, has_next);
            complete(d_cur);
            release(has_next);
        };
        // Block b runs into d[b % 2]: block 0 peeled, then pairs, then the odd middle block if any, then the last
        step(0, d0, d1, kNo, kFirstHasNext);
        if constexpr (kNumKBlocks == 1) {
            promote(acc, d0, prev);
        } else {
            #pragma unroll 1
            for (uint32_t kb = 1; kb + 2 < kNumKBlocks; kb += 2) {
                step(kb, d1, d0, kYes, kYes);
                step(kb + 1, d0, d1, kYes, kYes);
            }
            if constexpr (kNumKBlocks % 2 == 1) {
                // Middle block kNumKBlocks - 2 is odd, the last one even
                step(kNumKBlocks - 2, d1, d0, kYes, kYes);
                step(kNumKBlocks - 1, d0, d1, kYes, kNo);
                promote(acc, d0, prev);
            } else {
                step(kNumKBlocks - 1, d1, d0, kYes, kNo);
                promote(acc, d1, prev);
            }
        }
    } else {
        // d1 holds the previous block's completed second half (scales prev_hi)
        PromoteScales prev_hi;
        const auto block = [&](uint32_t kb, auto has_prev, auto has_next) {
            acquire(kb, prefetched(has_prev));
            issue(kStepsBegin, kStepsMid, d0);
            if constexpr (decltype(has_prev)::value)
                promote(acc, d1, prev_hi);
            complete(d0);
            issue(kStepsMid, kStepsEnd, d1);
            promote(acc, d0, lo);
            prev_hi = hi;
            prefetch(kb, has_next);
            complete(d1);
            release(has_next);
        };
        walk_k_blocks<kNumKBlocks, 7, 2>(block);
        promote(acc, d1, prev_hi);
    }
}

}  // namespace megamoe::gemm
