"""`megamoe` command line: info, demo, bench, jit."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _cmd_info(args: argparse.Namespace) -> int:
    from megamoe import report

    report.print_info()
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from megamoe import demo

    demo.run(demo.DemoConfig(num_experts=args.experts, hidden=args.hidden, intermediate=args.intermediate,
                             num_topk=args.topk, num_ranks=args.ranks, num_tokens=args.tokens, seed=args.seed))
    return 0


COMM_ONLY_OPTIONS = ("tokens", "warmup", "iters", "compile_only", "ranks", "wave_fill", "phases", "shape")
FUSED_OPTIONS = ("tokens", "compile_only", "wave_fill", "phases", "shape")
FUSED_MULTI_OPTIONS = ("tokens", "warmup", "iters", "compile_only", "ranks")


def parse_int_list(text: str) -> list[int]:
    """"8,128,4096" -> [8, 128, 4096] (the CLI's list arguments)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise ValueError(f"expected comma-separated integers, got {text!r}")
    return values


def bench_options(args: argparse.Namespace) -> dict:
    """The keyword arguments of bench.main / bench.comm.precompile_comm from the `bench` arguments (ValueError
    when they do not fit the bench)."""
    from megamoe.bench import comm as bench_comm

    given = [f"--{name.replace('_', '-')}" for name in COMM_ONLY_OPTIONS if getattr(args, name) not in (None, False)]
    if args.name == "fused":
        others = [g for g in given if g[2:].replace("-", "_") not in FUSED_OPTIONS]
        if others:
            raise ValueError(f"{', '.join(others)} only apply to `megamoe bench comm`")
        options: dict = {} if args.shape is None else {"shape": args.shape}
        if args.compile_only:
            return options
        if args.tokens is not None:
            options["tokens"] = parse_int_list(args.tokens)
        if args.wave_fill is not None:
            fills = parse_int_list(args.wave_fill)
            if any(f < 0 for f in fills):
                raise ValueError(f"--wave-fill values must be >= 0 (0: one wave), got {args.wave_fill!r}")
            options["wave_fills"] = fills
        if args.phases:
            options["phases"] = True
        return options
    if args.wave_fill is not None or args.phases or args.shape is not None:
        raise ValueError("--wave-fill, --phases and --shape only apply to `megamoe bench fused`")
    if args.name == "fused_multi":
        from megamoe.bench import fused_multi

        others = [g for g in given if g[2:].replace("-", "_") not in FUSED_MULTI_OPTIONS]
        if others:
            raise ValueError(f"{', '.join(others)} do not apply to `megamoe bench fused_multi`")
        return _per_gpu_bench_options(args, fused_multi.MULTI_TOKENS, warmup=5, iters=20)
    if args.name != "comm":
        if given:
            raise ValueError(f"{', '.join(given)} only apply to `megamoe bench comm`")
        return {}
    return _per_gpu_bench_options(args, bench_comm.COMM_TOKENS, warmup=10, iters=50)


def _per_gpu_bench_options(args: argparse.Namespace, tokens: Sequence[int], *, warmup: int, iters: int) -> dict:
    """The options of a bench with one process per GPU (comm, fused_multi): the tokens per rank, and the rank counts
    to compile for (--compile-only) or the warm-up and timed runs (a run uses every visible GPU)."""
    from megamoe.bench import comm as bench_comm

    token_list = parse_int_list(args.tokens) if args.tokens is not None else list(tokens)
    if args.compile_only:
        return {"tokens": token_list, "ranks": parse_int_list(args.ranks) if args.ranks is not None else [2, 4, 8]}
    if args.ranks is not None:
        raise ValueError("--ranks only applies with --compile-only (a run uses every visible GPU: "
                         "CUDA_VISIBLE_DEVICES picks them)")
    options = {"tokens": token_list, "warmup": warmup if args.warmup is None else args.warmup,
               "iters": iters if args.iters is None else args.iters}
    bench_comm.check_comm_options(**options)
    return options


def _cmd_bench(args: argparse.Namespace) -> int:
    from megamoe import bench

    try:
        options = bench_options(args)
    except ValueError as exc:
        raise SystemExit(f"megamoe bench {args.name}: {exc}") from None
    if args.compile_only:
        from rich.console import Console

        if args.name == "fused":
            from megamoe.bench.fused import precompile_fused

            precompile_fused(**options)
            return 0
        if args.name == "fused_multi":
            from megamoe.bench.fused_multi import precompile_fused_multi

            precompile_fused_multi(**options)
            return 0
        from megamoe.bench.comm import precompile_comm

        precompile_comm(console=Console(), **options)
        return 0
    bench.main(args.name, args.json, **options)
    return 0


def _cmd_jit(args: argparse.Namespace) -> int:
    from megamoe import report

    report.warm_jit_cache(check=args.check)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line (its `fn` runs the command)."""
    from megamoe.bench import BENCHES

    parser = argparse.ArgumentParser(prog="megamoe", description="fused expert-parallel FP8 MoE for SM90")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="GPU, SMs, toolchain and JIT cache").set_defaults(fn=_cmd_info)

    demo = sub.add_parser("demo", help="run the MoE layer on a DSV4-Flash-like config (reference without a GPU)")
    demo.add_argument("--experts", type=int, default=256)
    demo.add_argument("--hidden", type=int, default=4096)
    demo.add_argument("--intermediate", type=int, default=2048)
    demo.add_argument("--topk", type=int, default=6)
    demo.add_argument("--ranks", type=int, default=8, help="deployment the config and layout are sized for")
    demo.add_argument("--tokens", type=int, default=128, help="tokens per rank")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(fn=_cmd_demo)

    bench = sub.add_parser("bench", help="benchmarks against cuBLAS / NCCL baselines (GPU)")
    bench.add_argument("name", choices=list(BENCHES))
    bench.add_argument("--json", default=None, help="where to write the results (default megamoe-bench-NAME.json)")
    comm = bench.add_argument_group("comm", "dispatch + combine round trip vs NCCL; one process per visible GPU")
    comm.add_argument("--tokens", default=None, help="tokens per rank, comma-separated (default 8,128,4096)")
    comm.add_argument("--warmup", type=int, default=None, help="warm-up runs per implementation (default 10)")
    comm.add_argument("--iters", type=int, default=None, help="timed runs per implementation (default 50)")
    comm.add_argument("--compile-only", action="store_true",
                      help="compile every kernel variant the bench launches into the JIT cache (no GPU; comm, fused, "
                           "fused_multi)")
    comm.add_argument("--ranks", default=None,
                      help="with --compile-only: rank counts (default 2,4,8; comm, fused_multi)")
    fused = bench.add_argument_group("fused", "the fused kernel beside the unit kernels and cuBLAS, one GPU "
                                     "(--tokens and --compile-only apply too)")
    fused.add_argument("--wave-fill", default=None,
                       help="wave fill targets to time, comma-separated: a wave closes at fill x grid L1 tiles, "
                            "0 = one wave (default heuristics.WAVE_FILL)")
    fused.add_argument("--shape", default=None, choices=["flash", "e256", "pro"],
                       help="flash (default): E 32 H 4096 I 2048 top-6 at T 8,128,1024,4096; e256: 256 local "
                            "experts at T 128; pro: E 48 H 7168 I 3072 top-6 at T 8,128,4096")
    fused.add_argument("--phases", action="store_true",
                       help="also the kernel's phase marks per case (head, pull, first L1, last L2, reduce, end)")
    bench.set_defaults(fn=_cmd_bench)

    jit = sub.add_parser("jit", help="compile every kernel variant into the JIT cache")
    jit.add_argument("action", choices=["warm"])
    jit.add_argument("--check", action="store_true", help="also apply the compile checks of DESIGN section 3")
    jit.set_defaults(fn=_cmd_jit)

    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
