// SymBuffer: every rank's base address of the symmetric buffer, passed to the kernel as a
// `const __grid_constant__` parameter, so that a local address maps to the same byte on a peer
// (DESIGN section 6). Mirrored by megamoe/kernels/dispatch_combine.py: SymBufferStruct.
#pragma once

#include "utils.cuh"

namespace megamoe {

constexpr uint32_t kMaxRanks = 8;

struct SymBuffer {
    uint64_t base_ptrs[kMaxRanks];  // base_ptrs[r]: rank r's buffer as mapped in this process (0 past num_ranks)
    uint64_t local_ptr;             // base_ptrs[rank_idx]
    uint32_t rank_idx;              // this rank
    uint32_t num_ranks;

    // NOTES: a field at a fixed parameter offset, not base_ptrs[rank_idx]: ptxas reloads it from the constant bank
    // where it is needed, while the dynamically indexed load was kept in a register from the fused kernel's head
    // into every warp role and spilled in the 56-register producer warps.
    MEGAMOE_DEVICE uint64_t local_base() const { return local_ptr; }

    // This rank's copy of the byte at `offset` from the buffer base.
    template <typename T>
    MEGAMOE_DEVICE T* local(uint64_t offset) const {
        return reinterpret_cast<T*>(local_base() + offset);
    }

    // Rank `dst_rank`'s copy of the byte at `offset` (this rank's own when dst_rank == rank_idx).
    template <typename T>
    MEGAMOE_DEVICE T* peer(uint64_t offset, uint32_t dst_rank) const {
        return reinterpret_cast<T*>(base_ptrs[dst_rank] + offset);
    }

    // A pointer into this rank's buffer, mapped to the same byte of rank `dst_rank`'s buffer: the per-rank
    // offset base_ptrs[dst_rank] - base_ptrs[rank_idx] added to the address.
    template <typename T>
    MEGAMOE_DEVICE T* map(T* ptr, uint32_t dst_rank) const {
        return reinterpret_cast<T*>(reinterpret_cast<uint64_t>(ptr) + (base_ptrs[dst_rank] - local_base()));
    }
};
static_assert(sizeof(SymBuffer) == 8 * kMaxRanks + 16, "SymBuffer layout is mirrored in megamoe/kernels");

}  // namespace megamoe
