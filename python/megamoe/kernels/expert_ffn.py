"""The epilogue component's unit kernel (assembler/expert_ffn_kernel.cuh): the local expert FFN of one rank over a
pool, L1 grouped GEMM + L1 epilogue (SwiGLU x top-k weight, per-64 FP8 requant, TMA store, L1 completion counters),
then L2 grouped GEMM + L2 epilogue (BF16 staging, valid rows copied to [P, H]), in one persistent launch whose L2
producer waits for each pool block's L1 completion counter.

`make_problem` builds exact per-expert row counts, runs `megamoe.reference.moe(..., return_intermediates=True)` and
packs the pool from the reference's per-expert rows, so every kernel output has its reference counterpart."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from megamoe.heuristics import MAX_NUM_STAGES, MIN_NUM_STAGES, NUM_THREADS
from megamoe.heuristics import SMEM_CAPACITY_BYTES as SMEM_LIMIT
from megamoe.jit import compiler
from megamoe.jit.compiler import CompileResult

if TYPE_CHECKING:
    from megamoe.reference import RankIntermediates


BLOCK_N = BLOCK_K = 128
L1_OUTPUT_COLS = 64  # one interleaved 128-column L1 tile yields 64 output columns
MBARRIER_BYTES = 8
FP8_NAN_CODE = 0x7F
SF_EPSILON = 1e-10
FP8_MAX = 448.0


def _align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


@dataclass(frozen=True)
class ExpertFfnConfig:
    """One compiled variant. hidden H, intermediate I, num_experts E (local experts, the groups of the pool).
    clamp: the activation clamp is compiled in (its value is a launch argument); fast_math: __expf and approximate
    division in the SwiGLU; debug_l1_acc: also write the promoted L1 accumulators in fp32."""

    block_m: int
    hidden: int
    intermediate: int
    num_experts: int
    clamp: bool = False
    fast_math: bool = False
    debug_l1_acc: bool = False
    num_stages: int = 0  # 0: as many as fit (at most MAX_NUM_STAGES)
    band_m: int = 1  # m-blocks per band of the tile order, n-block-major inside a band (1: M-major)
    prefetch: bool = True  # the next stage awaited while a block's last WGMMA group runs

    def __post_init__(self) -> None:
        if self.band_m < 1:
            raise ValueError(f"band_m must be >= 1, got {self.band_m}")
        if self.block_m not in (32, 64, 128):
            raise ValueError(f"block_m must be 32, 64 or 128, got {self.block_m}")
        if self.hidden <= 0 or self.hidden % 128 or self.intermediate <= 0 or self.intermediate % 128:
            raise ValueError(f"hidden and intermediate must be positive multiples of 128, got hidden={self.hidden} "
                             f"intermediate={self.intermediate}")
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        if self.num_stages == 0:
            fixed = self.staging_bytes + 1024  # staging, and at most 1023 B of alignment before it
            object.__setattr__(self, "num_stages",
                               min(MAX_NUM_STAGES, (SMEM_LIMIT - fixed) // (self.stage_bytes + 2 * MBARRIER_BYTES)))
        if self.num_stages < MIN_NUM_STAGES or self.smem_bytes > SMEM_LIMIT:
            raise ValueError(f"{self}: {self.num_stages} stages need {self.smem_bytes} B of shared memory "
                             f"(limit {SMEM_LIMIT}, at least {MIN_NUM_STAGES} stages)")

    # Shared-memory plan (mirrors ExpertFfnTraits): [ring][staging]
    @property
    def stage_bytes(self) -> int:
        """A (64 rows at least), B, and SFA sized for L2's two per-64 SFs per K block (L1 uses half)."""
        return max(self.block_m, 64) * BLOCK_K + BLOCK_N * BLOCK_K + _align(2 * self.block_m * 4, 128)

    @property
    def ring_bytes(self) -> int:
        return self.num_stages * (self.stage_bytes + 2 * MBARRIER_BYTES)

    @property
    def staging_offset(self) -> int:
        return _align(self.ring_bytes, 1024)

    @property
    def staging_bytes(self) -> int:
        """max(L1: 2 buffers of (FP8 tile BLOCK_M x 64 B + BLOCK_M SFs), L2: BLOCK_M rows x 256 B): a union."""
        l1 = 2 * _align(self.block_m * (L1_OUTPUT_COLS + 4), 128)
        l2 = self.block_m * BLOCK_N * 2
        return max(l1, l2)

    @property
    def smem_bytes(self) -> int:
        return self.staging_offset + self.staging_bytes

    @property
    def num_l1_n_blocks(self) -> int:
        """L1 tiles per pool block (2 I / 128): the value each L1 completion counter reaches."""
        return 2 * self.intermediate // BLOCK_N

    @property
    def name(self) -> str:
        return (f"megamoe_expert_ffn_m{self.block_m}_h{self.hidden}_i{self.intermediate}_e{self.num_experts}"
                f"_{'clamp' if self.clamp else 'noclamp'}_{'fast' if self.fast_math else 'exact'}"
                f"{'_dbg' if self.debug_l1_acc else ''}_s{self.num_stages}"
                f"{f'_b{self.band_m}' if self.band_m != 1 else ''}{'' if self.prefetch else '_nopf'}")

    def pool_offsets(self, num_tokens_per_expert: list[int]) -> list[int]:
        from megamoe.scheduler import pool_offsets

        return pool_offsets(num_tokens_per_expert, self.block_m)

    def num_pool_rows(self, num_tokens_per_expert: list[int], spare_blocks: int = 1) -> int:
        """Pool rows for these counts: every expert padded to BLOCK_M, plus `spare_blocks` unused blocks at the
        end (the tests check the kernel leaves them alone); a multiple of BLOCK_M (hence of 4)."""
        from megamoe.scheduler import num_pool_blocks

        return (num_pool_blocks(num_tokens_per_expert, self.block_m) + spare_blocks) * self.block_m


def source(config: ExpertFfnConfig) -> str:
    flag = {True: "true", False: "false"}
    return f"""// Generated by megamoe.kernels.expert_ffn
#include "expert_ffn_kernel.cuh"

using Traits = megamoe::assembler::ExpertFfnTraits<{config.block_m}, {config.num_stages}, {config.hidden},
                                                   {config.intermediate}, {config.num_experts},
                                                   {flag[config.clamp]}, {flag[config.fast_math]},
                                                   {flag[config.debug_l1_acc]}, {config.band_m},
                                                   {flag[bool(config.prefetch)]}>;
static_assert(Traits::kSmemBytes == {config.smem_bytes}, "host and device disagree on the shared-memory size");
static_assert(Traits::kOffsetStaging == {config.staging_offset}, "host and device disagree on the staging offset");

extern "C" __global__ void __launch_bounds__(megamoe::kNumThreads, 1)
{config.name}(const __grid_constant__ CUtensorMap tensor_map_l1_a,
              const __grid_constant__ CUtensorMap tensor_map_l1_sfa,
              const __grid_constant__ CUtensorMap tensor_map_w1,
              const __grid_constant__ CUtensorMap tensor_map_l2_a,
              const __grid_constant__ CUtensorMap tensor_map_l2_sfa,
              const __grid_constant__ CUtensorMap tensor_map_w2,
              const __grid_constant__ CUtensorMap tensor_map_act_store,
              const float* w1_sf, const float* w2_sf, const int* num_tokens_per_expert, const float* topk_weights,
              float* act_sf, uint32_t* l1_done_count, __nv_bfloat16* out, float* l1_acc, uint32_t num_pool_rows,
              float clamp, const megamoe::DeviceEnv env) {{
    const megamoe::assembler::ExpertFfnMaps maps{{&tensor_map_l1_a, &tensor_map_l1_sfa, &tensor_map_w1,
                                                  &tensor_map_l2_a, &tensor_map_l2_sfa, &tensor_map_w2,
                                                  &tensor_map_act_store}};
    const megamoe::assembler::ExpertFfnParams params{{w1_sf, w2_sf, num_tokens_per_expert, topk_weights, act_sf,
                                                     l1_done_count, out, l1_acc, num_pool_rows, clamp}};
    megamoe::assembler::expert_ffn_impl<Traits>(maps, params, env);
}}
"""


def compile_expert_ffn(config: ExpertFfnConfig) -> CompileResult:
    return compiler.build(config.name, source(config))


# ---------------------------------------------------------------------------------------------------------------
# Launch
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class FfnInputs:
    """The kernel's inputs: a pool (experts back to back, each padded to BLOCK_M) and transformed weights."""

    l1_acts: Tensor               # e4m3 [P, H]
    l1_acts_sf: Tensor            # f32 [H/128, P] MN-major
    topk_weights: Tensor          # f32 [P]
    w1: Tensor                    # e4m3 [E, 2I, H], gate/up interleaved (transform_weights)
    w1_sf: Tensor                 # f32 [E, 2I/128, H/128]
    w2: Tensor                    # e4m3 [E, H, I]
    w2_sf: Tensor                 # f32 [E, H/128, I/128]
    num_tokens_per_expert: Tensor  # int32 [E] on the device

    @property
    def num_pool_rows(self) -> int:
        return self.l1_acts.shape[0]


@dataclass
class FfnOutputs:
    l2_acts: Tensor         # e4m3 [P, I]: every row of every used pool block (padding rows zero)
    l2_acts_sf: Tensor      # f32 [I/64, P]
    out: Tensor             # bf16 [P, H]: valid rows only
    l1_done_count: Tensor   # int32 [P / BLOCK_M] (u32 on the device), zero before the launch
    l1_acc: Tensor | None   # f32 [P, 2I] natural column order, valid rows only (debug variants)


def new_outputs(config: ExpertFfnConfig, num_pool_rows: int, device: torch.device | str = "cuda") -> FfnOutputs:
    """Outputs poisoned with NaN (e4m3 code 0x7f for the activations); completion counters zeroed."""
    i, h = config.intermediate, config.hidden
    nan = float("nan")
    return FfnOutputs(
        l2_acts=torch.full((num_pool_rows, i), FP8_NAN_CODE, dtype=torch.uint8,
                           device=device).view(torch.float8_e4m3fn),
        l2_acts_sf=torch.full((i // 64, num_pool_rows), nan, dtype=torch.float32, device=device),
        out=torch.full((num_pool_rows, h), nan, dtype=torch.bfloat16, device=device),
        l1_done_count=torch.zeros(num_pool_rows // config.block_m, dtype=torch.int32, device=device),
        l1_acc=(torch.full((num_pool_rows, 2 * i), nan, dtype=torch.float32, device=device)
                if config.debug_l1_acc else None),
    )


def _check(name: str, t: Tensor | None, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device) -> None:
    if t is None:
        raise ValueError(f"{name} is required by this variant, got None")
    if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous() or t.device != device:
        raise ValueError(f"{name} must be a contiguous {dtype} {shape} tensor on {device}, got {t.dtype} "
                         f"{tuple(t.shape)} (contiguous={t.is_contiguous()}) on {t.device}")


def validate(config: ExpertFfnConfig, inputs: FfnInputs, outputs: FfnOutputs,
             activation_clamp: float | None) -> None:
    """Every shape, dtype, device and alignment rule of the launch (ValueError naming the argument)."""
    p, h, i, e = inputs.num_pool_rows, config.hidden, config.intermediate, config.num_experts
    dev = inputs.l1_acts.device
    if p % config.block_m or p == 0:
        raise ValueError(f"the pool's row count must be a positive multiple of block_m={config.block_m}, got {p}")
    for name, t, dtype, shape in (
        ("l1_acts", inputs.l1_acts, torch.float8_e4m3fn, (p, h)),
        ("l1_acts_sf", inputs.l1_acts_sf, torch.float32, (h // 128, p)),
        ("topk_weights", inputs.topk_weights, torch.float32, (p,)),
        ("w1", inputs.w1, torch.float8_e4m3fn, (e, 2 * i, h)),
        ("w1_sf", inputs.w1_sf, torch.float32, (e, 2 * i // 128, h // 128)),
        ("w2", inputs.w2, torch.float8_e4m3fn, (e, h, i)),
        ("w2_sf", inputs.w2_sf, torch.float32, (e, h // 128, i // 128)),
        ("num_tokens_per_expert", inputs.num_tokens_per_expert, torch.int32, (e,)),
        ("l2_acts", outputs.l2_acts, torch.float8_e4m3fn, (p, i)),
        ("l2_acts_sf", outputs.l2_acts_sf, torch.float32, (i // 64, p)),
        ("out", outputs.out, torch.bfloat16, (p, h)),
        ("l1_done_count", outputs.l1_done_count, torch.int32, (p // config.block_m,)),
    ):
        _check(name, t, dtype, shape, dev)
    if config.debug_l1_acc:
        _check("l1_acc", outputs.l1_acc, torch.float32, (p, 2 * i), dev)
    if config.clamp != (activation_clamp is not None):
        raise ValueError(f"activation_clamp must be {'a number > 0' if config.clamp else 'None'} for {config.name}, "
                         f"got {activation_clamp!r}")
    if activation_clamp is not None and not activation_clamp > 0:
        raise ValueError(f"activation_clamp must be > 0, got {activation_clamp}")
    if outputs.l2_acts_sf.data_ptr() % 16:
        raise ValueError("l2_acts_sf must be 16 B aligned (bulk stores of the SF rows)")


def run(config: ExpertFfnConfig, inputs: FfnInputs, outputs: FfnOutputs, *, activation_clamp: float | None = None,
        num_blocks: int | None = None) -> None:
    """Launch the unit kernel (asynchronously, on the current stream). The pool's expert e occupies rows
    [pool_offsets(counts)[e], + counts[e]); counts must match `inputs.num_tokens_per_expert`."""
    from megamoe.jit import runtime
    from megamoe.jit.diagnostics import timeout_records

    validate(config, inputs, outputs, activation_clamp)
    kernel = runtime.kernel_for(compile_expert_ffn, config, NUM_THREADS)
    maps = _tensor_maps(config, inputs, outputs)
    env = timeout_records().device_env(rank=0)
    args = [*maps, runtime.ptr(inputs.w1_sf), runtime.ptr(inputs.w2_sf), runtime.ptr(inputs.num_tokens_per_expert),
            runtime.ptr(inputs.topk_weights), runtime.ptr(outputs.l2_acts_sf), runtime.ptr(outputs.l1_done_count),
            runtime.ptr(outputs.out), runtime.ptr(outputs.l1_acc), runtime.u32(inputs.num_pool_rows),
            runtime.f32(activation_clamp if activation_clamp is not None else 0.0), env]
    device = inputs.l1_acts.device
    kernel.launch(num_blocks or runtime.num_sms(device), args, config.smem_bytes, device=device)


def _tensor_maps(config: ExpertFfnConfig, inputs: FfnInputs, outputs: FfnOutputs) -> list:
    from megamoe.jit.runtime import TensorMap

    bm = config.block_m
    return [
        TensorMap(inputs.l1_acts, bm, BLOCK_K, swizzle_bytes=128),
        TensorMap(inputs.l1_acts_sf, 1, bm),
        TensorMap(inputs.w1.view(-1, config.hidden), BLOCK_N, BLOCK_K, swizzle_bytes=128),
        TensorMap(outputs.l2_acts, bm, BLOCK_K, swizzle_bytes=128),
        TensorMap(outputs.l2_acts_sf, 2, bm),
        TensorMap(inputs.w2.view(-1, config.intermediate), BLOCK_N, BLOCK_K, swizzle_bytes=128),
        TensorMap(outputs.l2_acts, bm, L1_OUTPUT_COLS),
    ]


# ---------------------------------------------------------------------------------------------------------------
# Problems for tests: exact per-expert counts, the reference's intermediates, the pool packed from them.
# ---------------------------------------------------------------------------------------------------------------
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
    run(problem.config, problem.inputs, outputs, activation_clamp=problem.activation_clamp, num_blocks=num_blocks)
