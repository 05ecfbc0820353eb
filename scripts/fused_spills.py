"""Where the fused kernel spills (no GPU needed): for each variant, ptxas's spill bytes and stack frame, the
LDL/STL instructions inside the math warpgroups' setmaxnreg region (between the USETMAXREG.TRY_ALLOC and
.DEALLOC of the SASS) and in all, and with --lines the source lines of every spill instruction. notes/fused.md
("Spills") has what these numbers have shown so far.
Usage: PYTHONPATH=python python3 scripts/fused_spills.py [--lines] [--serial] [-D FLAG ...]
  (-D: extra nvcc defines, for experiments guarded by #ifdef in the kernel's headers)"""
from __future__ import annotations

import argparse
import re
import subprocess
from collections import Counter

from megamoe.fused import config_for, source
from megamoe.jit import compiler
from megamoe.layout import SymmLayout

# The test tier's variants (tests/test_fused_gpu.py): two small layouts and the DSV4-Flash single-rank one
LAYOUTS = [(1, 8, 128, 6, 1024, 512), (1, 32, 128, 8, 2048, 1024), (1, 32, 4096, 6, 4096, 2048)]
_SPILL = re.compile(r"\b(STL|LDL)\b")
_LOCATION = re.compile(r'//## File "([^"]*)", line (\d+)')


def nvdisasm_path() -> str:
    """nvdisasm beside cuobjdump (the test extra installs both)."""
    cuobjdump = compiler.find_cuobjdump()
    return cuobjdump.replace("cuobjdump", "nvdisasm") if cuobjdump else "nvdisasm"


def spill_report(sass_lines: list[str]) -> tuple[int, int, Counter]:
    """(spills in the math region, spills in all, Counter of 'file:line' of each spill)."""
    start = next((i for i, line in enumerate(sass_lines) if "USETMAXREG.TRY_ALLOC" in line), 0)
    end = next((i for i, line in enumerate(sass_lines) if "USETMAXREG.DEALLOC" in line), len(sass_lines))
    where: Counter = Counter()
    location = "?"
    math = total = 0
    for i, line in enumerate(sass_lines):
        match = _LOCATION.search(line)
        if match:
            location = f"{match[1].rsplit('/', 1)[-1]}:{match[2]}"
        elif _SPILL.search(line):
            total += 1
            math += start < i < end
            where[location] += 1
    return math, total, where


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", action="store_true", help="print the source lines of the spills")
    parser.add_argument("--serial", action="store_true", help="the phase-serial variants too")
    parser.add_argument("-D", dest="defines", action="append", default=[], help="an nvcc define, e.g. -D X_FLAG")
    args = parser.parse_args()
    flags = tuple(f"-D{d}" for d in args.defines)
    for layout in LAYOUTS:
        for serial in (False, True) if args.serial else (False,):
            config = config_for(SymmLayout.create(*layout), serial=serial)
            result = compiler.build(config.name, source(config), flags)
            sass = subprocess.run([nvdisasm_path(), "-g", "-c", str(result.cubin_path)], capture_output=True,
                                  text=True, check=True).stdout.splitlines()
            math, total, where = spill_report(sass)
            entry = result.entry
            print(f"{config.name}: spill {entry.spill_store_bytes} B stores / {entry.spill_load_bytes} B loads, "
                  f"stack {entry.stack_frame_bytes} B; LDL/STL {total} ({math} in the math region)")
            if args.lines:
                for location, count in where.most_common():
                    print(f"    {count:4d}  {location}")


if __name__ == "__main__":
    main()
