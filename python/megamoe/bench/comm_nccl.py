"""The baseline of `megamoe bench comm`: a dispatch + combine round trip through NCCL `all_to_all_single`, the way
a system without fused communication moves MoE rows (megamoe.bench.comm times it beside the unit kernel)."""
from __future__ import annotations

from typing import Any, Callable

import torch


class NcclRoundTrip:
    """dispatch: all_to_all_single of the per-destination row counts (the split sizes), then of every (token, slot)
    row grouped by destination rank: FP8 x, its SF, top-k weight and expert id (H + H/32 + 8 B); expert: FP8 ->
    BF16 of the received rows (stands in for the unit kernel's trivial expert); combine: all_to_all_single of the
    BF16 rows back and index_add into y [T, H]. Eager: the split sizes go to the host (.tolist(), a sync), as a
    real system's must; fixed=True: the splits of the first call are reused (capturable; the count exchange
    still runs)."""

    def __init__(self, x: torch.Tensor, x_sf: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 num_ranks: int, num_local_experts: int, group: Any) -> None:
        self.num_tokens, self.hidden = x.shape
        self.num_topk = topk_idx.shape[1]
        self.group = group
        self.x = x
        self.xpack = torch.cat([x.view(torch.uint8), x_sf.float().contiguous().view(torch.uint8)], dim=1)
        meta = torch.stack([topk_weights.float().contiguous().view(torch.int32), topk_idx.to(torch.int32)], dim=-1)
        self.meta = meta.reshape(-1, 2).contiguous().view(torch.uint8)  # [T * topk, 8]
        if bool((topk_idx < 0).any()):
            raise ValueError("the NCCL baseline takes routings without -1 slots")
        self.dest = topk_idx.reshape(-1).div(num_local_experts, rounding_mode="floor")
        self.ranks = torch.arange(num_ranks, device=x.device)
        self.row_bytes = self.xpack.shape[1] + self.meta.shape[1]
        self.splits: tuple[list[int], list[int]] | None = None

    def dispatch(self, fixed: bool = False) -> tuple:
        import torch.distributed as dist

        order = torch.argsort(self.dest, stable=True)
        send_counts = (self.dest[:, None] == self.ranks[None, :]).sum(dim=0)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        if fixed and self.splits is not None:
            in_splits, out_splits = self.splits
        else:
            in_splits, out_splits = send_counts.tolist(), recv_counts.tolist()
            self.splits = (in_splits, out_splits)
        send = torch.cat([self.xpack.index_select(0, order // self.num_topk), self.meta.index_select(0, order)],
                         dim=1)
        recv = torch.empty(sum(out_splits), self.row_bytes, dtype=torch.uint8, device=send.device)
        dist.all_to_all_single(recv, send, out_splits, in_splits, group=self.group)
        return order, recv, in_splits, out_splits

    def expert(self, state: tuple) -> tuple:
        order, recv, in_splits, out_splits = state
        return order, recv[:, : self.hidden].view(torch.float8_e4m3fn).to(torch.bfloat16), in_splits, out_splits

    def combine(self, state: tuple) -> torch.Tensor:
        import torch.distributed as dist

        order, out, in_splits, out_splits = state
        back = torch.empty(sum(in_splits), self.hidden, dtype=torch.bfloat16, device=out.device)
        dist.all_to_all_single(back, out, in_splits, out_splits, group=self.group)
        y = torch.zeros(self.num_tokens, self.hidden, dtype=torch.bfloat16, device=out.device)
        y.index_add_(0, order // self.num_topk, back)
        return y

    def stages(self, fixed: bool = False) -> list[Callable[[Any], Any]]:
        return [lambda _: self.dispatch(fixed), self.expert, self.combine]

    def round_trip(self, fixed: bool = False) -> torch.Tensor:
        return self.combine(self.expert(self.dispatch(fixed)))

    def check(self) -> str | None:
        """One eager round trip (fixes the splits); y must be topk x bf16(x) (every slot valid, exact in BF16)."""
        y = self.round_trip()
        expected = (self.x.to(torch.bfloat16).float() * self.num_topk).to(torch.bfloat16)
        if not torch.allclose(y.float(), expected.float(), rtol=1e-2, atol=1e-6):
            return f"y differs from topk x bf16(x) in {int((y != expected).sum())} of {y.numel()} values"
        return None
