"""megamoe: one fused CUDA kernel for an expert-parallel FP8 MoE layer on NVIDIA Hopper (SM90).

    buf = megamoe.get_symm_buffer(group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden)
    l1, l2 = megamoe.transform_weights((w1, w1_sf), (w2, w2_sf))
    megamoe.prepare(buf)                      # optional, collective: compile and load before the first call
    megamoe.fused(y, l1, l2, buf, num_tokens=...)
    megamoe.reference.moe(...)   # the numerical contract
"""
from __future__ import annotations

from megamoe import api, fused, reference  # megamoe.fused: the package, callable as the public API (api.fused)
from megamoe.api import get_symm_buffer, prepare, transform_weights
from megamoe.buffer import SymmBuffer

__version__ = "0.1.0"

# Names for users coming from DeepGEMM's SM90 MegaMoE, with its signatures (megamoe.compat), and its utils module
from megamoe import compat, utils  # noqa: E402
from megamoe.compat import (  # noqa: E402
    bf16_mega_moe,
    fp4_fp4_mega_moe,
    fp8_fp4_mega_moe,
    fp8_fp4_mega_moe_sm90,
    fp8_mega_moe,
    fp8_mega_moe_sm90,
    get_symm_buffer_for_mega_moe,
    get_symm_buffer_for_sm90_mega_moe,
    get_token_alignment_for_mega_moe,
    get_token_alignment_for_sm90_mega_moe,
    mega_moe_pre_dispatch_sm90,
    transform_sf_into_required_layout,
    transform_weights_for_mega_moe,
    transform_weights_for_mega_moe_sm90,
    transform_weights_for_mega_moe_sm90_fp4,
)

__all__ = ["SymmBuffer", "fused", "get_symm_buffer", "prepare", "reference", "transform_weights", "compat", "utils",
           *(name for name in compat.__all__ if not name.isupper())]
