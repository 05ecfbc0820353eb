"""The epilogue component's unit kernel (assembler/expert_ffn_kernel.cuh): the local expert FFN of one rank over a
pool, L1 grouped GEMM + L1 epilogue (SwiGLU x top-k weight, per-64 FP8 requant, TMA store, L1 completion counters),
then L2 grouped GEMM + L2 epilogue (BF16 staging, valid rows copied to [P, H], or full tiles TMA-stored), in one
persistent launch whose L2 producer waits for each pool block's L1 completion counter.

This module: the config, the generated source and the launch. Problems with their references and the checks of
the outputs: megamoe.testing.expert_ffn and megamoe.testing.expert_ffn_checks."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megamoe.heuristics import MAX_NUM_STAGES, MIN_NUM_STAGES, NUM_THREADS
from megamoe.heuristics import SMEM_CAPACITY_BYTES as SMEM_LIMIT
from megamoe.jit import compiler
from megamoe.jit.compiler import CompileResult

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
        """max(L1: 2 buffers of (FP8 tile BLOCK_M x 64 B + BLOCK_M SFs), L2: BLOCK_M rows x 256 B, as rows or as two
        64-column boxes): a union."""
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
              const uint8_t* w1,
              const __grid_constant__ CUtensorMap tensor_map_l2_a,
              const __grid_constant__ CUtensorMap tensor_map_l2_sfa,
              const uint8_t* w2,
              const __grid_constant__ CUtensorMap tensor_map_act_store,
              const __grid_constant__ CUtensorMap tensor_map_out_store,
              const float* w1_sf, const float* w2_sf, const int* num_tokens_per_expert, const float* topk_weights,
              float* act_sf, uint32_t* l1_done_count, __nv_bfloat16* out, float* l1_acc, uint32_t num_pool_rows,
              float clamp, const megamoe::DeviceEnv env) {{
    const megamoe::assembler::ExpertFfnMaps maps{{&tensor_map_l1_a, &tensor_map_l1_sfa, w1,
                                                  &tensor_map_l2_a, &tensor_map_l2_sfa, w2,
                                                  &tensor_map_act_store, &tensor_map_out_store}};
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
    w1: Tensor                    # e4m3 [E, 2I, H], gate/up interleaved, in the tile layout (transform_weights)
    w1_sf: Tensor                 # f32 [E, 2I/128, H/128]
    w2: Tensor                    # e4m3 [E, H, I] in the tile layout (transform_weights)
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
    if p // config.block_m >= 0xFFFF:  # epilogue/l1_epilogue.cuh: L1EpilogueState holds pool blocks in 16 bits
        raise ValueError(f"the pool must have fewer than 65535 blocks of block_m={config.block_m} rows, got {p} rows")
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
    from megamoe.jit import runtime
    from megamoe.jit.runtime import TensorMap

    bm = config.block_m
    return [
        TensorMap(inputs.l1_acts, bm, BLOCK_K, swizzle_bytes=128),
        TensorMap(inputs.l1_acts_sf, 1, bm),
        runtime.ptr(inputs.w1),
        TensorMap(outputs.l2_acts, bm, BLOCK_K, swizzle_bytes=128),
        TensorMap(outputs.l2_acts_sf, 2, bm),
        runtime.ptr(inputs.w2),
        TensorMap(outputs.l2_acts, bm, L1_OUTPUT_COLS),
        TensorMap(outputs.out, bm, BLOCK_N // 2, swizzle_bytes=128),  # one 64-column box of an L2 output tile
    ]
