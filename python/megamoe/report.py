"""rich reports: environment info, JIT cache warming, and the phase report of the demo."""
from __future__ import annotations

import platform
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from megamoe import envs

console = Console()


def _version(module: str) -> str:
    try:
        mod = __import__(module, fromlist=["__version__"])
        return str(getattr(mod, "__version__", "installed"))
    except ImportError:
        return "not installed"


def print_info() -> None:
    """GPU, SMs, toolchain and cache, one table."""
    import torch

    from megamoe import __version__
    from megamoe.jit import compiler

    table = Table(title="megamoe info", show_header=False)
    table.add_column("item", style="bold")
    table.add_column("value")
    table.add_row("megamoe", __version__)
    table.add_row("python / torch", f"{platform.python_version()} / {torch.__version__}")
    table.add_row("cuda-bindings", _version("cuda.bindings"))
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            sm90 = "yes" if (props.major, props.minor) == (9, 0) else "no (megamoe needs SM90)"
            table.add_row(f"GPU {i}", f"{props.name}, {props.multi_processor_count} SMs, "
                                      f"{props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}, "
                                      f"SM90: {sm90}")
    else:
        table.add_row("GPU", "none visible (CPU-only: reference, compile tier and JIT still work)")
    try:
        table.add_row("nvcc", f"{envs.nvcc_path()}: {compiler.nvcc_version()}")
    except RuntimeError as exc:
        table.add_row("nvcc", f"[red]{exc}[/]")
    table.add_row("cuobjdump", compiler.find_cuobjdump() or "[yellow]not found (SASS checks skipped)[/]")
    cache = envs.jit_cache_dir()
    entries = [p for p in cache.glob("*/*") if (p / "build.json").exists()] if cache.exists() else []
    table.add_row("JIT cache", f"{cache}: {len(entries)} cubins, {compiler.compile_count()} nvcc compilations logged")
    table.add_row("switches", f"MEGAMOE_JIT_DEBUG={int(envs.jit_debug())} MEGAMOE_PRINT_CONFIGS="
                              f"{int(envs.print_configs())} MEGAMOE_NMAJOR={envs.n_major_override()} "
                              f"MEGAMOE_TIMEOUT_S={envs.timeout_s():g}")
    console.print(table)


def warm_jit_cache(check: bool = False) -> None:
    """Compile every variant of megamoe.kernels.catalog (cache hits are instant)."""
    from megamoe.jit import checks
    from megamoe.kernels import catalog

    table = Table(title=f"JIT cache {envs.jit_cache_dir()}")
    for col in ("kernel", "cache", "registers", "spills (B)", "stack (B)", "compile checks"):
        table.add_column(col)
    failed = 0
    for name, config, options in catalog.all_variants():
        result = catalog.compile_variant(config)
        entry = result.entry
        found = checks.violations(result, options) if check else []
        failed += bool(found)
        table.add_row(name, "hit" if result.cache_hit else f"compiled {result.compile_seconds:.1f} s",
                      str(entry.registers), str(entry.spill_store_bytes + entry.spill_load_bytes),
                      str(entry.stack_frame_bytes), ("[red]" + "; ".join(found) + "[/]") if found else
                      ("pass" if check else "-"))
    console.print(table)
    if failed:
        raise SystemExit(f"{failed} kernel variants fail the compile checks")


@dataclass
class PhaseRow:
    phase: str
    status: str  # "kernel", "reference", "not built yet"
    detail: str
    check: str = ""


def phase_table(title: str, rows: list[PhaseRow]) -> Table:
    table = Table(title=title)
    for col in ("phase", "status", "what ran", "check against the reference"):
        table.add_column(col)
    colors = {"kernel": "green", "reference": "cyan", "not built yet": "yellow"}
    for row in rows:
        table.add_row(row.phase, f"[{colors.get(row.status, 'white')}]{row.status}[/]", row.detail, row.check)
    return table
