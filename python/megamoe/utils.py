"""`deep_gemm.utils` names serving code calls on megamoe in DeepGEMM's place (megamoe.compat)."""
from __future__ import annotations

import torch

from megamoe import quant

__all__ = ["per_token_cast_to_fp8"]


def per_token_cast_to_fp8(x: torch.Tensor, use_ue8m0: bool = False, gran_k: int = 128,
                          use_packed_ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepGEMM's per-token cast as vLLM's SM90 MegaMoE path calls it (use_ue8m0=False, gran_k=128:
    vllm-project/vllm@6cd8b6b4 vllm/models/deepseek_v4/nvidia/sm90_mega_moe.py:352): (e4m3 [T, H], float32
    [T, H/128]) of megamoe.quant.per_token_cast_to_fp8 (the contract's cast)."""
    if use_ue8m0 or use_packed_ue8m0:
        raise ValueError("megamoe keeps float32 scale factors (never UE8M0): use_ue8m0 and use_packed_ue8m0 must "
                         "be False")
    if gran_k != 128:
        raise ValueError(f"gran_k must be 128 (the recipe's per-128 activation scales), got {gran_k!r}")
    return quant.per_token_cast_to_fp8(x)
