"""The host side of several ranks, on the CPU: the symmetric buffer's allocation (a stand-in for torch's symmetric
memory) and what the timeout reports of the cross-rank waits say (the kernels themselves need GPUs: multigpu tier)."""
from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")


def test_allocate_several_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """megamoe.buffer.allocate with several ranks (a stand-in for torch's symmetric memory, on the CPU): the
    no-multicast switches are set where unset before any symmetric memory exists, the group is enabled for symmetric
    memory before the rendezvous, the barrier runs on the buffer's device (NCCL's runs on the current one), and a
    rendezvous that disagrees with the group's rank is an error."""
    import contextlib
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
    current_device: list[Any] = [None]

    @contextlib.contextmanager
    def cuda_device(device: Any):  # type: ignore[no-untyped-def]
        previous, current_device[0] = current_device[0], device
        yield
        current_device[0] = previous

    monkeypatch.setattr(torch.cuda, "device", cuda_device)
    monkeypatch.setattr(dist, "barrier", lambda group: calls.append(f"barrier on {current_device[0]}"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    for name in mb.NO_MULTICAST_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")  # set by the caller: kept

    group = types.SimpleNamespace(group_name="g0")
    layout = SymmLayout.create(2, 16, 64, 4, 512, 256)
    buf = mb.allocate(group, layout, torch.device("cpu"))
    assert (buf.rank, buf.num_ranks) == (1, 2)
    assert calls == ["enable g0", "empty multicast_off=1", "rendezvous", "barrier on cpu"]  # the buffer's device
    assert all(mb.os.environ[name] == value for name, value in mb.NO_MULTICAST_ENV.items())
    buf.destroy()
    assert calls[-1] == "barrier on cpu" and buf.buffer is None

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


def test_input_fill_without_tokens_loads_its_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank whose first layer call has no tokens still compiles and loads the input fill kernel (without a launch),
    so that no later call compiles it while the peers wait at the fused kernel's NVLink barrier."""
    import megamoe
    from megamoe.jit import runtime
    from megamoe.kernels import input_cast

    events: list[tuple] = []

    class Kernel:
        def load(self, device: Any, dynamic_smem_bytes: int) -> None:
            events.append(("load", device))

        def launch(self, num_blocks: int, *args: Any, **kwargs: Any) -> None:
            events.append(("launch", num_blocks))

    def kernel_for(compile_fn: Any, config: Any, *args: Any, **kwargs: Any) -> Kernel:
        events.append(("kernel_for", config.name))
        return Kernel()

    monkeypatch.setattr(runtime, "kernel_for", kernel_for)
    buf = megamoe.get_symm_buffer(None, 8, 16, 2, 256, 128, device="cpu")
    empty = (torch.empty(0, 256, dtype=torch.bfloat16), torch.empty(0, 2, dtype=torch.int32), torch.empty(0, 2))
    assert input_cast.run(buf, *empty) == 0
    assert events == [("kernel_for", "megamoe_input_cast_h256_k2_i32"), ("load", torch.device("cpu"))]
    events.clear()
    tokens = (torch.randn(3, 256).bfloat16(), torch.zeros(3, 2, dtype=torch.int32), torch.rand(3, 2))
    assert input_cast.run(buf, *tokens) == 3
    assert events == [("kernel_for", "megamoe_input_cast_h256_k2_i32"), ("launch", 3)]
