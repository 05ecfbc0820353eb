"""The fused MoE kernel (assembler/fused_kernel.cuh): config, generated source, launch."""
from megamoe.fused.config import FusedConfig, config_for
from megamoe.fused.launch import run
from megamoe.fused.source import compile_fused, source

__all__ = ["FusedConfig", "config_for", "run", "compile_fused", "source"]
