"""A DeepSeek-style MoE block on megamoe: router + top-k in torch, the routed experts through megamoe.layer.MoELayer
(one fused kernel), a shared expert in torch; prints the latency of each part per layer.

    PYTHONPATH=python python examples/deepseek_moe_block.py                     # one GPU: every expert local
    torchrun --nproc-per-node 8 examples/deepseek_moe_block.py --experts 256  # 8 GPUs: experts split over ranks

The weights are random (synthetic checkpoint tensors in DeepSeek V3's format, loaded through load_weights), so the
output is not a model's: the point is the call sequence and the time it takes.
"""
from __future__ import annotations

import argparse
import os

import torch

from megamoe.layer import MoELayer
from megamoe.testing.layer import PREFIX, synthetic_experts


class SharedExpert(torch.nn.Module):
    """The always-on expert of DeepSeek V3's MoE block, in BF16 torch."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up = torch.nn.Linear(hidden, 2 * intermediate, bias=False, dtype=torch.bfloat16)
        self.down = torch.nn.Linear(intermediate, hidden, bias=False, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(torch.nn.functional.silu(gate) * up)


class MoEBlock(torch.nn.Module):
    """Router (sigmoid scores, top-k, renormalized weights as DeepSeek V3), routed experts, shared expert."""

    def __init__(self, routed: MoELayer, hidden: int, shared_intermediate: int) -> None:
        super().__init__()
        self.routed = routed
        self.router = torch.nn.Linear(hidden, routed.num_experts, bias=False, dtype=torch.bfloat16)
        self.shared = SharedExpert(hidden, shared_intermediate)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(self.router(x).float())
        weights, idx = scores.topk(self.routed.num_topk, dim=-1)
        return idx.to(torch.int32), (weights / weights.sum(dim=-1, keepdim=True)).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx, weights = self.route(x)
        return self.routed(x, idx, weights) + self.shared(x)


def time_us(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Default: DSV4-Flash's routed experts as one GPU of an 8-GPU deployment holds them (32 of 256 experts); under
    # torchrun, --experts is the total split over the ranks
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--topk", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per rank in each forward")
    parser.add_argument("--max-tokens", type=int, default=4096, help="the buffer's tokens per rank")
    parser.add_argument("--layers", type=int, default=2, help="MoE blocks (one symmetric buffer each)")
    args = parser.parse_args()

    group = None
    rank = 0
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        import torch.distributed as dist

        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        group, rank = dist.group.WORLD, dist.get_rank()
    else:
        torch.cuda.set_device(0)
    torch.manual_seed(rank)

    blocks = []
    for layer_idx in range(args.layers):
        routed = MoELayer(args.experts, args.topk, args.hidden, args.intermediate, args.max_tokens, group=group,
                          device="cuda")
        # This rank's experts only: a real checkpoint is read the same way (megamoe.checkpoint.SafetensorsFiles)
        tensors = synthetic_experts(routed.num_local_experts, args.hidden, args.intermediate, seed=layer_idx)
        renamed = {name.replace(f"{PREFIX}{j}.", f"{PREFIX}{e}."): t for j, e in enumerate(routed.local_expert_ids)
                   for name, t in tensors.items() if name.startswith(f"{PREFIX}{j}.")}
        routed.load_weights(renamed, prefix=PREFIX)
        blocks.append(MoEBlock(routed, args.hidden, args.intermediate).cuda())

    x = torch.randn(args.tokens, args.hidden, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        for layer_idx, block in enumerate(blocks):
            idx, weights = block.route(x)
            # Eager calls include the host's work (argument and routing checks: device syncs); serving replays
            # CUDA graphs, timed beside them (captured after an eager call compiled and loaded the kernels)
            eager = time_us(lambda: block(x))
            y = block(x)
            graphs = {}
            for name, fn in (("route", lambda: block.route(x)), ("routed", lambda: block.routed(x, idx, weights)),
                             ("shared", lambda: block.shared(x)), ("block", lambda: block(x))):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
                graphs[name] = time_us(graph.replay)
            torch.cuda.synchronize()
            if rank == 0:
                print(f"layer {layer_idx}: {args.tokens} tokens/rank, E {args.experts} top-{args.topk} "
                      f"H {args.hidden} I {args.intermediate} (CUDA graphs): router + top-k {graphs['route']:.1f} us, "
                      f"routed experts (megamoe) {graphs['routed']:.1f} us, shared expert {graphs['shared']:.1f} "
                      f"us, block {graphs['block']:.1f} us; eager block {eager:.1f} us; "
                      f"|y| rms {y.float().pow(2).mean().sqrt():.3e}")
    if group is not None:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()
