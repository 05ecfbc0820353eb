"""Virtual ranks on one GPU (test only): R symmetric buffers that are plain allocations of one device sharing one
`buffer_ptrs` list, and R cooperative launches of floor(SMs / R) CTAs each on R streams, running concurrently.
The kernels' SymBuffer maps between these addresses exactly as between GPUs, so cross-rank pulls, scatters, the
NVLink barrier and the clean run through the same code; peer-mapped TMA, cross-GPU ordering and symmetric memory
are not exercised (the multigpu tier is).

NOTES: a cooperative grid starts all at once or not at all, and the R grids must be resident together (R x
floor(SMs / R) CTAs, one per SM). Anything that serializes the streams between the launches (an allocation, a
memset, work on the default stream, a module load) leaves the first grid spinning on its peers while the second
cannot start: every kernel is loaded (`prepare`), every output and workspace allocated, and inputs checked off
(`check_inputs=False`), before `launch_concurrently` issues the first launch.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from megamoe.buffer import SymmBuffer
from megamoe.layout import SymmLayout


def virtual_rank_buffers(num_ranks: int, num_experts: int, num_max_tokens_per_rank: int, num_topk: int,
                         hidden: int, intermediate: int, device: torch.device | str = "cuda") -> list[SymmBuffer]:
    """One zeroed buffer per virtual rank, in rank order, each knowing every rank's base address."""
    if num_ranks < 2:
        raise ValueError(f"virtual ranks need num_ranks >= 2, got {num_ranks}")
    layout = SymmLayout.create(num_ranks, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate)
    device = torch.device(device)
    buffers = [torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device) for _ in range(num_ranks)]
    ptrs = tuple(b.data_ptr() for b in buffers)
    return [SymmBuffer(None, layout, rank, num_ranks, buffers[rank], ptrs) for rank in range(num_ranks)]


def grid_per_rank(num_ranks: int, device: torch.device | str = "cuda") -> int:
    """CTAs per virtual rank: the SMs shared evenly, floor(SMs / R)."""
    return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count // num_ranks


def launch_concurrently(launches: Sequence[Callable[[torch.cuda.Stream], object]],
                        device: torch.device | str = "cuda") -> None:
    """Call each launch with its own stream (torch's pool streams are non-blocking), after every earlier piece of
    work on the device finished; returns once all of them finished (a trap raises here)."""
    device = torch.device(device)
    streams = [torch.cuda.Stream(device) for _ in launches]
    torch.cuda.synchronize(device)
    for launch, stream in zip(launches, streams):
        launch(stream)
    torch.cuda.synchronize(device)
