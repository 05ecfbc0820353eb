"""The fused kernel's host path on several ranks (DESIGN 5c), on the CPU: the first launch of a variant in a process
loads it and then meets every rank of the group, so that no rank's compile or module load keeps its peers waiting at
the kernel's NVLink barrier (2 gloo ranks, a stand-in kernel; the launch itself needs GPUs: multigpu tier)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from megamoe.fused.launch import meet_peers_before_first_launch  # noqa: E402
from megamoe.testing.ranks import RankContext, spawn_ranks  # noqa: E402

LOAD_DELAY_S = 1.5  # rank 1's stand-in compile + load


@dataclass
class FakeKernel:
    load_delay_s: float
    loads: list[int] = field(default_factory=list)

    def is_loaded(self, device: Any) -> bool:
        return bool(self.loads)

    def load(self, device: Any, smem_bytes: int) -> None:
        time.sleep(self.load_delay_s)
        self.loads.append(smem_bytes)


@dataclass
class FakeBuffer:
    group: Any
    num_ranks: int
    device: Any = None


def _first_launches(ranks: RankContext) -> tuple[float, float, int]:
    """(seconds in the first call, in the second, loads): rank 1 loads slowly, rank 0 must wait for it once."""
    kernel = FakeKernel(LOAD_DELAY_S if ranks.rank == 1 else 0.0)
    buf = FakeBuffer(ranks.group, ranks.num_ranks)
    started = time.perf_counter()
    meet_peers_before_first_launch(buf, kernel, 1234)
    first = time.perf_counter() - started
    started = time.perf_counter()
    meet_peers_before_first_launch(buf, kernel, 1234)  # loaded: no load, no barrier
    return first, time.perf_counter() - started, len(kernel.loads)


def test_first_launch_meets_the_peers() -> None:
    results = spawn_ranks(2, _first_launches, backend="gloo", what="host path over gloo", timeout_s=120)
    (first_0, second_0, loads_0), (first_1, second_1, loads_1) = results
    assert loads_0 == loads_1 == 1
    assert first_0 >= LOAD_DELAY_S * 0.9, f"rank 0 went on after {first_0:.2f} s, before rank 1 had loaded"
    assert second_0 < 0.5 and second_1 < 0.5


def test_one_rank_and_virtual_ranks_do_not_meet() -> None:
    """No group (one rank, or the virtual ranks of one GPU, which load every kernel first): the call loads
    nothing itself (the launch loads lazily) and meets no one."""
    kernel = FakeKernel(0.0)
    meet_peers_before_first_launch(FakeBuffer(None, 2), kernel, 1)
    meet_peers_before_first_launch(FakeBuffer(object(), 1), kernel, 1)
    assert kernel.loads == []


def test_allocate_several_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """megamoe.buffer.allocate with several ranks (a stand-in for torch's symmetric memory, on the CPU): the
    no-multicast switches are set where unset before any symmetric memory exists, the group is enabled for symmetric
    memory before the rendezvous, and a rendezvous that disagrees with the group's rank is an error."""
    import sys
    import types

    import torch.distributed as dist

    from megamoe import buffer as mb
    from megamoe.layout import SymmLayout

    calls: list[str] = []

    class Handle:
        def __init__(self, rank: int) -> None:
            self.rank, self.world_size, self.buffer_ptrs = rank, 2, [0x1000, 0x2000]

    handle_rank = [1]

    def empty(num_bytes: int, dtype: Any, device: Any) -> Any:
        calls.append(f"empty multicast_off={mb.os.environ.get('TORCH_SYMM_MEM_DISABLE_MULTICAST')}")
        return torch.empty(num_bytes, dtype=dtype)

    fake = types.SimpleNamespace(
        enable_symm_mem_for_group=lambda name: calls.append(f"enable {name}"), empty=empty,
        rendezvous=lambda buf, group: calls.append("rendezvous") or Handle(handle_rank[0]))
    monkeypatch.setitem(sys.modules, "torch.distributed._symmetric_memory", fake)
    monkeypatch.setattr(dist, "_symmetric_memory", fake, raising=False)
    monkeypatch.setattr(dist, "get_rank", lambda group: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group: 2)
    monkeypatch.setattr(dist, "barrier", lambda group: calls.append("barrier"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    for name in mb.NO_MULTICAST_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")  # set by the caller: kept

    group = types.SimpleNamespace(group_name="g0")
    layout = SymmLayout.create(2, 16, 64, 4, 512, 256)
    buf = mb.allocate(group, layout, torch.device("cpu"))
    assert (buf.rank, buf.num_ranks) == (1, 2)
    assert calls == ["enable g0", "empty multicast_off=1", "rendezvous", "barrier"]
    assert all(mb.os.environ[name] == value for name, value in mb.NO_MULTICAST_ENV.items())

    handle_rank[0] = 0
    with pytest.raises(RuntimeError, match="rendezvous gave rank 0 of 2, the group rank 1 of 2"):
        mb.allocate(group, layout, torch.device("cpu"))


def test_barrier_timeout_reports_say_what_the_values_mean() -> None:
    """A timeout at an NVLink barrier or at the combine rows explains its values and, since a call has no end barrier,
    that a rank missing from the signal may still be in its previous call."""
    from megamoe.jit.diagnostics import TimeoutReport

    barrier = str(TimeoutReport(0, 3, 3, 0, 30000.0, "nvl_dispatch", (1, 2, 7)))
    assert "timed out at 'nvl_dispatch' after 30000.0 ms, values (1, 2, 7)" in barrier
    assert "still in their previous call" in barrier
    rows = str(TimeoutReport(1, 0, 0, 0, 120000.0, "combine_rows", (5, 6, 41), role="math"))
    assert "the token's arrived rows, the rows expected, the token" in rows
    assert str(TimeoutReport(0, 0, 0, 0, 1.0, "gemm_full", (0, 0, 0))).endswith("values (0, 0, 0)")
