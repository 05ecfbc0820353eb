"""Same-call A/B of fused-kernel builds (the GPU machines differ by 2-5% between calls, so two builds are compared
only inside one call: notes/fused.md). Each build is a source tree of its own with its own JIT cache under
.jit-ab/NAME/ (ignored by git; carry ".jit-ab" to the device):

  here:    PYTHONPATH=python python3 scripts/ab_fused.py prepare base=HEAD new=WORKTREE --tokens 8,128
  device:  python3 scripts/ab_fused.py run base new --tokens 8,128 --rounds 2

`prepare` extracts each revision (git archive; WORKTREE: the tracked and untracked non-ignored files as they are)
and compiles the fused variant of the call's config at each T into its cache. `run` times the builds in alternating
order, one process per build and round (the call's config, flash or another bench shape, routing and seeds of
`megamoe bench fused`, cold and warm medians, the phase marks of the last round; the expert-FFN unit kernel on the
same rows), checks y against the reference, and prints one table."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
AB_DIR = ROOT / ".jit-ab"


def tree_env(name: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(AB_DIR / name / "tree" / "python"),
                MEGAMOE_JIT_CACHE_DIR=str(AB_DIR / name / "cache"))


def extract_tree(spec: str) -> str:
    """NAME=REV: the revision's files (REV a git revision, or WORKTREE: the tracked and untracked non-ignored files
    as they are) into .jit-ab/NAME/tree; returns NAME."""
    name, rev = spec.split("=", 1)
    tree = AB_DIR / name / "tree"
    subprocess.run(["rm", "-rf", str(tree)], check=True)
    tree.mkdir(parents=True)
    if rev == "WORKTREE":
        files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                               capture_output=True).stdout
        pack = subprocess.run(["tar", "-c", "--null", "-T", "-"], cwd=ROOT, input=files, check=True,
                              capture_output=True).stdout
    else:
        pack = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=pack, check=True)
    return name


def prepare(specs: list[str], tokens: str, shape: str) -> None:
    for spec in specs:
        name = extract_tree(spec)
        subprocess.run([sys.executable, __file__, "compile", "--tokens", tokens, "--shape", shape],
                       env=tree_env(name), check=True)


def compile_variants(tokens: list[int], shape: str) -> None:
    from megamoe.bench.fused import FUSED_SHAPES, expected_load
    from megamoe.fused import compile_fused, config_for
    from megamoe.layout import SymmLayout

    from megamoe.bench.fused import unit_kernel_config
    from megamoe.kernels.expert_ffn import compile_expert_ffn

    spec = FUSED_SHAPES[shape]
    layout = SymmLayout.create(1, spec.num_experts, spec.max_tokens, spec.num_topk, spec.hidden, spec.intermediate)
    for t in tokens:
        config = config_for(layout, expected_tokens_per_expert=expected_load(spec, t))
        compile_fused(config)
        compile_expert_ffn(unit_kernel_config(spec, config.block_m))


def time_build(tokens: list[int], shape: str, iters: int) -> dict[str, dict]:
    """The call's config at each T and seed of the bench: cold / warm medians, y rel-L2, warm phase marks; and the
    expert-FFN unit kernel on the same rows (cold / warm medians), as `megamoe bench fused` runs it."""
    import torch

    from megamoe import reference
    from megamoe.bench.fused import (FUSED_SEEDS, FUSED_SHAPES, bench_setup, expected_load, load_routed_inputs,
                                     unit_kernel_runner)
    from megamoe.bench.timing import time_queued_us
    from megamoe.fused import FusedConfig
    from megamoe.fused.launch import PHASES
    from megamoe.fused.launch import run as fused_run
    from megamoe.jit.diagnostics import PhaseTimes

    dev = torch.device("cuda")
    spec = FUSED_SHAPES[shape]
    e, h = spec.num_experts, spec.hidden
    natural, l1, l2, buf, flush = bench_setup(spec, dev)
    out: dict[str, dict] = {}
    for t in tokens:
        for seed in FUSED_SEEDS:
            x, x_sf, idx, tw = load_routed_inputs(buf, spec, t, seed, dev)
            y = torch.full((t, h), float("nan"), dtype=torch.bfloat16, device=dev)
            expected = expected_load(spec, t)

            def call(**kwargs: object) -> FusedConfig:
                return fused_run(y, l1, l2, buf, t, expected_tokens_per_expert=expected, **kwargs)

            config = call()
            torch.cuda.synchronize()
            y_ref = reference.moe(x, x_sf, idx, tw, natural[0], natural[1], fast_math=True)
            err = reference.rel_l2(y.float(), y_ref.float())
            cold = time_queued_us(call, warmup=5, iters=iters, before=flush)["median_us"]
            warm = time_queued_us(call, warmup=5, iters=iters)["median_us"]
            for _ in range(3):  # warm: the marks of the last of three calls
                timer = PhaseTimes(PHASES, dev)
                call(phase_times=timer)
            torch.cuda.synchronize()
            counts = torch.bincount(idx.flatten(), minlength=e).tolist()
            unit_kernel = unit_kernel_runner(buf, spec, config.block_m, counts, (l1, l2))
            ffn_cold = time_queued_us(unit_kernel, warmup=5, iters=iters, before=flush)["median_us"]
            ffn_warm = time_queued_us(unit_kernel, warmup=5, iters=iters)["median_us"]
            out[f"T {t} seed {seed}"] = dict(cold=cold, warm=warm, err=err, phases=timer.ends_us(),
                                             ffn_cold=ffn_cold, ffn_warm=ffn_warm)
    return out


def run(names: list[str], tokens: str, shape: str, rounds: int, iters: int) -> None:
    results: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            proc = subprocess.run([sys.executable, __file__, "inner", "--tokens", tokens, "--shape", shape,
                                   "--iters", str(iters)], env=tree_env(name), capture_output=True, text=True)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                print(f"{name} round {r} FAILED (rc {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
                continue
            results[name].append(json.loads(lines[0][len("RESULT "):]))
            print(f"round {r}: {name} done", flush=True)
    cases = next((list(runs[0]) for runs in results.values() if runs), [])
    for case in cases:
        print(f"== {case}")
        for name in names:
            runs = [run_[case] for run_ in results[name]]
            if not runs:
                continue
            cold = " ".join(f"{x['cold']:.1f}" for x in runs)
            warm = " ".join(f"{x['warm']:.1f}" for x in runs)
            ffn_cold = " ".join(f"{x['ffn_cold']:.1f}" for x in runs)
            ffn_warm = " ".join(f"{x['ffn_warm']:.1f}" for x in runs)
            marks = " ".join(f"{mark}={lo:.1f}/{hi:.1f}" for mark, lo, hi in runs[-1]["phases"])
            print(f"  {name:12s} cold {cold} | warm {warm} | y rel-L2 <= {max(x['err'] for x in runs):.2e}\n"
                  f"               FFN unit kernel cold {ffn_cold} | warm {ffn_warm}\n"
                  f"               {marks}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("prepare", "run", "compile", "inner"))
    parser.add_argument("builds", nargs="*", help="prepare: NAME=REV (REV a git revision or WORKTREE); run: NAMEs")
    parser.add_argument("--tokens", default="8,128")
    parser.add_argument("--shape", default="flash")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.action == "prepare":
        prepare(args.builds, args.tokens, args.shape)
    elif args.action == "compile":
        compile_variants(tokens, args.shape)
    elif args.action == "inner":
        print("RESULT " + json.dumps(time_build(tokens, args.shape, args.iters)), flush=True)
    else:
        run(args.builds, args.tokens, args.shape, args.rounds, args.iters)


if __name__ == "__main__":
    main()
