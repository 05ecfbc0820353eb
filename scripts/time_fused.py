"""First timing of the fused kernel on one GPU (a profiling tool; `megamoe bench fused` is the benchmark to come):
the DSV4-Flash single-rank load (E 32 local experts, H 4096, I 2048, top-6), routing top-k of randn(T, E) (seed 0),
warm L2, GPU time between CUDA events behind a sleep (bench.timing.time_queued_us), serial and overlapped order,
against the weight-read floor of the experts touched (4.36 TB/s). Compile the variants here first with
--compile-only (PYTHONPATH=python)."""
from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.table import Table

from megamoe import weights
from megamoe.bench.timing import HBM_READ_TBPS, time_queued_us
from megamoe.buffer import allocate
from megamoe.fused import compile_fused, config_for
from megamoe.layout import SymmLayout

E, H, I, TOPK, T_MAX = 32, 4096, 2048, 6, 4096


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 128, 1024, 4096])
    parser.add_argument("--compile-only", action="store_true")
    args = parser.parse_args()
    layout = SymmLayout.create(1, E, T_MAX, TOPK, H, I)
    if args.compile_only:
        for serial in (True, False):
            compile_fused(config_for(layout, serial=serial))
        return
    from megamoe import fused

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    w1 = (torch.randn(E, 2 * I, H, device=device, generator=gen) * 0.05).to(torch.float8_e4m3fn)
    w2 = (torch.randn(E, H, I, device=device, generator=gen) * 0.05).to(torch.float8_e4m3fn)
    w1_sf = torch.rand(E, 2 * I // 128, H // 128, device=device, generator=gen) + 0.5
    w2_sf = torch.rand(E, H // 128, I // 128, device=device, generator=gen) + 0.5
    l1, l2 = weights.transform_weights((w1, w1_sf), (w2, w2_sf))
    buf = allocate(None, layout, device)
    expert_bytes = (2 * I * H + H * I) * 1 + (2 * I // 128 * H // 128 + H // 128 * I // 128) * 4
    table = Table(title=f"fused kernel, E {E} H {H} I {I} top-{TOPK}, one H200, warm L2 (median us)")
    for col in ("T", "experts", "max rows", "floor us", "serial", "overlapped", "overlapped / floor"):
        table.add_column(col, justify="right")
    for t in args.tokens:
        scores = torch.randn(t, E, generator=torch.Generator().manual_seed(0))
        idx = scores.topk(TOPK, dim=1).indices
        buf.x[:t].copy_((torch.randn(t, H, device=device) * 0.5).to(torch.float8_e4m3fn))
        buf.x_sf[:t].copy_(torch.rand(t, H // 128, device=device) + 0.5)
        buf.topk_idx[:t].copy_(idx)
        buf.topk_weights[:t].copy_(torch.rand(t, TOPK, device=device))
        counts = torch.bincount(idx.flatten(), minlength=E)
        touched = int((counts > 0).sum())
        floor = touched * expert_bytes / (HBM_READ_TBPS * 1e12) * 1e6
        y = torch.empty(t, H, dtype=torch.bfloat16, device=device)
        times = {}
        for serial in (True, False):
            times[serial] = time_queued_us(lambda: fused.run(y, l1, l2, buf, t, serial=serial), iters=30)["median_us"]
        table.add_row(str(t), str(touched), str(int(counts.max())), f"{floor:.1f}", f"{times[True]:.1f}",
                      f"{times[False]:.1f}", f"{times[False] / floor:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
