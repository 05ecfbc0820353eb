"""The compile-tier rules of DESIGN section 3, applied to a CompileResult."""
from __future__ import annotations

import re
from dataclasses import dataclass

from megamoe.jit.compiler import CompileResult

# The out-of-line timeout report (components/common/timeout.cuh: cold, reached only on the way to a trap) is the
# one function allowed local memory.
_DIAGNOSTIC_FUNCTIONS = ("report_timeout_noreturn",)
_SERIALIZATION_NOTES = re.compile(r"C75(0[89]|1[0-9]|2[0-9])")


@dataclass(frozen=True)
class CheckOptions:
    expect_qgmma: bool = False
    max_registers: int | None = None
    # GEMM consumers: promotion FFMAs sit between a WGMMA group's QGMMAs and its WARPGROUP.DEPBAR, i.e. they run
    # while the group is in flight (gemm/consumer.cuh: consume_tile)
    expect_promotion_in_flight: bool = False
    # GEMM consumers that prefetch the next stage: its full-barrier try-wait sits between a WGMMA group's QGMMAs
    # and its WARPGROUP.DEPBAR (gemm/consumer.cuh: consume_tile, kPrefetch)
    expect_stage_wait_in_flight: bool = False


def sass_functions(sass: str) -> dict[str, str]:
    """Split `cuobjdump -sass` output into {function name: its SASS text}."""
    parts = re.split(r"^\s*Function : (\S+)\s*$", sass, flags=re.MULTILINE)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def _hot_sass(sass: str, entry: str) -> str:
    """The entry function's SASS without the out-of-line diagnostic subroutine (cuobjdump lists a
    non-inlined callee inside its caller's listing, after the caller's own EXIT/BRA loop)."""
    text = sass_functions(sass).get(entry, "")
    lines = text.splitlines()
    # ptxas places callees after the caller's body; the callee starts at the CALL.REL target offset.
    targets = [int(t, 16) for t in re.findall(r"CALL\.REL\.NOINC\s+0x([0-9a-f]+)", text)]
    if not targets:
        return text
    start = min(targets)
    return "\n".join(ln for ln in lines if not (m := re.search(r"/\*([0-9a-f]{4,})\*/", ln)) or int(m[1], 16) < start)


def violations(result: CompileResult, options: CheckOptions = CheckOptions()) -> list[str]:
    """Every broken rule, as readable strings (empty when the kernel passes)."""
    out: list[str] = []
    entry = result.entry
    if entry.spill_store_bytes or entry.spill_load_bytes:
        out.append(f"{entry.name}: spills {entry.spill_store_bytes} B stores / {entry.spill_load_bytes} B loads")
    if entry.stack_frame_bytes:
        out.append(f"{entry.name}: stack frame {entry.stack_frame_bytes} B")
    for func in result.functions:
        if func.name != entry.name and not any(d in func.name for d in _DIAGNOSTIC_FUNCTIONS):
            if func.spill_store_bytes or func.spill_load_bytes or func.stack_frame_bytes:
                out.append(f"{func.name}: stack {func.stack_frame_bytes} B, spills {func.spill_store_bytes} B")
    if options.max_registers is not None and entry.registers > options.max_registers:
        out.append(f"{entry.name}: {entry.registers} registers > {options.max_registers}")
    for warning in result.warnings:
        if "C7508" in warning:
            out.append(f"setmaxnreg ignored: {warning}")
        elif _SERIALIZATION_NOTES.search(warning):
            out.append(f"WGMMA serialization / inserted waits: {warning}")
        else:
            out.append(f"warning: {warning}")
    if result.sass is None:
        out.append("no SASS (cuobjdump missing: install the `test` extra, which brings nvidia-cuda-cuobjdump)")
    else:
        hot = _hot_sass(result.sass, entry.name)
        if not hot:
            out.append(f"SASS has no function {entry.name}")
        if re.search(r"\b(LDL|STL)\b", hot):
            out.append(f"{entry.name}: local memory access (LDL/STL) in SASS")
        if options.expect_qgmma and "QGMMA" not in hot:
            out.append(f"{entry.name}: no QGMMA in SASS (FP8 WGMMA missing)")
        if options.expect_promotion_in_flight and not promotion_in_flight(hot):
            out.append(f"{entry.name}: no FFMA between a WGMMA group's QGMMAs and its wait (promotion does not "
                       f"overlap the tensor cores)")
        if options.expect_stage_wait_in_flight and not stage_wait_in_flight(hot):
            out.append(f"{entry.name}: no mbarrier try-wait between a WGMMA group's QGMMAs and its wait (the next "
                       f"stage is not awaited while the tensor cores run)")
    return out


def _in_flight(sass: str, is_match) -> bool:
    """Some line matching `is_match` runs after a QGMMA and before the next WARPGROUP.DEPBAR."""
    in_flight = False
    for line in sass.splitlines():
        if "QGMMA" in line:
            in_flight = True
        elif "WARPGROUP.DEPBAR" in line:
            in_flight = False
        elif in_flight and is_match(line):
            return True
    return False


def promotion_in_flight(sass: str) -> bool:
    """Some FFMA runs while a WGMMA group is in flight."""
    return _in_flight(sass, lambda line: "FFMA" in line)


def stage_wait_in_flight(sass: str) -> bool:
    """Some mbarrier try-wait (SYNCS.PHASECHK ... TRYWAIT) runs while a WGMMA group is in flight."""
    return _in_flight(sass, lambda line: "SYNCS.PHASECHK" in line and "TRYWAIT" in line)
