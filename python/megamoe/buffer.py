"""The symmetric buffer (DESIGN sections 6 and 7): one allocation per rank carved by `SymmLayout`, with views of
the regions the caller fills (x, x_sf, topk_idx, topk_weights) and the per-rank base pointers the kernel maps
peers' addresses with (SymBuffer on device)."""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from megamoe import heuristics
from megamoe.layout import SymmLayout

# NVLink multicast is never used (DESIGN section 6); these keep it off in NCCL, torch and NVSHMEM.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _group_rank_size(group: Any) -> tuple[int, int]:
    if group is None:
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group)


@dataclass
class SymmBuffer:
    """This rank's symmetric buffer. Fill `x`, `x_sf`, `topk_idx`, `topk_weights` (first T rows) before `fused`."""

    group: Any
    layout: SymmLayout
    rank: int
    num_ranks: int
    buffer: torch.Tensor  # uint8 [layout.total_bytes]
    buffer_ptrs: tuple[int, ...]  # every rank's buffer base address, in rank order
    handle: Any = field(default=None, repr=False)
    x: torch.Tensor = field(init=False, repr=False)
    x_sf: torch.Tensor = field(init=False, repr=False)
    topk_idx: torch.Tensor = field(init=False, repr=False)
    topk_weights: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("x", "x_sf", "topk_idx", "topk_weights"):
            setattr(self, name, self.view(name))

    def view(self, name: str) -> torch.Tensor:
        """Typed view of a layout region (no copy)."""
        self._check_alive()
        return self.layout.region(name).view(self.buffer)

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    @property
    def num_experts(self) -> int:
        return self.layout.num_experts

    @property
    def num_max_tokens_per_rank(self) -> int:
        return self.layout.num_max_tokens_per_rank

    @property
    def num_topk(self) -> int:
        return self.layout.num_topk

    @property
    def hidden(self) -> int:
        return self.layout.hidden

    @property
    def intermediate_hidden(self) -> int:
        return self.layout.intermediate

    def config(self, expected_tokens_per_expert: float | None = None) -> heuristics.MoeConfig:
        """The kernel config for this buffer (from values all ranks share, never the local T)."""
        from megamoe.jit.runtime import num_sms

        return heuristics.select_config(
            self.num_ranks, self.num_experts, self.num_max_tokens_per_rank, self.num_topk, self.hidden,
            self.intermediate_hidden, num_sms=num_sms(self.device),
            expected_tokens_per_expert=expected_tokens_per_expert)

    def barrier(self) -> None:
        """Wait for this device's work, then meet the group's other ranks (collective; nothing with one rank)."""
        if self.num_ranks == 1:
            return
        import torch.distributed as dist

        torch.cuda.synchronize(self.device)
        with torch.cuda.device(self.device):  # NCCL's barrier runs on the current device: make it the buffer's
            dist.barrier(group=self.group)

    def destroy(self) -> None:
        """Release the memory (collective for several ranks: every rank calls it)."""
        if self.buffer is None:
            return
        self.barrier()
        self.handle = None
        self.buffer = None  # type: ignore[assignment]
        for name in ("x", "x_sf", "topk_idx", "topk_weights"):
            setattr(self, name, None)

    def _check_alive(self) -> None:
        if self.buffer is None:
            raise RuntimeError("this SymmBuffer was destroyed")


def allocate(group: Any, layout: SymmLayout, device: torch.device) -> SymmBuffer:
    """Allocate, zero and (for several ranks) rendezvous the buffer."""
    rank, num_ranks = _group_rank_size(group)
    if num_ranks == 1:
        buffer = torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device)
        return SymmBuffer(group, layout, rank, 1, buffer, (buffer.data_ptr(),))

    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    # NVLink multicast stays off (DESIGN 6): where the caller left them unset, before torch's symmetric memory
    # creates anything (NCCL reads its own switch when it creates a communicator: set it before the group's first
    # collective, as the README says)
    for name, value in NO_MULTICAST_ENV.items():
        os.environ.setdefault(name, value)
    if hasattr(symm_mem, "enable_symm_mem_for_group"):  # required by older torch, deprecated (a no-op) since
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            symm_mem.enable_symm_mem_for_group(group.group_name)
    buffer = symm_mem.empty(layout.total_bytes, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(buffer, group=group)
    if (getattr(handle, "rank", rank), getattr(handle, "world_size", num_ranks)) != (rank, num_ranks):
        raise RuntimeError(f"symmetric-memory rendezvous gave rank {handle.rank} of {handle.world_size}, the group "
                           f"rank {rank} of {num_ranks}")
    buffer.zero_()
    buf = SymmBuffer(group, layout, rank, num_ranks, buffer, tuple(int(p) for p in handle.buffer_ptrs), handle)
    buf.barrier()  # every rank's buffer zeroed before any kernel of any rank reads it
    return buf
