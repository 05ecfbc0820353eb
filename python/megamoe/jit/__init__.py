"""JIT to cubin (compiler), the DESIGN section 3 compile checks (checks), driver-API loading and launching
(runtime) and device timeout diagnostics (diagnostics)."""
from megamoe.jit.compiler import CompileResult, FunctionReport, build, compile_count
from megamoe.jit.checks import CheckOptions, violations

__all__ = ["CompileResult", "FunctionReport", "build", "compile_count", "CheckOptions", "violations"]
