"""Test tiers (DESIGN section 8): cpu (no marker), compile (nvcc), gpu (one SM90 GPU), multigpu."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))


def _num_sm90_gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    if not torch.cuda.is_available():
        return 0
    return sum(1 for i in range(torch.cuda.device_count()) if torch.cuda.get_device_capability(i) == (9, 0))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    num_gpus = _num_sm90_gpus()
    from megamoe import envs

    has_nvcc = shutil.which(envs.nvcc_path()) is not None or Path(envs.nvcc_path()).exists()
    for item in items:
        if "compile" in item.keywords and not has_nvcc:
            item.add_marker(pytest.mark.skip(reason="compile tier: nvcc not found"))
        if "gpu" in item.keywords and num_gpus < 1:
            item.add_marker(pytest.mark.skip(reason="gpu tier: no SM90 GPU visible"))
        if "multigpu" in item.keywords and num_gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"multigpu tier: needs >= 2 SM90 GPUs, found {num_gpus}"))


@pytest.fixture(autouse=True)
def _no_multicast_env() -> None:
    # DESIGN section 6: NVLink multicast is never used; keep it off in every process we start.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
