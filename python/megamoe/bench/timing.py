"""How the benches time (not tests): medians of many runs after warm-up, each between its own CUDA events;
rounds that time every runner once in shuffled orders (the H200's power state hits all alike); CUDA-graph capture;
chains of stages; back-to-back runs queued behind a sleep (GPU time, not launch overhead). And the ceilings
measured on the H200s that the tables set the times against.
"""
from __future__ import annotations

import random
import statistics
import time
from typing import Any, Callable, Sequence, TypeVar

import torch

K = TypeVar("K")
T = TypeVar("T")

# Ceilings measured on the H200s of this project (README "Benchmarks").
HBM_READ_TBPS = 4.36
FP8_DENSE_TFLOPS = 1350.0
BF16_DENSE_TFLOPS = 780.0
MAX_SLEEP_US = 200_000.0  # time_queued_us: the longest sleep it queues ahead of the timed runs
L2_FLUSH_BYTES = 256 << 20  # a write this large evicts the H200's 50 MB L2 (the cold-L2 timings)
GPU_CYCLES_PER_US = 2000  # torch.cuda._sleep spins in SM cycles; the H200 clocks at most 1.98 GHz: errs long


def time_us(fn: Callable[[], None], *, warmup: int = 5, iters: int = 30) -> float:
    """Median over `iters` runs of fn, each timed with its own CUDA events, after `warmup` runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3)
    return statistics.median(times)


def shuffled_rounds(timers: dict[K, Callable[[], T]], *, rounds: int) -> dict[K, list[T]]:
    """Each round calls every timer once, so that the GPU's clock and power state (the H200 runs into its power cap
    under load and clocks between 1.3 and 1.98 GHz) hits all of them alike instead of favouring whichever runs after
    a pause. The first round goes in the given order, every later one in its own (seeded, so repeatable) shuffle:
    the power state a runner meets depends on what ran just before it (measured: in a fixed order, the runner that
    always follows the heaviest case ran 5-10% slower than elsewhere). Returns each timer's per-round results."""
    results: dict[K, list[T]] = {key: [] for key in timers}
    keys = list(timers)
    for round_idx in range(rounds):
        order = keys if round_idx == 0 else random.Random(round_idx).sample(keys, len(keys))
        for key in order:
            results[key].append(timers[key]())
    return results


def time_rounds(runners: dict[str, Callable[[], None]], *, rounds: int, iters: int) -> dict[str, list[float]]:
    """shuffled_rounds of time_us (median of `iters`) over every runner: each runner's per-round medians."""
    return shuffled_rounds({name: (lambda fn=fn: time_us(fn, iters=iters)) for name, fn in runners.items()},
                           rounds=rounds)


def l2_flusher(device: torch.device | str = "cuda") -> Callable[[], None]:
    """A `before` for time_queued_us: writes L2_FLUSH_BYTES, so the timed run starts with a cold L2."""
    scratch = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)

    def flush() -> None:
        scratch.fill_(0x5A)

    return flush


def graphed(fn: Callable[[], None], capture_error_mode: str = "global") -> Callable[[], None]:
    """Capture fn (e.g. a per-group loop of launches) in a CUDA graph; returns its replay. capture_error_mode as
    torch.cuda.graph ("thread_local" for NCCL: its watchdog thread queries events during the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside capture (cuBLAS handles, workspaces)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=capture_error_mode):
        fn()

    # The replay holds fn: the tensors only its closure references (outputs, scales allocated before the capture)
    # must live as long as the graph that reads and writes them; dropped, the allocator hands their memory on.
    def replay(fn: Callable[[], None] = fn) -> None:
        graph.replay()

    return replay


def time_stages_us(stages: Sequence[Callable[[Any], Any]], *, warmup: int = 5, iters: int = 30) -> list[float]:
    """[round trip, stage 0, stage 1, ...] medians (us). Stage i gets stage i - 1's return value (the first gets
    None). Each iteration has its own CUDA events and is waited for (for chains with host syncs inside)."""

    def chain(events: list[Any] | None) -> None:
        value = None
        for i, stage in enumerate(stages):
            if events:
                events[i].record()
            value = stage(value)
        if events:
            events[-1].record()

    for _ in range(warmup):
        chain(None)
    torch.cuda.synchronize()
    totals: list[float] = []
    per_stage: list[list[float]] = [[] for _ in stages]
    for _ in range(iters):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(stages) + 1)]
        chain(events)
        events[-1].synchronize()
        totals.append(events[0].elapsed_time(events[-1]) * 1e3)
        for i in range(len(stages)):
            per_stage[i].append(events[i].elapsed_time(events[i + 1]) * 1e3)
    return [statistics.median(totals)] + [statistics.median(t) for t in per_stage]


def time_queued_us(fn: Callable[[], Any], *, warmup: int = 5, iters: int = 30,
                   before: Callable[[], Any] | None = None) -> dict[str, float]:
    """`iters` back-to-back runs of fn, each between its own CUDA events, enqueued behind a sleep kernel long
    enough for the host to enqueue them all: the intervals are GPU time, not launch overhead (collective kernels
    keep their ranks in step by themselves). `before` (e.g. an L2 flush) runs ahead of each timed run, outside its
    interval. Returns median/mean/min/max (us), the host's time per call, the sleep and host_bound = 1.0 when the
    host still fell behind (the numbers then include launch overhead)."""
    host = []
    for _ in range(warmup):
        wall = time.perf_counter()
        fn()
        host.append((time.perf_counter() - wall) * 1e6)
    torch.cuda.synchronize()
    # The median ignores the first call's module load / JIT; the cap keeps the ranks' sleeps (and so their start
    # skew, which a peer spends spinning in the kernel's barrier) far below MEGAMOE_TIMEOUT_S.
    sleep_us = min(1.5 * statistics.median(host) * (iters + 1) + 500.0, MAX_SLEEP_US)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    torch.cuda._sleep(int(sleep_us * GPU_CYCLES_PER_US))
    wall = time.perf_counter()
    if before is None:
        for i in range(iters):
            events[i].record()
            fn()
        events[-1].record()
    else:
        stops = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for i in range(iters):
            before()
            events[i].record()
            fn()
            stops[i].record()
        events[-1].record()
    enqueue_us = (time.perf_counter() - wall) * 1e6
    events[-1].synchronize()
    if before is None:
        times = [events[i].elapsed_time(events[i + 1]) * 1e3 for i in range(iters)]
    else:
        times = [events[i].elapsed_time(stops[i]) * 1e3 for i in range(iters)]
    return {"median_us": statistics.median(times), "mean_us": statistics.mean(times),
            "min_us": min(times), "max_us": max(times), "host_us_per_call": enqueue_us / iters,
            "sleep_us": sleep_us, "host_bound": float(enqueue_us > sleep_us)}
