"""`MoELayer`: the routed experts of a DeepSeek-style MoE block on megamoe, as a torch.nn.Module.

    layer = MoELayer(num_experts=256, num_topk=8, hidden=7168, intermediate=2048, max_tokens_per_rank=4096,
                     group=ep_group)                       # collective: every rank of the group builds it
    layer.load_weights(tensors, prefix="model.layers.3.mlp.experts.")   # this rank's experts only
    y = layer(hidden_states_bf16, topk_idx, topk_weights)  # collective: every rank calls it, T may differ

Each forward: one kernel casts the BF16 hidden states to FP8 with per-128 float SF and writes them with the
routing into the symmetric buffer (megamoe.kernels.input_cast), then the fused kernel runs the layer. Capturable
in a CUDA graph at a fixed token count (pad the slots of unused tokens with -1) once `prepare` (or one eager call
per hint) has compiled and loaded the kernels; the routing checks that read device memory are skipped under
capture.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from megamoe import api, checkpoint, heuristics, weights
from megamoe.kernels import input_cast

__all__ = ["MoELayer"]


class MoELayer(torch.nn.Module):
    """The routed experts of one MoE layer over `group` (None: one GPU). Rank r holds the experts
    [r * E_local, (r + 1) * E_local), E_local = num_experts / group size."""

    def __init__(self, num_experts: int, num_topk: int, hidden: int, intermediate: int, max_tokens_per_rank: int,
                 *, group: Any = None, device: torch.device | str | None = None,
                 activation_clamp: float | None = None, fast_math: bool = True, num_sms: int | None = None) -> None:
        super().__init__()
        self.buffer = api.get_symm_buffer(group, num_experts, max_tokens_per_rank, num_topk, hidden, intermediate,
                                          device=device)
        lay = self.buffer.layout
        self.num_experts, self.num_topk, self.hidden, self.intermediate = num_experts, num_topk, hidden, intermediate
        self.max_tokens_per_rank = max_tokens_per_rank
        self.rank, self.num_local_experts = self.buffer.rank, lay.num_local_experts
        self.activation_clamp, self.fast_math, self.num_sms = activation_clamp, fast_math, num_sms
        # Rows received per local expert, summed over calls (for EPLB); reset_recv_stats() zeroes it
        self.register_buffer("recv_stats", torch.zeros(lay.num_local_experts, dtype=torch.int32,
                                                       device=self.buffer.device), persistent=False)
        self.l1: weights.WeightPair | None = None
        self.l2: weights.WeightPair | None = None

    @property
    def local_expert_ids(self) -> range:
        """The global ids of this rank's experts, in local order."""
        first = self.rank * self.num_local_experts
        return range(first, first + self.num_local_experts)

    def set_weights(self, l1_weights: weights.WeightPair, l2_weights: weights.WeightPair) -> None:
        """This rank's experts in the natural layout ((w1 [E_local, 2I, H], w1_sf), (w2 [E_local, H, I], w2_sf));
        transformed once for the kernel."""
        device = self.buffer.device
        l1 = tuple(t.to(device) for t in l1_weights)
        l2 = tuple(t.to(device) for t in l2_weights)
        shapes = weights.validate_weights(l1, l2)
        expected = (self.num_local_experts, self.hidden, self.intermediate)
        if (shapes.num_local_experts, shapes.hidden, shapes.intermediate) != expected:
            raise ValueError(f"weights must hold (E_local, hidden, intermediate) = {expected}, got "
                             f"{(shapes.num_local_experts, shapes.hidden, shapes.intermediate)}")
        self.l1, self.l2 = api.transform_weights(l1, l2)  # type: ignore[arg-type]

    def load_weights(self, tensors: Mapping[str, Any], prefix: str = "") -> None:
        """This rank's experts from a DeepSeek V3-format checkpoint mapping (megamoe.checkpoint): per expert
        gate_proj / up_proj / down_proj FP8 weights with their 128x128 weight_scale_inv."""
        l1, l2 = checkpoint.load_deepseek_experts(tensors, prefix, self.local_expert_ids, self.hidden,
                                                  self.intermediate, device=self.buffer.device)
        self.set_weights(l1, l2)

    def reset_recv_stats(self) -> None:
        self.recv_stats.zero_()

    def _expected_tokens_per_expert(self, num_tokens_hint: int | None) -> float | None:
        """The kernel config's load for a forward's `num_tokens_hint` (None: the buffer's maximum)."""
        if num_tokens_hint is None:
            return None
        hint = api._check_int("num_tokens_hint", num_tokens_hint)
        if not 0 < hint <= self.max_tokens_per_rank:
            raise ValueError(f"num_tokens_hint must be in [1, max_tokens_per_rank = {self.max_tokens_per_rank}], "
                             f"got {hint}")
        return heuristics.default_expected_tokens_per_expert(self.buffer.layout.num_ranks, self.num_experts, hint,
                                                             self.num_topk)

    def prepare(self, num_tokens_hints: Iterable[int | None] = (None,)) -> None:
        """Compile and load every kernel a forward with these `num_tokens_hint` values can launch (each hint's fused
        variant, None for the default; the input fill for int32 and int64 ids), then meet the group's other ranks.
        Collective: every rank calls it with the same hints. After it a forward with one of these hints compiles
        nothing, so no rank compiles while its peers wait at the fused kernel's NVLink barrier (DESIGN 5c), and
        CUDA graphs can be captured without an eager call first."""
        expected = [self._expected_tokens_per_expert(hint) for hint in num_tokens_hints]
        for idx64 in (False, True):
            input_cast.load(self.buffer, idx64)
        api.prepare(self.buffer, expected_tokens_per_expert=expected, activation_clamp=self.activation_clamp,
                    fast_math=self.fast_math)

    def forward(self, hidden_states: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                *, num_tokens_hint: int | None = None) -> torch.Tensor:
        """BF16 [T, H] routed-expert output of BF16 hidden_states [T, H] (T <= max_tokens_per_rank), topk_idx
        int32 or int64 [T, top-k] (-1: no expert) and float32 topk_weights [T, top-k]. Collective.

        num_tokens_hint: the tokens per rank this call is sized for, normally the same on every rank (a serving
        framework's batch bucket, e.g. its CUDA-graph batch size at decode); the kernel config (BLOCK_M) is chosen
        for that load instead of for max_tokens_per_rank, which at decode is several times faster. The output
        does not depend on it, also where the ranks' hints differ (each rank then runs its own variant: tested
        on virtual ranks of one GPU, tests/test_virtual_ranks_gpu.py). Each distinct hint may compile a kernel
        variant: `prepare` the hints (or make one eager call per hint) before capturing graphs."""
        if self.l1 is None or self.l2 is None:
            raise RuntimeError("MoELayer has no weights: call load_weights or set_weights first")
        expected = self._expected_tokens_per_expert(num_tokens_hint)
        num_tokens = input_cast.run(self.buffer, hidden_states, topk_idx, topk_weights)
        y = torch.empty(num_tokens, self.hidden, dtype=torch.bfloat16, device=self.buffer.device)
        api.fused(y, self.l1, self.l2, self.buffer, num_tokens, self.recv_stats, self.activation_clamp,
                  self.fast_math, expected, check_inputs=not torch.cuda.is_current_stream_capturing(),
                  num_sms=self.num_sms)
        return y
