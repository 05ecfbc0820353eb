"""Device timeout diagnostics: host-mapped records that spin-waits fill before they trap
(mirrors components/common/timeout.cuh: TimeoutRecord, DeviceEnv)."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

from megamoe import envs

NUM_RECORD_ROLES = 4  # timeout.cuh kNumRecordRoles: common, dispatch, producer, math
RECORDS_PER_ROLE = 256  # timeout.cuh kRecordsPerRole: one per SM
MAX_TIMEOUT_RECORDS = NUM_RECORD_ROLES * RECORDS_PER_ROLE
RECORD_ROLES = ("common", "dispatch", "producer", "math")  # timeout.cuh RecordRole, in order


class TimeoutRecordStruct(ctypes.Structure):
    _fields_ = [
        ("rank", ctypes.c_uint32), ("sm_idx", ctypes.c_uint32), ("block_idx", ctypes.c_uint32),
        ("thread_idx", ctypes.c_uint32), ("waited_ns", ctypes.c_uint64), ("values", ctypes.c_int64 * 3),
        ("tag_ptr", ctypes.c_uint64), ("tag", ctypes.c_char * 16), ("valid", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
    ]


class DeviceEnv(ctypes.Structure):
    _fields_ = [("timeout_ns", ctypes.c_uint64), ("timeout_records", ctypes.c_uint64),
                ("rank", ctypes.c_uint32), ("role", ctypes.c_uint32)]


assert ctypes.sizeof(TimeoutRecordStruct) == 80 and ctypes.sizeof(DeviceEnv) == 24


@dataclass(frozen=True)
class TimeoutReport:
    rank: int
    sm_idx: int
    block_idx: int
    thread_idx: int
    waited_ms: float
    tag: str
    values: tuple[int, int, int]
    role: str = "common"

    def __str__(self) -> str:
        hint = WAIT_HINTS.get(self.tag)
        return (f"rank {self.rank} SM {self.sm_idx} block {self.block_idx} thread {self.thread_idx} ({self.role}): "
                f"timed out at '{self.tag}' after {self.waited_ms:.1f} ms, values {self.values}"
                + (f" ({hint})" if hint else ""))


# What a timeout at the NVLink barriers says about the peers. The fused kernel has no barrier at the end of a call,
# so a rank can wait at call n + 1's dispatch barrier (timeout tier 1x) for a peer still in call n's reduce (4x),
# which waits for rows of a third rank that failed: the first report need not name the rank at fault.
_BARRIER_HINT = ("values: signal word, its target, barrier ordinal; the ranks missing from the signal have not "
                 "reached this barrier: crashed, not launched, or still in their previous call")
WAIT_HINTS = {"nvl_dispatch": _BARRIER_HINT, "nvl_combine": _BARRIER_HINT,
              "combine_rows": "values: the token's arrived rows, the rows expected, the token: a peer has not sent "
                              "this token's rows back"}


class TimeoutRecords:
    """Pinned, device-mapped memory for TimeoutRecord[MAX_TIMEOUT_RECORDS]; readable after a device trap."""

    def __init__(self) -> None:
        import torch

        from megamoe.jit.runtime import check, cu, ensure_context

        ensure_context(torch.device("cuda", torch.cuda.current_device()))
        num_bytes = ctypes.sizeof(TimeoutRecordStruct) * MAX_TIMEOUT_RECORDS
        flags = cu.CU_MEMHOSTALLOC_DEVICEMAP | cu.CU_MEMHOSTALLOC_PORTABLE
        self.host_ptr = int(check(cu.cuMemHostAlloc(num_bytes, flags)))
        ctypes.memset(self.host_ptr, 0, num_bytes)
        self.device_ptr = int(check(cu.cuMemHostGetDevicePointer(self.host_ptr, 0)))
        self.records = (TimeoutRecordStruct * MAX_TIMEOUT_RECORDS).from_address(self.host_ptr)

    def device_env(self, rank: int = 0, timeout_s: float | None = None) -> DeviceEnv:
        seconds = envs.timeout_s() if timeout_s is None else timeout_s
        return DeviceEnv(int(seconds * 1e9), self.device_ptr, rank, 0)

    def reports(self) -> list[TimeoutReport]:
        return [TimeoutReport(r.rank, r.sm_idx, r.block_idx, r.thread_idx, r.waited_ns / 1e6,
                              r.tag.decode(errors="replace"), tuple(r.values), RECORD_ROLES[i // RECORDS_PER_ROLE])
                for i, r in enumerate(self.records) if r.valid]


_records: TimeoutRecords | None = None


def timeout_records() -> TimeoutRecords:
    """The process-wide records (allocated on first use)."""
    global _records
    if _records is None:
        _records = TimeoutRecords()
    return _records


class PhaseTimes:
    """The buffer of components/common/phase_timer.cuh: PhaseTimer for one launch. `names` label the phases in the
    order the kernel marks them; after the launch, `durations_us()` gives each phase's span from the previous
    phase's latest end (the first: from the earliest end of phase 0, which the kernel marks at its start)."""

    def __init__(self, names: tuple[str, ...], device: object) -> None:
        import torch

        self.names = names
        self.times = torch.zeros(len(names), 2, dtype=torch.int64, device=device)
        self.times[:, 0] = -1  # u64 ~0 for the atomicMin

    @property
    def device_ptr(self) -> int:
        return self.times.data_ptr()

    def ends_us(self) -> list[tuple[str, float, float]]:
        """(phase, earliest end, latest end) in us after the earliest start."""
        t = self.times.cpu().tolist()
        start = t[0][0]
        return [(name, (lo - start) / 1e3, (hi - start) / 1e3) for name, (lo, hi) in zip(self.names, t)]
