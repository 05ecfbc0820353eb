"""The fused MoE kernel (assembler/fused_kernel.cuh): config, generated source, launch.

`megamoe.fused` is this package and also the public call of DESIGN section 7: calling the package runs
`megamoe.api.fused` (the module's class is made callable), so `megamoe.fused(y, l1, l2, buf, ...)` works however
the package was imported."""
from __future__ import annotations

import sys
import types
from typing import Any

from megamoe.fused.config import FusedConfig, config_for
from megamoe.fused.launch import run
from megamoe.fused.source import compile_fused, source


class _CallablePackage(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> None:
        from megamoe.api import fused

        return fused(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage

__all__ = ["FusedConfig", "config_for", "run", "compile_fused", "source"]
