// TMA (cp.async.bulk) wrappers: 2D tensor tiles and 1D bulk copies, loads complete on an mbarrier,
// stores complete through bulk groups.
#pragma once

#include <cuda.h>

#include "utils.cuh"

namespace megamoe::ptx {

MEGAMOE_DEVICE void prefetch_tensormap(const CUtensorMap* desc) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(desc)) : "memory");
}

// Load the box at (inner coordinate c0, outer coordinate c1); completes `bar`'s transaction bytes.
// Out-of-bounds elements are zero-filled.
MEGAMOE_DEVICE void tma_load_2d(void* smem_dst, const CUtensorMap* desc, uint64_t* bar, int32_t c0, int32_t c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
        ::"r"(smem_addr(smem_dst)), "l"(reinterpret_cast<uint64_t>(desc)), "r"(smem_addr(bar)), "r"(c0), "r"(c1)
        : "memory");
}

// Store the box at (c0, c1); out-of-bounds elements are not written.
MEGAMOE_DEVICE void tma_store_2d(const CUtensorMap* desc, const void* smem_src, int32_t c0, int32_t c1) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];"
                 ::"l"(reinterpret_cast<uint64_t>(desc)), "r"(smem_addr(smem_src)), "r"(c0), "r"(c1)
                 : "memory");
}

// 1D bulk copy global -> shared (size and both addresses multiples of 16 B).
MEGAMOE_DEVICE void bulk_load_1d(void* smem_dst, const void* gmem_src, uint32_t num_bytes, uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_addr(smem_dst)), "l"(gmem_src), "r"(num_bytes), "r"(smem_addr(bar))
                 : "memory");
}

// 1D bulk copy shared -> global (size and both addresses multiples of 16 B).
MEGAMOE_DEVICE void bulk_store_1d(void* gmem_dst, const void* smem_src, uint32_t num_bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 ::"l"(gmem_dst), "r"(smem_addr(smem_src)), "r"(num_bytes)
                 : "memory");
}

MEGAMOE_DEVICE void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// NOTES: completion of the bulk stores (their writes visible in global memory): wait with this before
// releasing a flag that publishes them (DESIGN section 5b), never with the `.read` variant.
template <int kNumPending>
MEGAMOE_DEVICE void bulk_wait_group() {
    asm volatile("cp.async.bulk.wait_group %0;" ::"n"(kNumPending) : "memory");
}

// Only says the shared-memory source of the stores may be overwritten.
template <int kNumPending>
MEGAMOE_DEVICE void bulk_wait_group_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kNumPending) : "memory");
}

// Byte offset of element (row, 16-B chunk) in a tile stored with the 128 B swizzle: the 16-byte chunk
// index within each 128-byte row is XORed with (row % 8). Tiles using it are 1024 B aligned.
MEGAMOE_HOST_DEVICE constexpr uint32_t swizzle_128b_offset(uint32_t row, uint32_t byte_in_row) {
    return row * 128 + ((((byte_in_row >> 4) ^ (row & 7)) & 7) << 4) + (byte_in_row & 15);
}

}  // namespace megamoe::ptx
