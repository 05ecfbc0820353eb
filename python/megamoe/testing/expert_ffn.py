"""Problems for the expert-FFN unit kernel's tests and benchmarks (megamoe.kernels.expert_ffn): `make_case` routes
fresh random inputs to exact per-expert row counts and runs `megamoe.reference.moe(..., return_intermediates=True)`;
`pack_problem` packs the pool for one variant from the reference's per-expert rows, so every kernel output has its
reference counterpart. The checks of the outputs: megamoe.testing.expert_ffn_checks."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from megamoe.kernels.expert_ffn import FP8_NAN_CODE, ExpertFfnConfig, FfnInputs, FfnOutputs, run

if TYPE_CHECKING:
    from megamoe.reference import RankIntermediates


def routing_with_counts(counts: list[int], num_topk: int, *, generator: torch.Generator | None = None) -> Tensor:
    """int64 topk_idx [T, num_topk] (CPU) in which expert e is chosen by exactly counts[e] tokens: distinct experts
    per token, at most num_topk - 1 of them (so some slots are -1), in random slots. T = max(max(counts),
    ceil(sum / (num_topk - 1))). Each expert takes the least-loaded tokens (random among equals), which keeps every
    token's load within one of the others'. `generator`: a CPU generator."""
    if num_topk < 2:
        raise ValueError(f"num_topk must be >= 2 (one slot stays free), got {num_topk}")
    if any(c < 0 for c in counts):
        raise ValueError(f"counts must be >= 0, got {counts}")
    num_tokens = max(max(counts, default=0), -(-sum(counts) // (num_topk - 1)), 1)
    load = torch.zeros(num_tokens, dtype=torch.float64)
    chosen: list[list[int]] = [[] for _ in range(num_tokens)]
    for expert in sorted(range(len(counts)), key=lambda e: -counts[e]):
        order = torch.argsort(load + torch.rand(num_tokens, generator=generator, dtype=torch.float64) * 0.5)
        for t in order[: counts[expert]].tolist():
            chosen[t].append(expert)
            load[t] += 1
    assert int(load.max()) <= num_topk - 1
    topk_idx = torch.full((num_tokens, num_topk), -1, dtype=torch.int64)
    for t, experts in enumerate(chosen):
        slots = torch.randperm(num_topk, generator=generator)[: len(experts)]
        topk_idx[t, slots] = torch.tensor(experts, dtype=torch.int64)
    return topk_idx


def clamp_for(x_float: Tensor, w1_float: Tensor, fraction: float = 0.75) -> float:
    """A power of two near `fraction` x the RMS of the L1 accumulators, estimated from the float inputs
    (x [T, H], w1 [E, 2I, H]): clamps a good share of the gate and up values, and is exact in fp32."""
    rms = math.sqrt(x_float.float().pow(2).mean().item() * w1_float.float().pow(2).mean().item() * x_float.shape[1])
    return float(2.0 ** round(math.log2(fraction * rms)))


@dataclass
class FfnCase:
    """Inputs and the reference's intermediates, independent of BLOCK_M (pack them with `pack_problem`)."""

    hidden: int
    intermediate: int
    counts: list[int]
    fast_math: bool
    activation_clamp: float | None
    l1_weights: tuple[Tensor, Tensor]  # natural (w1, w1_sf)
    l2_weights: tuple[Tensor, Tensor]
    reference: RankIntermediates       # experts[e]: the rows expert e receives, in pool order
    seed: int


def make_case(hidden: int, intermediate: int, counts: list[int], *, small_int: bool, fast_math: bool,
              activation_clamp: float | str | None = None, num_topk: int = 4, seed: int = 0,
              device: torch.device | str = "cuda") -> FfnCase:
    """Fresh random inputs (`reference.random_case`; small_int: DESIGN section 4 check 0) routed so that expert e
    receives exactly counts[e] rows, and the reference's intermediates (`reference.moe(...,
    return_intermediates=True)`). activation_clamp: a number, "auto" (`clamp_for` on this case), or None."""
    from dataclasses import replace

    from megamoe import reference as ref
    from megamoe.quant import random_topk_weights

    device = torch.device(device)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    cpu_generator = torch.Generator()
    cpu_generator.manual_seed(seed)
    topk_idx = routing_with_counts(list(counts), num_topk, generator=cpu_generator).to(device)
    num_tokens = topk_idx.shape[0]
    case = ref.random_case(num_tokens, hidden, intermediate, len(counts), num_topk, small_int=small_int,
                           generator=generator, device=device)
    case = replace(case, topk_idx=[topk_idx],
                   topk_weights=[random_topk_weights(num_tokens, num_topk, generator=generator, device=device)])
    if activation_clamp == "auto":
        activation_clamp = clamp_for(case.x_float[0], case.w1_float)
    if activation_clamp is not None and not isinstance(activation_clamp, float):
        raise ValueError(f"activation_clamp must be a float, 'auto' or None, got {activation_clamp!r}")
    result = ref.moe(case.x[0], case.x_sf[0], case.topk_idx[0], case.topk_weights[0], case.l1_weights[0],
                     case.l2_weights[0], activation_clamp=activation_clamp, fast_math=fast_math,
                     return_intermediates=True)
    assert [inter.src.shape[0] for inter in result.experts] == list(counts)
    return FfnCase(hidden, intermediate, list(counts), fast_math, activation_clamp, case.l1_weights[0],
                   case.l2_weights[0], result, seed)


@dataclass
class FfnProblem:
    """A case packed for one variant: the pool (expert e at pool_offsets[e], padding rows NaN) and the weights
    in the kernel's layout."""

    config: ExpertFfnConfig
    case: FfnCase
    offsets: list[int]
    inputs: FfnInputs

    @property
    def counts(self) -> list[int]:
        return self.case.counts

    @property
    def activation_clamp(self) -> float | None:
        return self.case.activation_clamp

    @property
    def reference(self) -> RankIntermediates:
        return self.case.reference

    @property
    def num_pool_rows(self) -> int:
        return self.inputs.num_pool_rows

    @property
    def used_rows(self) -> int:
        """Rows of the pool blocks the counts use (the rest are spare blocks the kernel must leave alone)."""
        from megamoe.scheduler import num_pool_blocks

        return num_pool_blocks(self.counts, self.config.block_m) * self.config.block_m

    def rows(self, expert_idx: int) -> slice:
        return slice(self.offsets[expert_idx], self.offsets[expert_idx] + self.counts[expert_idx])

    def valid_mask(self) -> Tensor:
        mask = torch.zeros(self.num_pool_rows, dtype=torch.bool, device=self.inputs.l1_acts.device)
        for e in range(self.config.num_experts):
            mask[self.rows(e)] = True
        return mask


def pack_problem(config: ExpertFfnConfig, case: FfnCase) -> FfnProblem:
    """The pool of `case` for `config`: expert e's rows in the reference's order at pool_offsets[e]; padding rows
    NaN (activations, SFs and top-k weights), so no valid output may depend on them."""
    from megamoe.weights import transform_weights

    if (case.hidden, case.intermediate, len(case.counts)) != (config.hidden, config.intermediate,
                                                              config.num_experts):
        raise ValueError(f"case (H={case.hidden}, I={case.intermediate}, E={len(case.counts)}) does not fit "
                         f"{config.name}")
    if config.fast_math != case.fast_math or config.clamp != (case.activation_clamp is not None):
        raise ValueError(f"case (fast_math={case.fast_math}, clamp={case.activation_clamp}) does not fit "
                         f"{config.name}")
    device = case.reference.y.device
    offsets = config.pool_offsets(case.counts)
    num_rows = config.num_pool_rows(case.counts)
    h = config.hidden
    l1_acts = torch.full((num_rows, h), FP8_NAN_CODE, dtype=torch.uint8, device=device)
    l1_acts_sf = torch.full((h // 128, num_rows), float("nan"), dtype=torch.float32, device=device)
    topk_weights = torch.full((num_rows,), float("nan"), dtype=torch.float32, device=device)
    for e, inter in enumerate(case.reference.experts):
        rows = slice(offsets[e], offsets[e] + case.counts[e])
        l1_acts[rows] = inter.x.view(torch.uint8)
        l1_acts_sf[:, rows] = inter.x_sf.t()
        topk_weights[rows] = inter.topk_weight
    (w1, w1_sf), (w2, w2_sf) = transform_weights(case.l1_weights, case.l2_weights)
    inputs = FfnInputs(l1_acts.view(torch.float8_e4m3fn), l1_acts_sf, topk_weights, w1, w1_sf.contiguous(),
                       w2.contiguous(), w2_sf.contiguous(),
                       torch.tensor(case.counts, dtype=torch.int32, device=device))
    return FfnProblem(config, case, offsets, inputs)


def make_problem(config: ExpertFfnConfig, counts: list[int], *, small_int: bool,
                 activation_clamp: float | str | None = None, seed: int = 0,
                 device: torch.device | str = "cuda") -> FfnProblem:
    """`make_case` for the config's shape and math, packed for the config."""
    if len(counts) != config.num_experts:
        raise ValueError(f"counts must have {config.num_experts} entries, got {len(counts)}")
    if config.clamp != (activation_clamp is not None):
        raise ValueError(f"activation_clamp must be given iff config.clamp ({config.clamp}), got {activation_clamp!r}")
    case = make_case(config.hidden, config.intermediate, counts, small_int=small_int, fast_math=config.fast_math,
                     activation_clamp=activation_clamp, seed=seed, device=device)
    return pack_problem(config, case)


def run_problem(problem: FfnProblem, outputs: FfnOutputs, *, num_blocks: int | None = None) -> None:
    """kernels.expert_ffn.run on the problem's pool and clamp into `outputs`."""
    run(problem.config, problem.inputs, outputs, activation_clamp=problem.activation_clamp, num_blocks=num_blocks)
