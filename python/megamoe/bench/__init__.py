"""Benchmarks (not tests): `megamoe bench NAME` runs one, prints its rich table and writes its JSON. Each times our
kernel side by side with its baselines in one run (medians of many CUDA-event-timed runs after warm-up) and sets
the times against the H200's measured ceilings.

  gemm       the grouped GEMM component against cuBLAS, one GPU
  ffn        the local expert FFN unit kernel against the same recipe unfused through cuBLAS, one GPU
  comm       the dispatch -> trivial expert -> combine unit kernel against an NCCL all_to_all_single round trip,
             one process per GPU; `megamoe bench comm --compile-only` fills the JIT cache without a GPU
  fused      the fused kernel (phase-serial and overlapped) beside the expert-FFN unit kernel on the same rows,
             warm and cold L2, one GPU; `megamoe bench fused --compile-only` fills the JIT cache without a GPU
  fused_multi the fused kernel on every visible GPU (2, 4 or 8, one process each) at DSV4-Flash and DSV4-Pro beside
             NCCL all-to-all + the cuBLAS FFN + NCCL combine, and the peer's published 8-GPU times;
             `megamoe bench fused_multi --compile-only [--ranks 2,4,8]` fills the JIT cache without a GPU
  comm_nccl  that NCCL baseline
  timing     the timers (CUDA events, shuffled rounds, graphs, queued runs) and the ceilings
  results    the records (Measurement, CaseResult), table cells and JSON of every bench

A bench is a module `megamoe.bench.NAME` with `bench_NAME(**options) -> list of CaseResult` and
`NAME_report(results) -> (the JSON's fields besides the results, the table)`, listed in BENCHES.
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any, Callable

BENCHES = ("gemm", "comm", "ffn", "fused", "fused_multi")


def resolve(name: str) -> tuple[Callable[..., list], Callable[[list], tuple[dict[str, Any], Any]]]:
    """(bench_NAME, NAME_report) of one bench."""
    if name not in BENCHES:
        raise ValueError(f"bench must be one of {sorted(BENCHES)}, got {name!r}")
    module = importlib.import_module(f"megamoe.bench.{name}")
    return getattr(module, f"bench_{name}"), getattr(module, f"{name}_report")


def main(name: str, json_path: str | None = None, **options: Any) -> list:
    """Run one bench (options: its keyword arguments), print its table, write its JSON."""
    import torch
    from rich.console import Console

    run, report = resolve(name)
    if not torch.cuda.is_available():
        raise SystemExit("megamoe bench needs a CUDA GPU")
    results = run(**options)
    console = Console()
    if not console.is_terminal:  # a log file: wide enough for the tables' columns
        console = Console(width=max(console.width, 240))
    fields, table = report(results)
    payload: dict[str, Any] = {"bench": name, **fields}
    console.print(table)
    path = Path(json_path or f"megamoe-bench-{name}.json")
    payload["results"] = [r.as_json() for r in results]
    path.write_text(json.dumps(payload, indent=1))
    console.print(f"wrote {path}")
    return results
