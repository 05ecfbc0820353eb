"""Every environment switch megamoe reads, in one place (documented in the README)."""
from __future__ import annotations

import os
from pathlib import Path


def _flag(name: str, default: str = "0") -> bool:
    return os.environ.get(name, default).strip().lower() not in ("", "0", "false", "no", "off")


def jit_cache_dir() -> Path:
    """MEGAMOE_JIT_CACHE_DIR: where compiled cubins live (default ~/.cache/megamoe)."""
    return Path(os.environ.get("MEGAMOE_JIT_CACHE_DIR", "~/.cache/megamoe")).expanduser()


def jit_debug() -> bool:
    """MEGAMOE_JIT_DEBUG=1: print the generated source path, the nvcc command and the ptxas report."""
    return _flag("MEGAMOE_JIT_DEBUG")


def print_configs() -> bool:
    """MEGAMOE_PRINT_CONFIGS=1: print the config chosen for each shape."""
    return _flag("MEGAMOE_PRINT_CONFIGS")


def check_inputs_default() -> bool:
    """MEGAMOE_CHECK_INPUTS=0: `fused` (and DeepGEMM's `fp8_mega_moe`) skip the routing checks that read device memory
    (a device sync per call) unless the caller passes check_inputs=True; default 1 (checked on eager calls)."""
    return _flag("MEGAMOE_CHECK_INPUTS", default="1")


def n_major_override() -> int:
    """MEGAMOE_NMAJOR=-1|0|1: L2 block order (-1 auto by expected tokens per expert, 0 M-major, 1 N-major)."""
    value = int(os.environ.get("MEGAMOE_NMAJOR", "-1"))
    if value not in (-1, 0, 1):
        raise ValueError(f"MEGAMOE_NMAJOR must be -1, 0 or 1, got {value}")
    return value


def timeout_s() -> float:
    """MEGAMOE_TIMEOUT_S: device spin-wait timeout in seconds (default 30), measured with %globaltimer."""
    value = float(os.environ.get("MEGAMOE_TIMEOUT_S", "30"))
    if not value > 0:
        raise ValueError(f"MEGAMOE_TIMEOUT_S must be > 0, got {value}")
    return value


def nvcc_path() -> str:
    """The nvcc to use: $CUDA_HOME/bin/nvcc when CUDA_HOME is set, else nvcc on PATH."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").exists():
        return str(Path(cuda_home) / "bin" / "nvcc")
    return "nvcc"
