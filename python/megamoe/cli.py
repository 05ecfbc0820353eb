"""`megamoe` command line: info, demo, bench, jit."""
from __future__ import annotations

import argparse
import sys


def _cmd_info(args: argparse.Namespace) -> int:
    from megamoe import report

    report.print_info()
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from megamoe import demo

    demo.run(demo.DemoConfig(num_experts=args.experts, hidden=args.hidden, intermediate=args.intermediate,
                             num_topk=args.topk, num_ranks=args.ranks, num_tokens=args.tokens, seed=args.seed))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from megamoe import bench

    bench.main(args.name, args.json)
    return 0


def _cmd_jit(args: argparse.Namespace) -> int:
    from megamoe import report

    report.warm_jit_cache(check=args.check)
    return 0


def main(argv: list[str] | None = None) -> int:
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
    bench.add_argument("name", choices=["gemm"])
    bench.add_argument("--json", default=None, help="where to write the results (default megamoe-bench-NAME.json)")
    bench.set_defaults(fn=_cmd_bench)

    jit = sub.add_parser("jit", help="compile every kernel variant into the JIT cache")
    jit.add_argument("action", choices=["warm"])
    jit.add_argument("--check", action="store_true", help="also apply the compile checks of DESIGN section 3")
    jit.set_defaults(fn=_cmd_jit)

    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
