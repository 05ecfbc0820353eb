"""gpu tier: the call sequences of SGLang's and vLLM's SM90 MegaMoE paths, replayed call by call against megamoe
imported under the name they use (`import megamoe as deep_gemm`), each output checked against the reference.
Each replayed call cites the framework line it mirrors (the research behind the citations read
sgl-project/sglang@27c5bb78 python/sglang/srt/layers/moe/mega_moe_sm90.py and @04fa8c01 .../mega_moe.py,
vllm-project/vllm@6cd8b6b4 vllm/models/deepseek_v4/nvidia/sm90_mega_moe.py, deepseek-ai/DeepGEMM@0274ad7b
deep_gemm/mega/__init__.py). The buffer comes from a process group (gloo, one rank), as the frameworks pass one."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from megamoe import quant, reference  # noqa: E402
from megamoe.testing.layer import routed_hidden_states  # noqa: E402
from test_fused_gpu import max_y_rel_l2  # noqa: E402

E, TOPK, H, I = 8, 6, 1024, 512
SWIGLU_LIMIT = 10.0  # the clamp DeepSeek V4's config passes as swiglu_limit


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _checkpoint_weights(seed: int):
    """w13 FP8 [E, 2I, H] (gate rows, then up rows) with float32 128x128 scale_inv, w2 FP8 [E, H, I] with its
    scale_inv: the experts' parameters as both frameworks load them."""
    gen = torch.Generator().manual_seed(seed)
    w13, w13_s = quant.per_block_cast_to_fp8(torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5)
    w2, w2_s = quant.per_block_cast_to_fp8(torch.randn(E, H, I, generator=gen) / I ** 0.5)
    return [t.cuda() for t in (w13, w13_s, w2, w2_s)]


def _check(y: torch.Tensor, hidden_states, ids, weights, w, clamp) -> float:
    x, x_sf = quant.per_token_cast_to_fp8(hidden_states.cpu())
    y_ref = reference.moe(x, x_sf, ids.cpu().long(), weights.cpu().float(), (w[0].cpu(), w[1].cpu()),
                          (w[2].cpu(), w[3].cpu()), activation_clamp=clamp, fast_math=True)
    err = reference.rel_l2(y.float().cpu(), y_ref.float())
    bound = max_y_rel_l2(y.shape[0])
    assert err <= bound, f"y rel-L2 {err:.3e} > {bound}"
    return err


@pytest.mark.gpu
def test_vllm_sm90_mega_moe_sequence(process_group) -> None:
    import megamoe as deep_gemm

    w = _checkpoint_weights(0)
    # finalize_weights: the checkpoint's FP8 weights and float32 block scales as they are (sm90_mega_moe.py:211-216)
    l1, l2 = deep_gemm.transform_weights_for_mega_moe_sm90((w[0], w[1]), (w[2], w[3]))
    # the cumulative recv stats, int32 [E_local] zeros, allocated once (sm90_mega_moe.py:217-221)
    stats = torch.zeros(E, dtype=torch.int32, device="cuda")
    # get_symm_buffer: six positional arguments, max_num_batched_tokens unaligned (sm90_mega_moe.py:246-253)
    max_num_batched_tokens = 100
    buf = deep_gemm.get_symm_buffer_for_sm90_mega_moe(process_group, E, max_num_batched_tokens, TOPK, H, I)
    # DeepGEMM's SM90 factory rounds the token count up to 128 (deep_gemm/mega/__init__.py:166-167)
    assert buf.num_max_tokens_per_rank == 128
    expected_stats = torch.zeros(E, dtype=torch.int64)
    for call, num_tokens in enumerate((100, 37, 1, 100)):
        hidden_states, topk_ids, topk_weights = (t.cuda() for t in routed_hidden_states(num_tokens, H, E, TOPK,
                                                                                        call))
        # the token bound (sm90_mega_moe.py:313-317) and the output, exactly num_tokens rows (:318)
        assert num_tokens <= max_num_batched_tokens
        y = torch.empty_like(hidden_states, dtype=torch.bfloat16)
        # the buffer fill: DeepGEMM's per-token cast, then four copies into [:num_tokens] (sm90_mega_moe.py:352-358)
        x_fp8, x_sf = deep_gemm.utils.per_token_cast_to_fp8(hidden_states, use_ue8m0=False, gran_k=128)
        buf.x[:num_tokens].copy_(x_fp8)
        buf.x_sf[:num_tokens].copy_(x_sf)
        buf.topk_idx[:num_tokens].copy_(topk_ids.to(torch.int64))
        buf.topk_weights[:num_tokens].copy_(topk_weights.to(torch.float32))
        # the kernel, no recipe or activation passed (sm90_mega_moe.py:363-371)
        deep_gemm.fp8_mega_moe_sm90(y, l1, l2, buf, cumulative_local_expert_recv_stats=stats,
                                    activation_clamp=SWIGLU_LIMIT, fast_math=True)
        torch.cuda.synchronize()
        err = _check(y, hidden_states, topk_ids, topk_weights, w, SWIGLU_LIMIT)
        expected_stats += torch.bincount(topk_ids.flatten().cpu(), minlength=E)
        print(f"vLLM call {call} T {num_tokens}: y rel-L2 {err:.3e}")
    assert torch.equal(stats.cpu().long(), expected_stats)


@pytest.mark.gpu
def test_sglang_sm90_mega_moe_sequence(process_group) -> None:
    import megamoe as deep_gemm

    # availability: the two entry points SGLang probes for (mega_moe_sm90.py:31-42)
    assert hasattr(deep_gemm, "fp8_mega_moe") and hasattr(deep_gemm, "mega_moe_pre_dispatch_sm90")
    w = _checkpoint_weights(1)
    # build_sm90_mega_moe_experts_weights without SGLANG_OPT_FIX_MEGA_MOE_MEMORY: each scale through
    # transform_sf_into_required_layout, then the weight transform (mega_moe_sm90.py:153-176)
    w13_s = deep_gemm.transform_sf_into_required_layout(w[1], mn=2 * I, k=H, recipe=(128, 128), num_groups=E,
                                                        disable_ue8m0_cast=True)
    w2_s = deep_gemm.transform_sf_into_required_layout(w[3], mn=H, k=I, recipe=(128, 128), num_groups=E,
                                                       disable_ue8m0_cast=True)
    l1, l2 = deep_gemm.transform_weights_for_mega_moe_sm90((w[0], w13_s), (w[2], w2_s))
    # _get_mega_moe_symm_buffer: the generic name even on SM90, with num_shared_experts and mma_type
    # (mega_moe.py:147-157); the build SGLang runs rounds the token count up to 384 there
    num_max_tokens_per_rank = 200  # SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK (mega_moe.py:56-59)
    buf = deep_gemm.get_symm_buffer_for_mega_moe(process_group, E, num_max_tokens_per_rank, TOPK, H, I,
                                                 num_shared_experts=0, mma_type="fp8xfp4", activation="swiglu")
    assert buf.num_max_tokens_per_rank == 384
    routed_scaling_factor = 2.5  # moe.routed_scaling_factor when not fused into top-k (mega_moe_sm90.py:55-58)
    for call, num_tokens in enumerate((150, 0, 5, 200)):
        hidden_states, topk_ids, topk_weights = (t.cuda() for t in routed_hidden_states(num_tokens, H, E, TOPK,
                                                                                        10 + call))
        # ids int32, weights float32 (mega_moe.py:393-394)
        topk_ids_in, topk_weights_in = topk_ids.to(torch.int32), topk_weights.to(torch.float32)
        # the buffer fill: cast, widen, scale the weights, clear the rows past num_tokens (mega_moe_sm90.py:60-71)
        buf.topk_idx.fill_(-7)
        deep_gemm.mega_moe_pre_dispatch_sm90(hidden_states, topk_ids_in, topk_weights_in, buf.x, buf.x_sf,
                                             buf.topk_idx, buf.topk_weights, num_tokens=num_tokens, group_size=128,
                                             routed_scaling_factor=routed_scaling_factor)
        # y with at least one row (mega_moe_sm90.py:73-77), the kernel (:78-87), the valid rows (:88)
        y = torch.empty((max(num_tokens, 1), H), dtype=torch.bfloat16, device="cuda")
        deep_gemm.fp8_mega_moe(y, l1, l2, buf, recipe=(128, 128, 128), activation="swiglu",
                               activation_clamp=SWIGLU_LIMIT, fast_math=True)
        y = y[:num_tokens]
        torch.cuda.synchronize()
        assert bool((buf.topk_idx[num_tokens:] == -1).all()) and bool((buf.topk_weights[num_tokens:] == 0).all())
        if num_tokens:
            scaled = topk_weights_in * routed_scaling_factor  # the fill's fp32 product
            assert torch.equal(buf.topk_weights[:num_tokens], scaled)
            err = _check(y, hidden_states, topk_ids, scaled, w, SWIGLU_LIMIT)
            print(f"SGLang call {call} T {num_tokens}: y rel-L2 {err:.3e}")


@pytest.mark.compile
def test_compat_variants_compile() -> None:
    """compile tier: the fused variants these replays launch (the buffers' rounded token counts, the clamp)."""
    from megamoe.fused import compile_fused, config_for
    from megamoe.jit import checks
    from megamoe.layout import SymmLayout

    for max_tokens in (128, 384):
        result = compile_fused(config_for(SymmLayout.create(1, E, max_tokens, TOPK, H, I), clamp=True))
        problems = [v for v in checks.violations(result, checks.CheckOptions(expect_qgmma=True))
                    if "spill" not in v and "stack frame" not in v and "LDL/STL" not in v]
        assert not problems, problems
