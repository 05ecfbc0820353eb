"""The issue-15 tables of several `megamoe bench fused` runs (their JSON files), as markdown for a note: per shape,
one row per T with each run's cold times of the call's config for seeds 0 / 1 / 2 (x the floor) and the expert-FFN
unit kernel's of the same rounds; then per shape every fused variant the runs timed (the pull-stage variants, the
phase-serial call) in the same form; then per run the targets as the bench judges them (megamoe.bench.fused).

  PYTHONPATH=python python3 scripts/fused_tables.py b1.json b2.json b3.json [e256.json pro.json]"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

from megamoe.bench.fused import FusedCaseResult, FusedMeasurement, call_values, fused_targets, targets_text


def load(path: str) -> tuple[str, list[FusedCaseResult]]:
    """(the device the run named, its results)."""
    with open(path) as f:
        payload = json.load(f)
    results = [FusedCaseResult.from_json(r, FusedMeasurement) for r in payload["results"]]
    return payload.get("device", "device not recorded"), results


def seed_cells(cases: list[FusedCaseResult]) -> tuple[str, str]:
    """(the call's times over the seeds with their x floor range, the unit kernel's times)."""
    values = [v for v in (call_values(r) for r in sorted(cases, key=lambda r: r.seed)) if v]
    if not values:
        return "n/a", "n/a"
    floors = [v["x_floor"] for v in values]
    call = " / ".join(f"{v['us']:.1f}" for v in values) + f" ({min(floors):.2f}-{max(floors):.2f}x)"
    return call, " / ".join(f"{v['unit_us']:.1f}" for v in values)


def variant_cells(cases: list[FusedCaseResult]) -> dict[str, str]:
    """Per fused implementation timed in these cases (one per seed): its cold times over the seeds."""
    times: dict[str, list[str]] = defaultdict(list)
    for r in sorted(cases, key=lambda r: r.seed):
        for m in r.measurements:
            if m.cold and m.impl.startswith("fused,"):
                times[m.impl].append("n/a" if m.time_us is None else f"{m.time_us:.1f}")
    return {impl: " / ".join(values) for impl, values in times.items()}


def print_variants(by_tokens: dict[int, dict[int, list[FusedCaseResult]]], run_ids: list[int]) -> None:
    """One row per (T, fused implementation), a column per run: cold times, seeds in order."""
    print("| T | fused variant (cold us, seeds in order) | " + " | ".join(f"run {i + 1}" for i in run_ids) + " |")
    print("|---|---|" + "---|" * len(run_ids))
    for tokens, by_run in sorted(by_tokens.items()):
        cells = {i: variant_cells(by_run[i]) for i in run_ids if i in by_run}
        impls = list(dict.fromkeys(impl for per_run in cells.values() for impl in per_run))
        for impl in impls:
            print(f"| {tokens} | {impl} | " + " | ".join(cells.get(i, {}).get(impl, "") for i in run_ids) + " |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="bench fused JSON files (several shapes may be mixed)")
    args = parser.parse_args()
    runs = [load(path) for path in args.runs]
    # shape -> T -> run index -> the run's cases of that T
    table: dict[str, dict[int, dict[int, list[FusedCaseResult]]]] = defaultdict(lambda: defaultdict(dict))
    for i, (_, results) in enumerate(runs):
        for r in results:
            table[r.shape][r.tokens].setdefault(i, []).append(r)
    for shape, by_tokens in table.items():
        run_ids = sorted({i for by_run in by_tokens.values() for i in by_run})
        print(f"{shape}:\n")
        print("| T | " + " | ".join(f"run {i + 1}" for i in run_ids) + " | unit kernel, same rounds |")
        print("|---|" + "---|" * (len(run_ids) + 1))
        for tokens, by_run in sorted(by_tokens.items()):
            cells = [seed_cells(by_run[i]) if i in by_run else ("", "") for i in run_ids]
            print(f"| {tokens} | " + " | ".join(c for c, _ in cells) + " | " + "; ".join(u for _, u in cells) + " |")
        print()
        print_variants(by_tokens, run_ids)
    for i, (device, results) in enumerate(runs):
        print(f"- run {i + 1} ({args.runs[i]}, {device}): "
              f"{targets_text(fused_targets(results), markup=False) or 'no target in these cases'}")


if __name__ == "__main__":
    main()
