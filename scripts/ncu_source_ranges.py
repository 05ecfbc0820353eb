"""Warp samples of an ncu source page, per range of SASS instructions (notes/fused.md, "T 4096 under ncu").

  device:  ncu -k regex:NAME --launch-count 1 --clock-control none --section SourceCounters -o rep -f python3 ...
           ncu -i rep.ncu-rep --page source --csv --print-source sass > src.csv
  here:    python3 scripts/ncu_source_ranges.py src.csv                  # the markers, to choose ranges from
           python3 scripts/ncu_source_ranges.py src.csv math=664:3776 wg0=4326:6024 ...

Without ranges it lists the instructions that delimit the kernel's parts: register reallocation (a warp role
starts), CTA and named barriers, exits, and the WGMMA instructions with their execution counts (a mainloop's body
runs once per K-block pair, its peeled blocks once per tile). Per range: all samples, issued ("selected") samples,
their ratio (the cycles an instruction of that code costs its warp, comparable between kernels whose sampling
divides differently among their warps) and the largest stall reasons."""
from __future__ import annotations

import argparse
import csv

MARKERS = ("USETMAXREG", "BAR.SYNC", "EXIT", "QGMMA", "HGMMA")


def load(path: str) -> tuple[list[str], list[list[str]]]:
    rows = list(csv.reader(open(path)))
    if rows and rows[0] and rows[0][0] == "Kernel Name":
        rows = rows[1:]
    return rows[0], rows[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv")
    parser.add_argument("ranges", nargs="*", help="NAME=FIRST:END (instruction indices, END excluded)")
    args = parser.parse_args()
    hdr, body = load(args.csv)
    samples, source = hdr.index("Warp Stall Sampling (All Samples)"), hdr.index("Source")
    executed = hdr.index("Instructions Executed")
    reasons = [(i, h) for i, h in enumerate(hdr) if h.startswith("stall_") and "(Not" not in h]
    value = lambda row, i: float(row[i] or 0)  # noqa: E731
    total = sum(value(r, samples) for r in body)
    print(f"{args.csv}: {len(body)} instructions, {total:.0f} samples")
    if not args.ranges:
        for idx, row in enumerate(body):
            if any(m in row[source] for m in MARKERS):
                print(f"{idx:6d} {row[source].strip()[:70]:70s} executed {row[executed]:>9s}")
        return
    selected = hdr.index("stall_selected")
    for spec in args.ranges:
        name, span = spec.split("=", 1)
        first, end = (int(v) for v in span.split(":"))
        part = body[first:end]
        n = sum(value(r, samples) for r in part)
        issued = sum(value(r, selected) for r in part)
        top = sorted(((sum(value(r, i) for r in part), h) for i, h in reasons), reverse=True)[:5]
        print(f"{name:10s} [{first}, {end}) samples {n:8.0f} ({n / total * 100:4.1f}%) per issued "
              f"{n / max(issued, 1.0):5.2f} | " + " ".join(f"{h[6:]} {v / max(n, 1.0) * 100:.0f}%" for v, h in top))


if __name__ == "__main__":
    main()
