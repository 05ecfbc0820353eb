"""Same-call A/B of GEMM or expert-FFN builds: each build's own scripts/sweep_gemm.py or sweep_ffn.py (variants and
cuBLAS in shuffled rounds, outputs compared bit for bit within the build) run in alternating order, one process per
build and round, so that two source trees are compared on the same machine in the same call (the machines differ
by 2-5% between calls). Trees and caches under .jit-ab/NAME/ as in scripts/ab_fused.py (carry ".jit-ab"):

  here:    PYTHONPATH=python python3 scripts/ab_sweep.py prepare base=HEAD new=WORKTREE --sweep gemm --cases 1 5
  device:  python3 scripts/ab_sweep.py run base new --sweep gemm --cases 1 5 --rounds 2

--knobs applies to every build (a knob one build lacks fails that build's sweep, reported, the rest goes on)."""
from __future__ import annotations

import argparse
import subprocess
import sys

from ab_fused import AB_DIR, extract_tree, tree_env


def sweep_command(name: str, sweep: str, cases: list[str], knobs: list[str], rounds: int) -> list[str]:
    script = AB_DIR / name / "tree" / "scripts" / f"sweep_{sweep}.py"
    return [sys.executable, str(script), "--cases", *cases, "--knobs", *knobs, "--rounds", str(rounds)]


def sweep_env(name: str) -> dict[str, str]:
    env = tree_env(name)
    env["PYTHONPATH"] += f":{AB_DIR / name / 'tree' / 'scripts'}"
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("prepare", "run"))
    parser.add_argument("builds", nargs="+", help="prepare: NAME=REV (REV a git revision or WORKTREE); run: NAMEs")
    parser.add_argument("--sweep", choices=("gemm", "ffn"), default="gemm")
    parser.add_argument("--cases", nargs="+", default=["1"])
    parser.add_argument("--knobs", nargs="+", default=[""])
    parser.add_argument("--rounds", type=int, default=2, help="run: alternating rounds of every build")
    parser.add_argument("--sweep-rounds", type=int, default=5, help="run: rounds inside each sweep")
    args = parser.parse_args()
    if args.action == "prepare":
        for spec in args.builds:
            name = extract_tree(spec)
            subprocess.run(sweep_command(name, args.sweep, args.cases, args.knobs, 1) + ["--compile-only"],
                           env=sweep_env(name), check=True)
        return
    for r in range(args.rounds):
        for name in args.builds if r % 2 == 0 else args.builds[::-1]:
            print(f"== round {r}: {name}", flush=True)
            proc = subprocess.run(sweep_command(name, args.sweep, args.cases, args.knobs, args.sweep_rounds),
                                  env=sweep_env(name), capture_output=True, text=True)
            print(proc.stdout, flush=True)
            if proc.returncode != 0:
                print(f"{name} round {r} FAILED (rc {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)


if __name__ == "__main__":
    main()
