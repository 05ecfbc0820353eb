"""megamoe: one fused CUDA kernel for an expert-parallel FP8 MoE layer on NVIDIA Hopper (SM90).

    buf = megamoe.get_symm_buffer(group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden)
    l1, l2 = megamoe.transform_weights((w1, w1_sf), (w2, w2_sf))
    megamoe.fused(y, l1, l2, buf, num_tokens=...)
    megamoe.reference.moe(...)   # the numerical contract
"""
from __future__ import annotations

from megamoe import api, fused, reference  # megamoe.fused: the package, callable as the public API (api.fused)
from megamoe.api import get_symm_buffer, transform_weights
from megamoe.buffer import SymmBuffer

__version__ = "0.1.0"

# Names for users coming from DeepGEMM's SM90 MegaMoE (its signatures: megamoe.api)
from megamoe.api import fp8_mega_moe, get_symm_buffer_for_mega_moe  # noqa: E402

get_symm_buffer_for_sm90_mega_moe = get_symm_buffer_for_mega_moe
transform_weights_for_mega_moe = transform_weights
transform_weights_for_mega_moe_sm90 = transform_weights

__all__ = [
    "SymmBuffer", "fused", "get_symm_buffer", "reference", "transform_weights",
    "fp8_mega_moe", "get_symm_buffer_for_mega_moe", "get_symm_buffer_for_sm90_mega_moe",
    "transform_weights_for_mega_moe", "transform_weights_for_mega_moe_sm90",
]
