// Combine, second step (after the barrier that follows every rank's scatter): y[t] = bf16(sum over the valid
// top-k slots j of token t, in slot order, of fp32(combine[j][t])), a token without a valid slot gets zeros.
// One warp per token, chunk by chunk, with a 2-stage ring of 1D bulk loads (one load = one slot's chunk) and
// fp32 accumulation in registers; the result goes from registers straight to y.
#pragma once

#include <cuda_bf16.h>

#include "common/fence.cuh"
#include "common/mbarrier.cuh"
#include "common/tma.cuh"
#include "scatter.cuh"

namespace megamoe::combine {

// Chunk = gcd(2 H, 1024) B (kernels/dispatch_combine.py: combine_chunk_bytes): <= 512 BF16, 4 to 16 per lane.
constexpr uint32_t kRowBytes = layout::kHidden * sizeof(__nv_bfloat16);
constexpr uint32_t kChunkBytes = kRowBytes % 1024 == 0 ? 1024u : (kRowBytes % 512 == 0 ? 512u : 256u);
constexpr uint32_t kNumChunks = kRowBytes / kChunkBytes;
constexpr uint32_t kNumStages = 2;
constexpr uint32_t kUnitsPerLane = kChunkBytes / sizeof(uint2) / 32;  // uint2 = 4 BF16
constexpr uint32_t kElemsPerLane = kUnitsPerLane * 4;
static_assert(kRowBytes % kChunkBytes == 0 and kChunkBytes % (32 * sizeof(uint2)) == 0, "whole uint2 per lane");
static_assert(layout::kNumTopk <= 32, "one lane per top-k slot");

// Shared memory per reducing warp: kNumStages chunks (16 B aligned), and kNumStages mbarriers elsewhere.
constexpr uint32_t kSmemBytesPerWarp = kNumStages * kChunkBytes;

// Per-warp ring position; it runs on across tokens (loads issued == consumed between tokens).
struct ReduceRing {
    uint8_t* chunks;     // kNumStages x kChunkBytes
    uint64_t* barriers;  // kNumStages mbarriers, initialized with arrive count 1
    uint32_t num_loads = 0;
};

MEGAMOE_DEVICE void store_y_units(uint8_t* y_chunk, const float* acc, uint32_t lane) {
#pragma unroll
    for (uint32_t u = 0; u < kUnitsPerLane; ++ u) {
        const __nv_bfloat162 lo = __floats2bfloat162_rn(acc[u * 4 + 0], acc[u * 4 + 1]);
        const __nv_bfloat162 hi = __floats2bfloat162_rn(acc[u * 4 + 2], acc[u * 4 + 3]);
        uint2 packed;
        packed.x = *reinterpret_cast<const uint32_t*>(&lo);
        packed.y = *reinterpret_cast<const uint32_t*>(&hi);
        reinterpret_cast<uint2*>(y_chunk)[u * 32 + lane] = packed;
    }
}

MEGAMOE_DEVICE void accumulate_units(float* acc, const uint8_t* chunk, uint32_t lane) {
#pragma unroll
    for (uint32_t u = 0; u < kUnitsPerLane; ++ u) {
        const uint2 packed = reinterpret_cast<const uint2*>(chunk)[u * 32 + lane];
        // BF16 -> FP32 is exact: the BF16 bits are the top half of the float
        acc[u * 4 + 0] += __uint_as_float(packed.x << 16);
        acc[u * 4 + 1] += __uint_as_float(packed.x & 0xffff0000u);
        acc[u * 4 + 2] += __uint_as_float(packed.y << 16);
        acc[u * 4 + 3] += __uint_as_float(packed.y & 0xffff0000u);
    }
}

// Called by every lane of a warp; global warp `warp_rank` of `num_warps` reduces tokens warp_rank,
// warp_rank + num_warps, ... of this rank's `num_tokens`. y: [num_tokens, H] BF16, rows 16 B aligned.
MEGAMOE_DEVICE void reduce_tokens(const DeviceEnv& env, const SymBuffer& sym, uint32_t num_tokens,
                                  __nv_bfloat16* y, ReduceRing& ring, uint32_t warp_rank, uint32_t num_warps) {
    const uint32_t lane = lane_idx();
    const int64_t* topk_idx = sym.local<const int64_t>(layout::kTopkIdxOffset);
    const uint8_t* combine = sym.local<const uint8_t>(0);

    // NOTES: the peers' combine rows are generic-proxy stores, published by the barrier this warp is past;
    // the issuing lane fences to the async proxy after that acquire and before its first bulk load (DESIGN 5b).
    ptx::fence_proxy_async_global();

    for (uint32_t token = warp_rank; token < num_tokens; token += num_warps) {
        const bool valid =
            lane < layout::kNumTopk and topk_idx[static_cast<uint64_t>(token) * layout::kNumTopk + lane] >= 0;
        const uint32_t slot_mask = __ballot_sync(0xffffffffu, valid);
        uint8_t* y_row = reinterpret_cast<uint8_t*>(y) + static_cast<uint64_t>(token) * kRowBytes;
        float acc[kElemsPerLane];
#pragma unroll
        for (uint32_t i = 0; i < kElemsPerLane; ++ i)
            acc[i] = 0.0f;

        // No valid slot: zeros
        if (slot_mask == 0) {
            for (uint32_t chunk = 0; chunk < kNumChunks; ++ chunk)
                store_y_units(y_row + chunk * kChunkBytes, acc, lane);
            continue;
        }

        // Loads in (chunk, slot) order: slots ascending within a chunk
        const uint32_t num_slots = __popc(slot_mask);
        const uint32_t num_token_loads = kNumChunks * num_slots;
        uint32_t issue_chunk = 0, issue_slots = slot_mask, num_issued = ring.num_loads;
        auto issue_next = [&]() {
            const uint32_t slot = __ffs(issue_slots) - 1;
            if (lane == 0) {
                const uint32_t stage = num_issued % kNumStages;
                ptx::mbarrier_arrive_expect_tx(ring.barriers + stage, kChunkBytes);
                ptx::bulk_load_1d(ring.chunks + stage * kChunkBytes,
                                  combine + combine_row_offset(slot, token) + issue_chunk * kChunkBytes, kChunkBytes,
                                  ring.barriers + stage);
            }
            ++ num_issued;
            issue_slots &= issue_slots - 1;
            if (issue_slots == 0) {
                issue_slots = slot_mask;
                ++ issue_chunk;
            }
        };

        issue_next();
        uint32_t chunk = 0, slots_left = num_slots;
        for (uint32_t i = 0; i < num_token_loads; ++ i) {
            // Prefetch the next load into the other stage (its previous chunk was consumed, then __syncwarp)
            if (i + 1 < num_token_loads)
                issue_next();

            // Wait for this load, accumulate it in fp32 (slot order)
            const uint32_t stage = ring.num_loads % kNumStages;
            ptx::mbarrier_wait(env, "combine_load", ring.barriers + stage, (ring.num_loads / kNumStages) & 1u);
            accumulate_units(acc, ring.chunks + stage * kChunkBytes, lane);
            ++ ring.num_loads;
            // Every lane has read the stage before lane 0 issues a load into it again
            __syncwarp();

            // The chunk's last slot: store the BF16 sum
            if (-- slots_left == 0) {
                store_y_units(y_row + chunk * kChunkBytes, acc, lane);
#pragma unroll
                for (uint32_t k = 0; k < kElemsPerLane; ++ k)
                    acc[k] = 0.0f;
                slots_left = num_slots;
                ++ chunk;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Reduce by chunks: the unit of work is (token, 32 x kVecsPerLane 16-B vectors of its row), so a token's row is
// spread over several warps and a few tokens still occupy the whole GPU; every valid slot's vectors of the unit
// are loaded (plain 16 B loads, up to kSlotBatch slots x kVecsPerLane in flight per lane) before any is added.
// ---------------------------------------------------------------------------------------------------------------

constexpr uint32_t kVecsPerRow = kRowBytes / 16;  // 16 B = 8 BF16
constexpr uint32_t kSlotBatch = layout::kNumTopk < 8 ? layout::kNumTopk : 8u;

template <uint32_t kVecsPerLane>
MEGAMOE_DEVICE void accumulate_vecs(float* acc, const uint4 (&v)[kSlotBatch][kVecsPerLane], uint32_t j) {
#pragma unroll
    for (uint32_t q = 0; q < kVecsPerLane; ++ q) {
        const uint32_t w[4] = {v[j][q].x, v[j][q].y, v[j][q].z, v[j][q].w};
#pragma unroll
        for (uint32_t i = 0; i < 4; ++ i) {
            // BF16 -> FP32 is exact: the BF16 bits are the top half of the float
            acc[q * 8 + i * 2 + 0] += __uint_as_float(w[i] << 16);
            acc[q * 8 + i * 2 + 1] += __uint_as_float(w[i] & 0xffff0000u);
        }
    }
}

// Called by every lane of a warp, after the combine barrier (kWaitArrivals: as soon as the warp's own scatter is
// done, waiting per token for its rows: combine_arrival_count); global warp `warp_rank` of `num_warps` takes a
// contiguous range of the num_tokens x kUnitsPerToken units (consecutive units mostly share a token, whose slot
// mask is then loaded once). y: [num_tokens, H] BF16, rows 16 B aligned. Same sums as reduce_tokens: fp32 from
// +0, the valid slots in slot order, one rounding to BF16. kPrint: a timeout also printfs (false in kernels that
// issue WGMMA).
// Reducing warps of one call at most: 32 per CTA (1024 threads) on up to 160 SMs (the unit range stays 32-bit)
constexpr uint32_t kMaxReduceWarps = 32 * 160;

template <uint32_t kVecsPerLane, bool kWaitArrivals = false, bool kPrint = true>
MEGAMOE_DEVICE void reduce_token_chunks(const DeviceEnv& env, const SymBuffer& sym, uint32_t num_tokens,
                                        __nv_bfloat16* y, uint32_t warp_rank, uint32_t num_warps) {
    static_assert(kVecsPerLane >= 1 and kVecsPerLane <= 4, "1..4 vectors of 16 B per lane and slot");
    constexpr uint32_t kVecsPerUnit = 32 * kVecsPerLane;
    constexpr uint32_t kUnitsPerToken = (kVecsPerRow + kVecsPerUnit - 1) / kVecsPerUnit;
    const uint32_t lane = lane_idx();
    const int64_t* topk_idx = sym.local<const int64_t>(layout::kTopkIdxOffset);
    const uint8_t* combine = sym.local<const uint8_t>(0);
    const uint32_t num_units = num_tokens * kUnitsPerToken;
    // (32-bit products: a 64-bit division is a subroutine call, whose saved registers spilled in the fused kernel)
    static_assert(static_cast<uint64_t>(layout::kNumMaxTokensPerRank) * kUnitsPerToken * (kMaxReduceWarps + 1) <
                      (1ull << 32), "the warp's unit range in 32-bit arithmetic");
    const uint32_t begin = num_units * warp_rank / num_warps;
    const uint32_t end = num_units * (warp_rank + 1) / num_warps;

    // NOTES: the peers' combine rows are generic-proxy stores (combine/scatter.cuh), published by the combine
    // barrier this warp is past (its CTA's acquire, extended by the CTA barrier), or with kWaitArrivals by each
    // row's red.release.sys on the token's count, which lane 0 acquires (.sys) before __syncwarp extends the
    // order to the other lanes; generic loads need no proxy fence. ld.global.cg reads L2 (the point of coherence
    // for the NVLink writes), never a stale L1 line of an earlier call.
    uint32_t mask_token = 0xffffffffu, slot_mask = 0;
    for (uint32_t unit = begin; unit < end; ++ unit) {
        const uint32_t token = unit / kUnitsPerToken, first_vec = unit % kUnitsPerToken * kVecsPerUnit;
        if (token != mask_token) {
            const bool valid =
                lane < layout::kNumTopk and topk_idx[static_cast<uint64_t>(token) * layout::kNumTopk + lane] >= 0;
            slot_mask = __ballot_sync(0xffffffffu, valid);
            mask_token = token;
            if constexpr (kWaitArrivals) {
                if (lane == 0) {
                    const uint32_t* count = sym.local<const uint32_t>(layout::kCombineArrivalCountOffset) + token;
                    const uint32_t expected = __popc(slot_mask);
                    // (the report inline: the fused kernel reduces on its math warpgroups, ReportSite)
                    bounded_wait<kPrint, ReportSite::kInline>(
                        env, "combine_rows",
                        [&]() { return ptx::ld_acquire<ptx::Scope::kSys>(count) >= expected; },
                        [&]() { return make_longlong3(ptx::ld_relaxed<ptx::Scope::kSys>(count), expected, token); });
                }
                __syncwarp();
            }
        }
        float acc[kVecsPerLane * 8];
#pragma unroll
        for (uint32_t i = 0; i < kVecsPerLane * 8; ++ i)
            acc[i] = 0.0f;

#pragma unroll 1
        for (uint32_t slot_base = 0; slot_base < layout::kNumTopk; slot_base += kSlotBatch) {
            uint4 v[kSlotBatch][kVecsPerLane];
#pragma unroll
            for (uint32_t j = 0; j < kSlotBatch; ++ j) {
                const uint32_t slot = slot_base + j;
#pragma unroll
                for (uint32_t q = 0; q < kVecsPerLane; ++ q) {
                    const uint32_t vec = first_vec + q * 32 + lane;
                    v[j][q] = make_uint4(0u, 0u, 0u, 0u);
                    if (slot < layout::kNumTopk and ((slot_mask >> slot) & 1u) and vec < kVecsPerRow)
                        v[j][q] = __ldcg(reinterpret_cast<const uint4*>(combine + combine_row_offset(slot, token)) +
                                         vec);
                }
            }
#pragma unroll
            for (uint32_t j = 0; j < kSlotBatch; ++ j) {
                const uint32_t slot = slot_base + j;
                if (slot < layout::kNumTopk and ((slot_mask >> slot) & 1u))
                    accumulate_vecs<kVecsPerLane>(acc, v, j);
            }
        }

        uint8_t* y_row = reinterpret_cast<uint8_t*>(y) + static_cast<uint64_t>(token) * kRowBytes;
#pragma unroll
        for (uint32_t q = 0; q < kVecsPerLane; ++ q) {
            const uint32_t vec = first_vec + q * 32 + lane;
            if (vec < kVecsPerRow) {
                uint32_t packed[4];
#pragma unroll
                for (uint32_t i = 0; i < 4; ++ i) {
                    const __nv_bfloat162 b = __floats2bfloat162_rn(acc[q * 8 + i * 2], acc[q * 8 + i * 2 + 1]);
                    packed[i] = *reinterpret_cast<const uint32_t*>(&b);
                }
                reinterpret_cast<uint4*>(y_row)[vec] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
            }
        }
    }
}

}  // namespace megamoe::combine
