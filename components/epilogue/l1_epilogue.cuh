// L1 epilogue (DESIGN section 4): the promoted gate/up accumulator of one interleaved L1 tile ->
// swiglu, times the row's top-k weight, per-row amax over the tile's 64 output columns, FP8 requant ->
// staged in shared memory -> one TMA store of the L2 activation tile and one bulk store of its SFs ->
// a release increment of the pool block's L1 completion counter once both have completed.
#pragma once

#include <cuda.h>

#include "common/atomics.cuh"
#include "common/fence.cuh"
#include "common/sync.cuh"
#include "common/tma.cuh"
#include "epilogue/activation.cuh"
#include "epilogue/fragment.cuh"
#include "epilogue/requant.cuh"
#include "epilogue/smem.cuh"

namespace megamoe::epilogue {

// One staging buffer: the FP8 tile, BLOCK_M rows of 64 B row-major (the TMA store's box, no swizzle; a warp's
// 16-byte stores cover 8 whole rows = 512 contiguous bytes, so no bank conflicts), then the tile's BLOCK_M SFs.
// Two buffers alternate between consecutive L1 tiles.
template <uint32_t BLOCK_M>
struct L1Staging {
    static constexpr uint32_t kRowBytes = kL1OutputCols;
    static constexpr uint32_t kSfOffset = BLOCK_M * kRowBytes;
    static constexpr uint32_t kSfBytes = BLOCK_M * sizeof(float);
    static constexpr uint32_t kBufferBytes = align_up<uint32_t>(kSfOffset + kSfBytes, 128);
    static constexpr uint32_t kNumBuffers = 2;
    static constexpr uint32_t kBytes = kNumBuffers * kBufferBytes;
    static_assert(BLOCK_M == 32 or BLOCK_M == 64 or BLOCK_M == 128, "BLOCK_M in {32, 64, 128}");
    static_assert(kSfOffset % 16 == 0 and kSfBytes % 16 == 0, "the SF bulk store needs 16 B size and alignment");
    static_assert(kBufferBytes % 128 == 0, "TMA store sources stay 128 B aligned");

    MEGAMOE_DEVICE static uint8_t* buffer(uint8_t* base, uint32_t idx) { return base + idx * kBufferBytes; }
};

// Everything the L1 epilogue reads or writes besides the accumulator.
struct L1EpilogueArgs {
    const CUtensorMap* act_store_map;  // L2 activations [P, I] e4m3, box {64 columns, BLOCK_M rows}, no swizzle
    const float* topk_weights;         // [BLOCK_M]: the tile's rows' top-k weights (global or shared memory)
    float* act_sf;                     // [I / 64][P] MN-major L2 activation SF (P a multiple of 4)
    uint32_t* done_counts;             // [pool blocks]: finished L1 N blocks of each pool block
    uint32_t num_pool_rows;            // P, the row pitch of act_sf
    float clamp;                       // activation clamp (read only when compiled with it)
};

// publish_batched's asm: entry I of the list (at byte OFF), when it exists (I < n), loaded into `w`, then the
// relaxed increments of its pair (common/atomics.cuh: MEGAMOE_PTX_RED_INC_PAIR).
#define MEGAMOE_L1_LIST_ENTRY(I, OFF)                         \
    "setp.lt.u32 q, " #I ", n;\n"                             \
    "mov.u32 w, 0;\n"                                         \
    "@q ld.volatile.shared.u32 w, [%0+" #OFF "];\n"           \
    MEGAMOE_PTX_RED_INC_PAIR("w", "%1")

// Per math thread across L1 tiles: the staging buffer of the next tile (every thread) and, in the thread that
// issues the stores, the pool blocks of its stored tiles whose completion counters are not yet released: up to
// two, 1 + the block in each 16-bit half, 0 for none (one 32-bit register across the mainloop, where a counter
// pointer took two and spilled).
// NOTES: the release's fence is what costs: of the publish's ~2600 SM clocks per L1 tile at prefill (10% of the
// tile, every math warp waiting at the epilogue's barrier) the bulk wait took ~170, the proxy fence ~60 and the
// release (MEMBAR.ALL.GPU) ~2400, wherever in the tile it ran; run by an idle warp instead it slowed the call
// (notes/fused.md). So two tiles share one fence.
struct L1EpilogueState {
    uint32_t buffer = 0;
    uint32_t pending = 0;  // low half: the newest unpublished tile's 1 + pool block; high half: the one before

    // Store thread, at the start of a tile's epilogue: with two tiles pending, release both; else only wait until
    // the earlier stores have read their staging (the buffer this tile writes was last read two tiles ago).
    MEGAMOE_DEVICE void before_stage(uint32_t* done_counts) {
        if ((pending >> 16) != 0)
            publish_pending(done_counts);
        else
            ptx::bulk_wait_group_read<0>();
    }

    // Store thread: wait for its stores, then release the counters they complete.
    // NOTES: bulk async-groups belong to the issuing thread, so only it can wait for them. wait_group 0 (not
    // .read) waits until the TMA writes of the activations and SFs are complete in global memory (DESIGN 5b);
    // the proxy fence then orders those async-proxy writes before this thread's generic accesses, and
    // fence.acq_rel.gpu followed by the relaxed increments makes each increment a release (one fence for both),
    // which the L2 producer's ld.acquire.gpu pairs with (it fences the async proxy again before its TMA loads).
    // Called before any non-L1 work and at exit, so a counter is never held back while this CTA waits for one
    // (L1 tiles wait for no counter: the schedule's no-deadlock argument stays intact).
    // done_counts: L1EpilogueArgs::done_counts.
    MEGAMOE_DEVICE void publish_pending(uint32_t* done_counts) {
        if (pending != 0) {
            ptx::bulk_wait_group<0>();
            ptx::fence_proxy_async_global();
            ptx::fence_acq_rel_gpu();
            ptx::red_inc_relaxed_gpu_pair(done_counts, pending);
            pending = 0;
        }
    }

    // Store thread, after issuing a tile's stores: at most one tile was pending (before_stage released two).
    // Pool blocks < 65535: the callers check.
    MEGAMOE_DEVICE void push(uint32_t pool_block) {
        pending = (pending << 16) | (pool_block + 1);
    }

    // The batched form (the fused kernel at BLOCK_M 128). A pair of pending blocks moves from the register to a
    // list in shared memory ([0] the number of pairs, then up to kListPairs pairs as `pending` packs them) when its
    // second block is pushed, and the run's last L1 tile releases the list and the register with one fence
    // (publish_batched); with the list full the pair stays in the register, which before_stage then releases.
    // NOTES: with one wave nothing waits for an L1 counter before the CTAs that stored its tiles reach L2 work, so
    // the fence runs about once per CTA and call, not once per two tiles: T 4096 7-13 us faster on an H100. At the
    // decode configs the L2 tiles then start later (T 8 / 128 2.5-4 us slower): they keep the per-pair release.
    // The stash runs after the tile's stores (the accumulators dead), predicated in one asm block: at the start of
    // the epilogue any form of it made the fused kernel's math warps spill 40-356 B.
    static constexpr uint32_t kListPairs = 32;
    static constexpr uint32_t kListBytes = (1 + kListPairs) * 4;

    // `list`: the list's shared-memory address, derived from a pointer the caller holds anyway (the staging
    // area's): from the dynamic shared memory's symbol it took registers across the mainloop and spilled 40-200 B.

    // One thread, before the first tile (a CTA barrier between)
    MEGAMOE_DEVICE static void init_list(uint32_t list) {
        asm volatile("st.volatile.shared.u32 [%0], 0;" ::"r"(list) : "memory");
    }

    MEGAMOE_DEVICE void push_batched(uint32_t list, uint32_t pool_block) {
        asm volatile(
            "{\n"
            ".reg .pred p, q;\n"
            ".reg .u32 n, addr, pair;\n"
            "ld.volatile.shared.u32 n, [%1];\n"
            "setp.ne.u32 p, %0, 0;\n"
            "setp.lt.u32 q, n, %3;\n"
            "and.pred p, p, q;\n"
            "shl.b32 pair, %0, 16;\n"
            "or.b32 pair, pair, %2;\n"
            "add.u32 n, n, 1;\n"
            "mad.lo.u32 addr, n, 4, %1;\n"
            "@p st.volatile.shared.u32 [addr], pair;\n"
            "@p st.volatile.shared.u32 [%1], n;\n"
            "selp.u32 %0, 0, pair, p;\n"
            "}\n"
            : "+r"(pending)
            : "r"(list), "r"(pool_block + 1), "n"(kListPairs)
            : "memory");
    }

    // Store thread: release the list and the register with one fence (nothing when both are empty). Straight-line
    // and predicated, one entry after the other (the same asm as a loop made the fused kernel's math warps spill
    // 160-316 B).
    MEGAMOE_DEVICE void publish_batched(uint32_t list, uint32_t* done_counts) {
        static_assert(kListPairs == 32, "the entries below");
        uint32_t num_pairs;
        asm volatile("ld.volatile.shared.u32 %0, [%1];" : "=r"(num_pairs) : "r"(list) : "memory");
        if ((pending | num_pairs) == 0)
            return;
        ptx::bulk_wait_group<0>();
        ptx::fence_proxy_async_global();
        ptx::fence_acq_rel_gpu();
        asm volatile(
            "{\n"
            ".reg .pred q, r;\n"
            ".reg .u32 n, w, lo, hi;\n"
            ".reg .u64 a;\n"
            "mov.u32 n, %3;\n"
            "mov.u32 w, %2;\n"
            MEGAMOE_PTX_RED_INC_PAIR("w", "%1")
            MEGAMOE_L1_LIST_ENTRY(0, 4)
            MEGAMOE_L1_LIST_ENTRY(1, 8)
            MEGAMOE_L1_LIST_ENTRY(2, 12)
            MEGAMOE_L1_LIST_ENTRY(3, 16)
            MEGAMOE_L1_LIST_ENTRY(4, 20)
            MEGAMOE_L1_LIST_ENTRY(5, 24)
            MEGAMOE_L1_LIST_ENTRY(6, 28)
            MEGAMOE_L1_LIST_ENTRY(7, 32)
            MEGAMOE_L1_LIST_ENTRY(8, 36)
            MEGAMOE_L1_LIST_ENTRY(9, 40)
            MEGAMOE_L1_LIST_ENTRY(10, 44)
            MEGAMOE_L1_LIST_ENTRY(11, 48)
            MEGAMOE_L1_LIST_ENTRY(12, 52)
            MEGAMOE_L1_LIST_ENTRY(13, 56)
            MEGAMOE_L1_LIST_ENTRY(14, 60)
            MEGAMOE_L1_LIST_ENTRY(15, 64)
            MEGAMOE_L1_LIST_ENTRY(16, 68)
            MEGAMOE_L1_LIST_ENTRY(17, 72)
            MEGAMOE_L1_LIST_ENTRY(18, 76)
            MEGAMOE_L1_LIST_ENTRY(19, 80)
            MEGAMOE_L1_LIST_ENTRY(20, 84)
            MEGAMOE_L1_LIST_ENTRY(21, 88)
            MEGAMOE_L1_LIST_ENTRY(22, 92)
            MEGAMOE_L1_LIST_ENTRY(23, 96)
            MEGAMOE_L1_LIST_ENTRY(24, 100)
            MEGAMOE_L1_LIST_ENTRY(25, 104)
            MEGAMOE_L1_LIST_ENTRY(26, 108)
            MEGAMOE_L1_LIST_ENTRY(27, 112)
            MEGAMOE_L1_LIST_ENTRY(28, 116)
            MEGAMOE_L1_LIST_ENTRY(29, 120)
            MEGAMOE_L1_LIST_ENTRY(30, 124)
            MEGAMOE_L1_LIST_ENTRY(31, 128)
            "st.volatile.shared.u32 [%0], 0;\n"
            "}\n" ::"r"(list), "l"(done_counts), "r"(pending), "r"(num_pairs)
            : "memory");
        pending = 0;
    }
};

#undef MEGAMOE_L1_LIST_ENTRY

// Quantized halves of one thread: packed[h][c] holds the e4m3 codes of row r + 8 h at output columns
// 8 (2 c) + 2 q + {0, 1} (bytes 0, 1) and 8 (2 c + 1) + 2 q + {0, 1} (bytes 2, 3); sf[h] is that row's SF.
struct L1Quantized {
    uint32_t packed[2][4];
    float sf[2];
};

// Swiglu, scale, amax, quantize. Padding rows (>= num_valid_rows) become exact zeros (q = 0, SF = 1e-10 / 448)
// whatever their inputs held, so stale pool rows can never leak NaN into the tile.
template <bool kClamp, bool kFastMath>
MEGAMOE_DEVICE L1Quantized l1_activate_quantize(const float (&acc)[kNumAccum], const AccFragment& frag,
                                                const EpilogueTile& tile, const L1EpilogueArgs& args) {
    // Top-k weights: a plain load (global memory in the expert-FFN kernel; in the fused kernel shared memory, where
    // the TMA-A warp copied them: dispatch writes them during the same launch, so never the .nc path)
    float weight[2];
    bool valid[2];
    #pragma unroll
    for (uint32_t h = 0; h < 2; ++ h) {
        valid[h] = frag.row + 8 * h < tile.num_valid_rows;
        weight[h] = valid[h] ? args.topk_weights[frag.row + 8 * h] : 0.0f;
    }

    L1Quantized out;
    #pragma unroll
    for (uint32_t h = 0; h < 2; ++ h) {
        // v for output columns 8 g + 2 q + c, kept as v[2 g + c]
        float v[2 * kNumGateUpPairs];
        float amax = 0.0f;
        #pragma unroll
        for (uint32_t g = 0; g < kNumGateUpPairs; ++ g) {
            #pragma unroll
            for (uint32_t c = 0; c < 2; ++ c) {
                const float x = swiglu_weighted<kClamp, kFastMath>(acc[acc_index(2 * g, h, c)],
                                                                   acc[acc_index(2 * g + 1, h, c)], weight[h],
                                                                   args.clamp);
                v[2 * g + c] = valid[h] ? x : 0.0f;
                amax = fmaxf(amax, fabsf(v[2 * g + c]));
            }
        }

        // The row's 64 columns live in this quad
        const fp8::GroupScales scales = fp8::group_scales(quad_max(amax));
        out.sf[h] = scales.sf;
        #pragma unroll
        for (uint32_t c = 0; c < 4; ++ c)
            out.packed[h][c] = fp8::quantize_pair(v[4 * c + 0], v[4 * c + 1], scales.inv) |
                               (fp8::quantize_pair(v[4 * c + 2], v[4 * c + 3], scales.inv) << 16);
    }
    return out;
}

// Write the thread's codes and SFs into one staging buffer. The quad transposes its words so that lane q holds
// the 16-byte chunk q of each of its two rows: chunk word k = bytes 4 k .. 4 k + 3 come from lanes 2 (k % 2)
// and 2 (k % 2) + 1, low halves for k < 2, high halves for k >= 2. Lanes 0 and 1 of a quad write the SFs of
// rows r and r + 8. Call from whole warps whose rows lie inside the tile (shuffles).
template <uint32_t BLOCK_M>
MEGAMOE_DEVICE void l1_stage(const L1Quantized& q, const AccFragment& frag, uint8_t* buffer) {
    using Staging = L1Staging<BLOCK_M>;
    #pragma unroll
    for (uint32_t h = 0; h < 2; ++ h) {
        uint32_t t[4];
        quad_transpose(q.packed[h], t, frag.quad_lane);
        st_shared_v4(smem_addr(buffer) + (frag.row + 8 * h) * Staging::kRowBytes + 16 * frag.quad_lane,
                     __byte_perm(t[0], t[1], 0x5410), __byte_perm(t[2], t[3], 0x5410),
                     __byte_perm(t[0], t[1], 0x7632), __byte_perm(t[2], t[3], 0x7632));
    }
    if (frag.quad_lane < 2) {
        float* sf = reinterpret_cast<float*>(buffer + Staging::kSfOffset);
        sf[frag.row + 8 * frag.quad_lane] = frag.quad_lane == 0 ? q.sf[0] : q.sf[1];
    }
}

// The whole L1 epilogue of one tile, called by every math thread (kNumMathThreads of them) with the same tile.
// `is_store_thread`: one fixed math thread, the same for every tile.
// NOTES: ordering, in the order it happens:
// - staging buffer reuse: the store thread waits until the earlier tiles' stores have read their staging before
//   arriving at this tile's barrier, and a thread writes buffer b again only two tiles later, after passing the
//   barrier in between; so the stores that read b last are done with it. Staging that aliases other shared
//   memory (the L2 staging) needs a barrier among the math threads before this call: see the assembler.
// - st.shared of the tile and SFs -> fence.proxy.async.shared::cta by each writer -> named barrier among the
//   math threads -> one thread issues the TMA store and the bulk store (DESIGN 5b).
// - the SFs leave through the async proxy with the activations, in the same bulk group: no generic-proxy global
//   store is published, so no writer-side fence.proxy.async.global per thread is needed.
// kListAfterStaging: 0, a release per two tiles; else the batched form, its list that many bytes after `staging`
// (L1EpilogueState), released with the tile when `last_of_run` (the next task is not an L1 tile).
template <uint32_t BLOCK_M, uint32_t kNumMathThreads, uint32_t kBarrierIdx, bool kClamp, bool kFastMath,
          uint32_t kListAfterStaging = 0>
MEGAMOE_DEVICE void l1_epilogue(const float (&acc)[kNumAccum], const AccFragment& frag, const EpilogueTile& tile,
                                uint8_t* staging, const L1EpilogueArgs& args, bool is_store_thread,
                                L1EpilogueState& state, bool last_of_run = false) {
    using Staging = L1Staging<BLOCK_M>;
    static_assert(kNumMathThreads == (BLOCK_M == 128 ? 256 : 128), "one math warpgroup per 64 rows");

    // The earlier tiles' stores had a whole mainloop to complete: free this tile's buffer, release two counters
    if (is_store_thread)
        state.before_stage(args.done_counts);

    // Swiglu, scale, amax, quantize, stage (BLOCK_M = 32: warps 2 and 3 hold WGMMA rows 32..63, discarded)
    const L1Quantized quantized = l1_activate_quantize<kClamp, kFastMath>(acc, frag, tile, args);
    uint8_t* buffer = Staging::buffer(staging, state.buffer);
    if (frag.warp_row() < BLOCK_M)
        l1_stage<BLOCK_M>(quantized, frag, buffer);

    // Hand the buffer to the async proxy, then one thread stores the tile and its SFs
    ptx::fence_proxy_async_shared_cta();
    ptx::named_barrier_sync<kBarrierIdx, kNumMathThreads>();
    if (is_store_thread) {
        ptx::tma_store_2d(args.act_store_map, buffer, tile.n_block_idx * kL1OutputCols, tile.pool_row);
        float* sf_dst = args.act_sf + static_cast<uint64_t>(tile.n_block_idx) * args.num_pool_rows + tile.pool_row;
        ptx::bulk_store_1d(sf_dst, buffer + Staging::kSfOffset, Staging::kSfBytes);
        ptx::bulk_commit_group();
        if constexpr (kListAfterStaging == 0) {
            state.push(tile.pool_row / BLOCK_M);
        } else {
            // The last L1 tile before non-L1 work releases every pending counter, this tile's included (its stores
            // complete first): here, after the stores, the batch's code compiles without spills
            const uint32_t list = smem_addr(staging) + kListAfterStaging;
            state.push_batched(list, tile.pool_row / BLOCK_M);
            if (last_of_run)
                state.publish_batched(list, args.done_counts);
        }
    }
    state.buffer ^= 1;
}

// Debug: the promoted accumulator in fp32, in the natural (pre-transform) column order of w1, valid rows only:
// gate column 64 n + 8 g + c at `out` column 64 n + 8 g + c, its up column at kIntermediate + that.
template <uint32_t kIntermediate>
MEGAMOE_DEVICE void store_l1_acc_natural(const float (&acc)[kNumAccum], const AccFragment& frag,
                                         const EpilogueTile& tile, float* out) {
    #pragma unroll
    for (uint32_t h = 0; h < 2; ++ h) {
        const uint32_t row = frag.row + 8 * h;
        if (row >= tile.num_valid_rows)
            continue;
        float* dst = out + static_cast<uint64_t>(tile.pool_row + row) * (2 * kIntermediate) +
                     tile.n_block_idx * kL1OutputCols + 2 * frag.quad_lane;
        #pragma unroll
        for (uint32_t g = 0; g < kNumGateUpPairs; ++ g) {
            *reinterpret_cast<float2*>(dst + kChunkCols * g) =
                make_float2(acc[acc_index(2 * g, h, 0)], acc[acc_index(2 * g, h, 1)]);
            *reinterpret_cast<float2*>(dst + kIntermediate + kChunkCols * g) =
                make_float2(acc[acc_index(2 * g + 1, h, 0)], acc[acc_index(2 * g + 1, h, 1)]);
        }
    }
}

}  // namespace megamoe::epilogue
