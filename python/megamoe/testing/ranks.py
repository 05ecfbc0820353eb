"""One process per GPU, for the multigpu tests and `megamoe bench comm`: `spawn_ranks` starts the ranks, sets each
one up (torch.distributed on localhost, symmetric memory, a gloo group for host-side barriers), runs a function in
each and returns what each returned; when a rank fails, dies or hangs it raises `RankFailure` with every rank's
traceback instead of waiting forever. backend="gloo" runs the same harness on a CPU (tests of the harness).
"""
from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch


class RankFailure(RuntimeError):
    """A rank raised, exited without reporting, or did not report in time (the message has every rank's
    traceback)."""


@dataclass(frozen=True)
class RankContext:
    """What a rank's function gets. group: the WORLD process group (NCCL, or gloo); cpu_group: a gloo group for
    barriers and gathers that launch nothing on the GPU (the WORLD group with gloo; None where it could not be
    made); release: an Event the parent sets once rank 0 has reported (a rank whose memory a trapped peer still
    maps waits on it before it leaves)."""

    rank: int
    num_ranks: int
    group: Any
    cpu_group: Any
    release: Any

    def phase_barrier(self) -> None:
        """Everything this rank launched has finished, and so has every other rank's (before the next phase)."""
        import torch.distributed as dist

        torch.cuda.synchronize()
        if self.cpu_group is not None:
            dist.barrier(group=self.cpu_group)
        else:
            dist.barrier(device_ids=[torch.cuda.current_device()])
            torch.cuda.synchronize()

    def all_agree(self, flag: bool) -> bool:
        """flag on every rank (a collective: every rank calls it)."""
        import torch.distributed as dist

        device = "cpu" if self.cpu_group is not None else "cuda"
        value = torch.tensor([int(flag)], dtype=torch.int32, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return bool(value.item())


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago (the process group's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _init_rank(rank: int, num_ranks: int, port: int, backend: str, release: Any) -> RankContext:
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=num_ranks)
    group = dist.group.WORLD
    cpu_group: Any = group
    if backend == "nccl":
        # (symmetric memory is enabled for the group where a buffer is allocated: megamoe.buffer.allocate)
        try:
            cpu_group = dist.new_group(backend="gloo")
        except Exception:
            cpu_group = None
    return RankContext(rank, num_ranks, group, cpu_group, release)


def _rank_main(rank: int, num_ranks: int, port: int, backend: str, fn: Callable[..., Any], args: tuple,
               results: Any, release: Any) -> None:
    from megamoe.buffer import NO_MULTICAST_ENV

    os.environ.update(NO_MULTICAST_ENV)  # before any NCCL / symmetric-memory initialization (DESIGN 6)
    value, error = None, None
    try:
        value = fn(_init_rank(rank, num_ranks, port, backend, release), *args)
    except BaseException:
        error = f"rank {rank} raised:\n{traceback.format_exc()}"
    # One report per rank, then leave without interpreter teardown (a trapped CUDA context cannot shut down
    # cleanly, and a peer's memory may still be mapped)
    results.put((rank, value, error))
    results.close()
    results.join_thread()
    os._exit(0)


def spawn_ranks(num_ranks: int, fn: Callable[..., Any], *args: Any, backend: str = "nccl", what: str = "ranks",
                timeout_s: float = 900.0, grace_s: float = 30.0) -> list[Any]:
    """fn(RankContext, *args) in num_ranks spawned processes (rank r on GPU r; fn and args picklable: module-level
    functions and plain data); returns each rank's return value, by rank. Raises RankFailure ("{what} failed:" and
    every rank's traceback) when a rank raises or exits without reporting; ranks still running grace_s after a
    failure (waiting in a collective for the failed one) are killed, as are all of them after timeout_s."""
    import torch.multiprocessing as mp

    from megamoe.buffer import NO_MULTICAST_ENV

    os.environ.update(NO_MULTICAST_ENV)  # inherited by the spawned ranks as well
    ctx = mp.get_context("spawn")
    results, release = ctx.Queue(), ctx.Event()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, num_ranks, port, backend, fn, args, results, release),
                         daemon=True) for rank in range(num_ranks)]
    for proc in procs:
        proc.start()
    reports: dict[int, tuple[Any, str | None]] = {}
    problems: list[str] = []
    deadline, grace = time.monotonic() + timeout_s, None
    try:
        while len(reports) < num_ranks:
            try:
                rank, value, error = results.get(timeout=1.0)
            except queue.Empty:
                now = time.monotonic()
                missing = sorted(set(range(num_ranks)) - reports.keys())
                dead = [r for r in missing if not procs[r].is_alive()]
                if dead:
                    problems.append(f"ranks {dead} exited (codes {[procs[r].exitcode for r in dead]}) without "
                                    f"reporting")
                    break
                if now > deadline:
                    problems.append(f"ranks {missing} did not report within {timeout_s:.0f} s (hang?); killed")
                    break
                if grace is not None and now > grace:
                    problems.append(f"ranks {missing} still running {grace_s:.0f} s after a failure (waiting in a "
                                    f"collective?); killed")
                    break
                continue
            reports[rank] = (value, error)
            if rank == 0:
                release.set()
            if error and grace is None:
                grace = time.monotonic() + grace_s
    finally:
        release.set()
        for proc in procs:
            proc.join(30 if len(reports) == num_ranks else 1)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
    problems = [err for _, (_, err) in sorted(reports.items()) if err] + problems
    if problems:
        raise RankFailure(f"{what} failed:\n" + "\n".join(problems))
    return [reports[rank][0] for rank in range(num_ranks)]


def gather_case_records(ranks: RankContext, cases: Sequence[Any], case_fn: Callable[[Any, int], dict],
                        what: str) -> list[list[dict]] | None:
    """Every case on this rank (case_fn(case, index) -> its record), each case's time on rank 0's stderr; the
    records gathered on rank 0 over the cpu group: records[rank][case] there, None on the other ranks (the benches'
    one-process-per-GPU loop)."""
    import sys

    import torch.distributed as dist

    records = []
    for index, case in enumerate(cases):
        started = time.perf_counter()
        records.append(case_fn(case, index))
        if ranks.rank == 0:
            print(f"{what}: {case.name} done in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    gathered: list | None = [None] * ranks.num_ranks if ranks.rank == 0 else None
    dist.gather_object(records, gathered, dst=0, group=ranks.cpu_group)
    return gathered


def expect_barrier_timeout(rank: int, launch: Callable[[], Any], timeout_s: float,
                           site: str = "nvl_dispatch") -> list[str]:
    """Launch a kernel whose peer never arrives (the multigpu tiers' absent-rank scenarios; no NCCL communicator
    may be alive here, see their NOTES): it must trap after about `timeout_s`, with a host record from this rank
    naming `site`. Returns the errors (empty: as expected)."""
    from megamoe.jit.diagnostics import timeout_records

    started = time.perf_counter()
    try:
        launch()
        torch.cuda.synchronize()
        return [f"rank {rank}: the kernel completed although its peer never launched"]
    except Exception as exc:  # the trap poisons the context: every later CUDA call fails too
        failure = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    elapsed = time.perf_counter() - started
    reports = [str(r) for r in timeout_records().reports()]
    errors = []
    if not any(f"timed out at '{site}'" in r and r.startswith(f"rank {rank} ") for r in reports):
        errors.append(f"rank {rank}: no {site} timeout report (failure {failure!r}, reports {reports})")
    if not timeout_s <= elapsed < timeout_s * 10 + 30:
        errors.append(f"rank {rank}: failed after {elapsed:.1f} s with a {timeout_s} s timeout")
    return errors
