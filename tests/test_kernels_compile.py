"""compile tier: every kernel variant the gpu tier and the benchmarks launch compiles for sm_90a and passes the
checks of DESIGN section 3 (0 spill bytes, 0 stack frame, no C7508 / WGMMA-serialization notes, QGMMA in the
SASS of WGMMA kernels, no LDL/STL)."""
from __future__ import annotations

import pytest

from megamoe.jit import checks
from megamoe.kernels import catalog

pytestmark = pytest.mark.compile


@pytest.mark.parametrize("name, config, options", catalog.all_variants(), ids=lambda v: v if isinstance(v, str) else "")
def test_variant_compiles_clean(name: str, config: object, options: checks.CheckOptions) -> None:
    result = catalog.compile_variant(config)
    assert result.name == name
    found = checks.violations(result, options)
    assert found == [], "\n".join(found) + "\n" + result.ptxas_log
