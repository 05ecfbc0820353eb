"""JIT: include closure, cache key, ptxas report parsing (cpu); compiling and checking kernels (compile tier)."""
from __future__ import annotations

from pathlib import Path

import pytest

from megamoe.jit import checks, compiler

PTXAS_LOG = """ptxas info    : 161 bytes gmem
ptxas info    : Compiling entry function 'k' for 'sm_90a'
ptxas info    : Function properties for k
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 168 registers, used 2 barriers, 1024 bytes smem, 400 bytes cmem[0]
ptxas warning : (C7508) Potential Performance Loss: the setmaxnreg instruction is ignored
ptxas info    : Function properties for helper
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
"""


def test_parse_ptxas_report() -> None:
    functions, warnings = compiler.parse_ptxas_report(PTXAS_LOG)
    by_name = {f.name: f for f in functions}
    assert by_name["k"].is_entry and not by_name["helper"].is_entry
    assert (by_name["k"].registers, by_name["k"].stack_frame_bytes) == (168, 8)
    assert (by_name["k"].spill_store_bytes, by_name["k"].spill_load_bytes, by_name["k"].smem_bytes) == (4, 12, 1024)
    assert len(warnings) == 1 and "C7508" in warnings[0]


def test_checks_flag_every_rule() -> None:
    functions, warnings = compiler.parse_ptxas_report(PTXAS_LOG)
    sass = "\tFunction : k\n        /*0000*/ STL [R1], R2 ;\n        /*0010*/ EXIT ;\n"
    result = compiler.CompileResult(name="k", key="0", cubin_path=Path("x"), source_path=Path("x"),
                                    ptxas_log=PTXAS_LOG, functions=functions, warnings=warnings, sass_text=sass,
                                    cache_hit=True, compile_seconds=0.0)
    found = "\n".join(checks.violations(result, checks.CheckOptions(expect_qgmma=True)))
    for needle in ("spills", "stack frame", "setmaxnreg ignored", "LDL/STL", "no QGMMA"):
        assert needle in found, (needle, found)


def test_kernel_for_compiles_once_per_config() -> None:
    pytest.importorskip("torch")
    from megamoe.jit import runtime

    functions, warnings = compiler.parse_ptxas_report(PTXAS_LOG)
    calls = []

    def compile_fn(config: tuple) -> compiler.CompileResult:
        calls.append(config)
        return compiler.CompileResult(name="k", key=f"kernel-for-{config}", cubin_path=Path("x"),
                                      source_path=Path("x"), ptxas_log=PTXAS_LOG, functions=functions,
                                      warnings=warnings, sass_text="", cache_hit=True, compile_seconds=0.0)

    first = runtime.kernel_for(compile_fn, (1, 2), 384)
    assert runtime.kernel_for(compile_fn, (1, 2), 384) is first
    assert runtime.kernel_for(compile_fn, (3, 4), 384) is not first
    assert calls == [(1, 2), (3, 4)]


def test_promotion_in_flight() -> None:
    overlapped = """
        /*0100*/ QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], R24 ;
        /*0110*/ FFMA R88, R152, R3, R88 ;
        /*0120*/ QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR12], R24, gsb0 ;
        /*0130*/ WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
"""
    serial = """
        /*0100*/ QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], R24, gsb0 ;
        /*0110*/ WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0120*/ FFMA R88, R24, R3, R88 ;
"""
    assert checks.promotion_in_flight(overlapped)
    assert not checks.promotion_in_flight(serial)


def test_stage_wait_in_flight() -> None:
    overlapped = """
        /*0100*/ QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], R24, gsb0 ;
        /*0110*/ SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR34+0x31800], R6 ;
        /*0120*/ WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
"""
    serial = """
        /*0100*/ QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], R24, gsb0 ;
        /*0110*/ WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0120*/ SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR34+0x31800], R6 ;
"""
    assert checks.stage_wait_in_flight(overlapped)
    assert not checks.stage_wait_in_flight(serial)


def test_include_closure_and_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a.cuh").write_text('#pragma once\n#include "b.cuh"\n')
    (tmp_path / "b.cuh").write_text("#pragma once\nint b;\n")
    monkeypatch.setattr(compiler, "INCLUDE_DIRS", (tmp_path,))
    monkeypatch.setattr(compiler, "nvcc_version", lambda: "release 13.0, V13.0.88")
    src = '#include "a.cuh"\n#include <cuda.h>\n'
    assert compiler.include_closure(src) == [tmp_path / "a.cuh", tmp_path / "b.cuh"]
    key = compiler.cache_key(src, ("-O3",))
    assert compiler.cache_key(src, ("-O3",)) == key
    assert compiler.cache_key(src, ("-O2",)) != key  # flags are part of the key
    (tmp_path / "b.cuh").write_text("#pragma once\nint b2;\n")
    assert compiler.cache_key(src, ("-O3",)) != key  # so is every transitively included header
    with pytest.raises(FileNotFoundError, match="missing.cuh"):
        compiler.include_closure('#include "missing.cuh"\n')


def test_common_headers_resolve() -> None:
    from megamoe.kernels import smoke

    names = {p.name for p in compiler.include_closure(smoke.source(smoke.SmokeConfig()))}
    assert {"smoke_kernel.cuh", "mbarrier.cuh", "tma.cuh", "fence.cuh", "sync.cuh", "timeout.cuh"} <= names


@pytest.mark.compile
@pytest.mark.parametrize("swizzle", [True, False])
def test_smoke_kernel_compiles_clean(swizzle: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megamoe.kernels import smoke

    monkeypatch.setenv("MEGAMOE_JIT_CACHE_DIR", str(tmp_path))
    config = smoke.SmokeConfig(32, 32 if swizzle else 64, swizzle)
    first = smoke.compile_smoke(config)
    assert not first.cache_hit and first.cubin_path.stat().st_size > 0
    assert checks.violations(first) == [], first.ptxas_log
    assert first.sass is not None and "UTMALDG" in first.sass and "UTMASTG" in first.sass
    second = smoke.compile_smoke(config)
    assert second.cache_hit and second.key == first.key and compiler.compile_count() == 1
