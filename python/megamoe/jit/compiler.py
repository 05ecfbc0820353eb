"""JIT: generated kernel source -> nvcc -> sm_90a cubin, cached by content hash, with the ptxas report and SASS.

Cache key: sha256 over the generated source, every header it includes (transitively, resolved the way nvcc
resolves quoted includes), the nvcc flags and the nvcc version. Cubins are machine-independent, so a cache filled
on a CPU-only machine with nvcc is valid on the GPU machine. Entries are written to a temporary directory and
renamed into place, so several ranks can compile the same kernel at once.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from megamoe import envs

SOURCE_ROOT = Path(__file__).resolve().parents[3]
INCLUDE_DIRS: tuple[Path, ...] = (SOURCE_ROOT / "components", SOURCE_ROOT / "assembler")
NVCC_FLAGS: tuple[str, ...] = (
    "-gencode=arch=compute_90a,code=sm_90a",
    "-O3",
    "-std=c++17",
    "-cubin",
    "-lineinfo",
    "-Xptxas",
    "-v",
)
_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)
_console = Console(stderr=True)


@dataclass(frozen=True)
class FunctionReport:
    """ptxas's report for one function of the cubin."""

    name: str
    is_entry: bool
    registers: int = 0
    stack_frame_bytes: int = 0
    spill_store_bytes: int = 0
    spill_load_bytes: int = 0
    smem_bytes: int = 0


@dataclass(frozen=True)
class CompileResult:
    name: str
    key: str
    cubin_path: Path
    source_path: Path
    ptxas_log: str
    functions: tuple[FunctionReport, ...]
    warnings: tuple[str, ...]
    cache_hit: bool
    compile_seconds: float
    command: tuple[str, ...] = field(default=(), repr=False)
    sass_text: str | None = field(default=None, repr=False)  # given directly, else loaded by `sass` on demand

    @functools.cached_property
    def sass(self) -> str | None:
        """The cubin's SASS (None without cuobjdump). Disassembled on first use only — the compile checks need
        it, a launch does not — and kept beside the cubin (kernel.sass) for the next reader."""
        if self.sass_text is not None:
            return self.sass_text
        sass_path = self.cubin_path.with_name("kernel.sass")
        if sass_path.exists():
            return sass_path.read_text()
        sass = disassemble(self.cubin_path)
        if sass is not None:
            tmp = sass_path.with_name(f".kernel.sass.{uuid.uuid4().hex}")
            tmp.write_text(sass)
            os.replace(tmp, sass_path)
        return sass

    @property
    def entry(self) -> FunctionReport:
        entries = [f for f in self.functions if f.is_entry and f.name == self.name]
        if not entries:
            raise RuntimeError(f"ptxas report has no entry function {self.name!r}")
        return entries[0]

    def cubin(self) -> bytes:
        return self.cubin_path.read_bytes()


def include_closure(source: str, base_dir: Path | None = None) -> list[Path]:
    """Every header a source includes with quotes, transitively, resolved like nvcc: the including file's
    directory first, then INCLUDE_DIRS. System includes (<...>) are covered by the nvcc version."""
    seen: dict[Path, None] = {}
    stack: list[tuple[str, Path | None]] = [(source, base_dir)]
    while stack:
        text, directory = stack.pop()
        for name in _INCLUDE_RE.findall(text):
            candidates = ([directory / name] if directory else []) + [d / name for d in INCLUDE_DIRS]
            path = next((c.resolve() for c in candidates if c.is_file()), None)
            if path is None:
                raise FileNotFoundError(f"#include \"{name}\" not found in {[str(d) for d in INCLUDE_DIRS]}")
            if path not in seen:
                seen[path] = None
                stack.append((path.read_text(), path.parent))
    return sorted(seen)


@functools.lru_cache(maxsize=None)
def nvcc_version() -> str:
    """The `release X.Y, VX.Y.Z` line of `nvcc --version` (part of the cache key)."""
    try:
        out = subprocess.run([envs.nvcc_path(), "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise RuntimeError(f"nvcc not usable ({envs.nvcc_path()}): {exc}; set CUDA_HOME or put nvcc on PATH") from exc
    lines = [line for line in out.splitlines() if "release" in line]
    return lines[-1].strip() if lines else out.strip()


def cache_key(source: str, flags: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    digest.update(source.encode())
    for header in include_closure(source):
        digest.update(str(header.relative_to(SOURCE_ROOT) if header.is_relative_to(SOURCE_ROOT) else header).encode())
        digest.update(header.read_bytes())
    digest.update("\0".join(flags).encode())
    digest.update(nvcc_version().encode())
    return digest.hexdigest()


_FUNC_RE = re.compile(r"Function properties for (\S+)")
_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)'")
_STACK_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED_RE = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas_report(log: str) -> tuple[tuple[FunctionReport, ...], tuple[str, ...]]:
    """Per-function registers, stack frame, spills and static smem; and every warning / C75xx note."""
    entries = set(_ENTRY_RE.findall(log))
    reports: dict[str, dict] = {}
    current: str | None = None
    for line in log.splitlines():
        if m := _FUNC_RE.search(line):
            current = m.group(1)
            reports.setdefault(current, {})
        elif (m := _STACK_RE.search(line)) and current is not None:
            reports[current].update(stack_frame_bytes=int(m[1]), spill_store_bytes=int(m[2]),
                                    spill_load_bytes=int(m[3]))
        elif (m := _USED_RE.search(line)) and current is not None:
            reports[current].update(registers=int(m[1]), smem_bytes=int(m[2] or 0))
    functions = tuple(FunctionReport(name=n, is_entry=n in entries, **v) for n, v in reports.items())
    warnings = tuple(line.strip() for line in log.splitlines()
                     if "warning" in line.lower() or re.search(r"\bC75\d\d\b", line))
    return functions, warnings


def find_toolkit_tool(name: str, extra: Sequence[Path] = ()) -> str | None:
    """A CUDA toolkit executable: beside the nvcc in use (envs.nvcc_path), on PATH, in `extra`, or beside the
    resolved nvcc on PATH; None when none is found."""
    candidates: list[Path | str | None] = [Path(envs.nvcc_path()).parent / name, shutil.which(name), *extra]
    nvcc = shutil.which(envs.nvcc_path())
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent / name)
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return str(c)
    return None


def find_cuobjdump() -> str | None:
    """cuobjdump from the CUDA toolkit, PATH, or the nvidia-cuda-cuobjdump wheel (CPU machines)."""
    wheels: list[Path] = []
    try:
        import nvidia  # the nvidia-cuda-cuobjdump / nvidia-cuda-nvdisasm wheels install under nvidia/cu13/bin

        wheels = [Path(p) / "cu13" / "bin" / "cuobjdump" for p in nvidia.__path__]
    except ImportError:
        pass
    return find_toolkit_tool("cuobjdump", wheels)


def disassemble(cubin_path: Path) -> str | None:
    """SASS of a cubin via `cuobjdump -sass` (None when cuobjdump or its nvdisasm is missing)."""
    tool = find_cuobjdump()
    if tool is None:
        return None
    env = dict(os.environ)
    env["PATH"] = f"{Path(tool).parent}{os.pathsep}{env.get('PATH', '')}"  # cuobjdump runs nvdisasm
    proc = subprocess.run([tool, "-sass", str(cubin_path)], capture_output=True, text=True, env=env)
    return proc.stdout if proc.returncode == 0 else None


def _load_entry(name: str, key: str, entry_dir: Path, cache_hit: bool) -> CompileResult:
    meta = json.loads((entry_dir / "build.json").read_text())
    functions, warnings = parse_ptxas_report(meta["ptxas_log"])
    return CompileResult(
        name=name, key=key, cubin_path=entry_dir / "kernel.cubin", source_path=entry_dir / "kernel.cu",
        ptxas_log=meta["ptxas_log"], functions=functions, warnings=warnings, cache_hit=cache_hit,
        compile_seconds=meta["compile_seconds"], command=tuple(meta["command"]),
    )


def build(name: str, source: str, extra_flags: tuple[str, ...] = ()) -> CompileResult:
    """Compile `source` (which defines `extern "C" __global__ void <name>(...)`) to a cached sm_90a cubin."""
    flags = NVCC_FLAGS + tuple(extra_flags)
    key = cache_key(source, flags)
    root = envs.jit_cache_dir() / name
    entry_dir = root / key[:24]
    if (entry_dir / "build.json").exists():
        try:  # mark the entry used (scripts/make_jit_carry.sh carries the entries a warm-up used)
            os.utime(entry_dir / "build.json")
        except OSError:  # a read-only cache (the carried copy on the device) stays as it is
            pass
        return _load_entry(name, key, entry_dir, cache_hit=True)

    root.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        src_path = tmp_dir / "kernel.cu"
        src_path.write_text(source)
        command = (envs.nvcc_path(), *flags, *(f"-I{d}" for d in INCLUDE_DIRS), str(src_path),
                   "-o", str(tmp_dir / "kernel.cubin"))
        if envs.jit_debug():
            _console.print(f"[bold]megamoe jit[/]: {name}: source {src_path}\n  {' '.join(command)}")
        start = time.perf_counter()
        with _console.status(f"[bold cyan]megamoe jit[/]: compiling {name} with nvcc (sm_90a)…"):
            proc = subprocess.run(command, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        log = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed for {name} (exit {proc.returncode}); source kept at {src_path}\n{log}")
        if envs.jit_debug():
            _console.print(log)
        meta = {"name": name, "key": key, "command": list(command), "ptxas_log": log, "compile_seconds": seconds,
                "nvcc_version": nvcc_version(), "host": socket.gethostname(), "time": time.time()}
        (tmp_dir / "build.json").write_text(json.dumps(meta, indent=1))
        try:
            os.rename(tmp_dir, entry_dir)
        except OSError:  # another process published the same entry first: use theirs
            shutil.rmtree(tmp_dir, ignore_errors=True)
        else:
            with open(envs.jit_cache_dir() / "compile.log", "a") as log_file:
                log_file.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {socket.gethostname()} {name} {key[:24]} "
                               f"{seconds:.2f}s\n")
        _console.print(f"[bold cyan]megamoe jit[/]: compiled {name} in {seconds:.1f} s", highlight=False)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return _load_entry(name, key, entry_dir, cache_hit=False)


def compile_count() -> int:
    """nvcc compilations recorded in this cache (one line each in compile.log)."""
    path = envs.jit_cache_dir() / "compile.log"
    return len(path.read_text().splitlines()) if path.exists() else 0

