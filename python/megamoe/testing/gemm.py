"""Problems for the GEMM component's tests and benchmarks (megamoe.kernels.gemm): a pool-like A with its MN-major
SF pool, the weights as the kernel reads them, and the exact reference of every expert's rows."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megamoe.kernels.gemm import GemmConfig, run


@dataclass
class GemmProblem:
    config: GemmConfig
    counts: list[int]
    offsets: list[int]
    a: torch.Tensor          # e4m3 [P, K] pool; padding rows hold random values (their results are discarded)
    a_sf: torch.Tensor       # f32 [K/128 or K/64, P] MN-major
    b: torch.Tensor          # e4m3 [E, N, K] as the kernel reads it (L1: gate/up interleaved; the tile layout)
    b_sf: torch.Tensor       # f32 [E, N/128, K/128] natural
    b_natural: torch.Tensor  # e4m3 [E, N, K] before the transform (L1) or b itself (L2)
    counts_device: torch.Tensor

    @property
    def num_pool_rows(self) -> int:
        return self.a.shape[0]

    def rows(self, expert_idx: int) -> slice:
        return slice(self.offsets[expert_idx], self.offsets[expert_idx] + self.counts[expert_idx])

    def reference(self, expert_idx: int) -> torch.Tensor:
        """fp32 [count, N] per DESIGN section 4, columns in the order the kernel writes them."""
        from megamoe import reference as ref
        from megamoe.weights import l1_interleave_permutation

        rows, cfg = self.rows(expert_idx), self.config
        a_sf = self.a_sf[:, rows].t().contiguous()
        if cfg.mode == "l1":
            h = ref.block_scaled_matmul(self.a[rows], a_sf, self.b_natural[expert_idx],
                                        ref._l1_scales(self.b_sf[expert_idx]), 128)
            return h[:, l1_interleave_permutation(cfg.n // 2, device=h.device)]
        return ref.block_scaled_matmul(self.a[rows], a_sf, self.b_natural[expert_idx],
                                       ref._l2_scales(self.b_sf[expert_idx]), 64)


def make_problem(config: GemmConfig, counts: list[int], *, small_int: bool, device: torch.device | str = "cuda",
                 generator: torch.Generator | None = None) -> GemmProblem:
    """Fresh random inputs. small_int: small-integer FP8 and power-of-two scales (DESIGN section 4, check 0),
    so every product and partial sum is exact and the result must match bit for bit."""
    from megamoe import quant
    from megamoe.weights import l1_interleave_permutation, tile_weights

    if len(counts) != config.num_experts:
        raise ValueError(f"counts must have {config.num_experts} entries, got {len(counts)}")
    offsets = config.pool_offsets(counts)
    num_rows = offsets[-1] + -(-counts[-1] // config.block_m) * config.block_m if counts else 0
    num_rows = max(4, -(-num_rows // 4) * 4)
    e, n, k, sf_k = config.num_experts, config.n, config.k, config.k // 128 * config.sf_per_k_block
    if small_int:
        a = quant.random_small_int_fp8((num_rows, k), generator=generator, device=device)
        a_sf = quant.random_pow2_scales((sf_k, num_rows), generator=generator, device=device)
        b = quant.random_small_int_fp8((e, n, k), generator=generator, device=device)
        b_sf = quant.random_pow2_scales((e, n // 128, k // 128), generator=generator, device=device)
    else:
        a = quant.fp8_e4m3_satfinite(torch.randn(num_rows, k, device=device, generator=generator) * 64)
        a_sf = torch.rand(sf_k, num_rows, device=device, generator=generator) / 64 + 1e-4
        b = quant.fp8_e4m3_satfinite(torch.randn(e, n, k, device=device, generator=generator) * 64)
        b_sf = torch.rand(e, n // 128, k // 128, device=device, generator=generator) / 1024 + 1e-6
    b_kernel = b
    if config.mode == "l1":
        perm = l1_interleave_permutation(n // 2, device=device)
        b_kernel = b.view(torch.uint8)[:, perm].contiguous().view(torch.float8_e4m3fn)
    b_kernel = tile_weights(b_kernel)
    counts_device = torch.tensor(counts, dtype=torch.int32, device=device)
    return GemmProblem(config, list(counts), offsets, a, a_sf.contiguous(), b_kernel, b_sf, b, counts_device)


def run_problem(problem: GemmProblem, d: torch.Tensor, **kwargs: Any) -> None:
    """kernels.gemm.run on the problem's inputs into d (kwargs: run's keyword arguments)."""
    run(problem.config, problem.a, problem.a_sf, problem.b, problem.b_sf, problem.counts_device, d, **kwargs)
