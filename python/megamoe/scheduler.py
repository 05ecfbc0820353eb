"""Python model of the fused kernel's wave scheduler (DESIGN section 5: waves of experts, L1 then L2, N-major L2
at large loads): which tiles each SM computes, in which order, and why that order cannot deadlock; and the pool
layout every kernel shares (`pool_offsets`, `num_pool_blocks`).

The fused kernel's device scheduler, assembler/fused_scheduler.cuh (FusedScheduler::seek), walks this global
order the way `iterate_sm` does (no global list, per-expert counts from the receive table in shared memory), but
the indices a CTA runs are claimed at run time (assembler/fused_roles.cuh: TaskClaims): CTA s starts at index s,
then takes the next unclaimed index whenever it is ready for one, so the per-CTA lists are those of `schedule` only
when every CTA runs at the same rate. A GPU test dumps each CTA's task list and holds it to `check_claims`
(tests/test_fused_gpu.py). Other device orders:
components/gemm/tile_scheduler.cuh, the standalone GEMM's (expert-major, bands of band_m m-blocks, n-block-major
inside a band), and assembler/expert_ffn_scheduler.cuh, the expert-FFN unit kernel's (every L1 tile in that order,
then every L2 tile: this model's order for one wave of all local experts with M-major L2 when band_m = 1).

Global task sequence: the local experts are cut into waves of consecutive experts (`wave_bounds`: a wave closes
after the first expert that brings its L1 tile count to at least `min_wave_l1_tiles`; the last wave takes what
remains), decided from the received counts, as the device does; for each wave, first every L1 task of the wave
(expert-major, then m-block, then n-block), then every L2 task of the wave (per expert; M-major: m then n, N-major:
n then m). In `schedule` and `iterate_sm`, SM s takes global indices s, s + num_sms, s + 2*num_sms, ... (static
striding that continues across waves and phases): the device's claims when every CTA runs at the same rate.

No deadlock: an L2 task (expert, m) waits for every L1 task (expert, m) (the pool block's `l1_done_count` reaching
num_l1_n_blocks). All L1 tasks of a wave precede its L2 tasks in the global sequence, so every dependency has a
smaller global index; each SM executes its tasks in increasing global index and every index below a claimed one is
claimed, so by induction on the global index every task completes. `check_schedule` asserts this property on a
static schedule, `check_claims` on claimed lists.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from megamoe.layout import BLOCK_M_CANDIDATES, ceil_div

Phase = Literal["l1", "l2"]


class ScheduleError(AssertionError):
    """A schedule violates coverage, striding or dependency order."""


@dataclass(frozen=True)
class Task:
    """One output tile: (m_block_idx, n_block_idx) of local expert `expert_idx` in phase L1 or L2.

    `pool_block_idx` is the tile's row block in the pool: pool rows [pool_block_idx * block_m, + block_m).
    """

    phase: Phase
    expert_idx: int
    m_block_idx: int
    n_block_idx: int
    pool_block_idx: int


def num_m_blocks(num_tokens: int, block_m: int) -> int:
    """Number of BLOCK_M row blocks for `num_tokens` rows (0 for 0 tokens)."""
    return ceil_div(num_tokens, block_m)


def _check_counts(num_tokens_per_expert: Sequence[int]) -> list[int]:
    counts = list(num_tokens_per_expert)
    for expert_idx, count in enumerate(counts):
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(
                f"num_tokens_per_expert must hold non-negative ints, got {count!r} at expert {expert_idx}"
            )
    return counts


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_block_m(block_m: int) -> None:
    if block_m not in BLOCK_M_CANDIDATES:
        raise ValueError(f"block_m must be one of {BLOCK_M_CANDIDATES}, got {block_m!r}")


def pool_offsets(num_tokens_per_expert: Sequence[int], block_m: int) -> list[int]:
    """Pool row of each local expert's first token: experts back to back, each padded to a multiple of block_m."""
    _check_block_m(block_m)
    offsets: list[int] = []
    offset = 0
    for count in _check_counts(num_tokens_per_expert):
        offsets.append(offset)
        offset += num_m_blocks(count, block_m) * block_m
    return offsets


def num_pool_blocks(num_tokens_per_expert: Sequence[int], block_m: int) -> int:
    """Pool blocks used by this routing: sum over experts of ceil(count / block_m)."""
    _check_block_m(block_m)
    return sum(num_m_blocks(count, block_m) for count in _check_counts(num_tokens_per_expert))


def _check_schedule_args(
    block_m: int, num_l1_n_blocks: int, num_l2_n_blocks: int, min_wave_l1_tiles: int, num_sms: int
) -> None:
    _check_block_m(block_m)
    _check_positive("num_l1_n_blocks", num_l1_n_blocks)
    _check_positive("num_l2_n_blocks", num_l2_n_blocks)
    if isinstance(min_wave_l1_tiles, bool) or not isinstance(min_wave_l1_tiles, int) or \
            not 0 <= min_wave_l1_tiles < 2**32:
        raise ValueError(f"min_wave_l1_tiles must be an int in [0, 2**32), got {min_wave_l1_tiles!r}")
    _check_positive("num_sms", num_sms)


def wave_bounds(
    num_tokens_per_expert: Sequence[int], *, block_m: int, num_l1_n_blocks: int, min_wave_l1_tiles: int
) -> list[tuple[int, int]]:
    """The waves as [begin, end) expert ranges: each wave closes after the first expert that brings its L1 tiles
    (ceil(count / block_m) * num_l1_n_blocks per expert) to at least `min_wave_l1_tiles`; every wave holds at least
    one expert; the last wave takes what remains (FusedScheduler::cut_wave)."""
    _check_schedule_args(block_m, num_l1_n_blocks, 1, min_wave_l1_tiles, 1)
    counts = _check_counts(num_tokens_per_expert)
    bounds: list[tuple[int, int]] = []
    begin = 0
    while begin < len(counts):
        end, num_tiles = begin, 0
        while end < len(counts) and (end == begin or num_tiles < min_wave_l1_tiles):
            num_tiles += num_m_blocks(counts[end], block_m) * num_l1_n_blocks
            end += 1
        bounds.append((begin, end))
        begin = end
    return bounds


def _l2_block(local_idx: int, num_m: int, num_n: int, n_major_l2: bool) -> tuple[int, int]:
    # M-major: (m, n) = (idx / num_n, idx % num_n); N-major: (m, n) = (idx % num_m, idx / num_m)
    if n_major_l2:
        return local_idx % num_m, local_idx // num_m
    return local_idx // num_n, local_idx % num_n


def task_sequence(
    num_tokens_per_expert: Sequence[int],
    *,
    block_m: int,
    num_l1_n_blocks: int,
    num_l2_n_blocks: int,
    min_wave_l1_tiles: int,
    n_major_l2: bool,
) -> list[Task]:
    """The global task sequence, materialised (index = global task index)."""
    _check_schedule_args(block_m, num_l1_n_blocks, num_l2_n_blocks, min_wave_l1_tiles, 1)
    counts = _check_counts(num_tokens_per_expert)
    offsets = pool_offsets(counts, block_m)
    sequence: list[Task] = []
    for wave_begin, wave_end in wave_bounds(counts, block_m=block_m, num_l1_n_blocks=num_l1_n_blocks,
                                            min_wave_l1_tiles=min_wave_l1_tiles):
        wave = range(wave_begin, wave_end)
        for expert_idx in wave:
            first_block = offsets[expert_idx] // block_m
            for m in range(num_m_blocks(counts[expert_idx], block_m)):
                for n in range(num_l1_n_blocks):
                    sequence.append(Task("l1", expert_idx, m, n, first_block + m))
        for expert_idx in wave:
            first_block = offsets[expert_idx] // block_m
            num_m = num_m_blocks(counts[expert_idx], block_m)
            if n_major_l2:
                pairs = [(m, n) for n in range(num_l2_n_blocks) for m in range(num_m)]
            else:
                pairs = [(m, n) for m in range(num_m) for n in range(num_l2_n_blocks)]
            sequence.extend(Task("l2", expert_idx, m, n, first_block + m) for m, n in pairs)
    return sequence


def schedule(
    num_tokens_per_expert: Sequence[int],
    *,
    block_m: int,
    num_l1_n_blocks: int,
    num_l2_n_blocks: int,
    min_wave_l1_tiles: int,
    num_sms: int,
    n_major_l2: bool,
) -> list[list[Task]]:
    """Tasks of each SM in execution order: SM s gets global indices s, s + num_sms, ..."""
    _check_schedule_args(block_m, num_l1_n_blocks, num_l2_n_blocks, min_wave_l1_tiles, num_sms)
    sequence = task_sequence(
        num_tokens_per_expert,
        block_m=block_m,
        num_l1_n_blocks=num_l1_n_blocks,
        num_l2_n_blocks=num_l2_n_blocks,
        min_wave_l1_tiles=min_wave_l1_tiles,
        n_major_l2=n_major_l2,
    )
    return [sequence[sm_idx::num_sms] for sm_idx in range(num_sms)]


def iterate_sm(
    sm_idx: int,
    num_tokens_per_expert: Sequence[int],
    *,
    block_m: int,
    num_l1_n_blocks: int,
    num_l2_n_blocks: int,
    min_wave_l1_tiles: int,
    num_sms: int,
    n_major_l2: bool,
) -> Iterator[Task]:
    """The tasks of one SM, computed the way the device does: walk the waves, never build the global list.

    State: `task_idx` (the next global index this SM takes), the current wave (cut when it starts) and, per phase
    of a wave, the current expert and the global index of its first task. All only move forward, so the walk costs
    O(E_local + tasks of this SM).
    """
    _check_schedule_args(block_m, num_l1_n_blocks, num_l2_n_blocks, min_wave_l1_tiles, num_sms)
    if isinstance(sm_idx, bool) or not isinstance(sm_idx, int) or not 0 <= sm_idx < num_sms:
        raise ValueError(f"sm_idx must be an int in [0, {num_sms}), got {sm_idx!r}")
    counts = _check_counts(num_tokens_per_expert)
    num_experts = len(counts)

    task_idx = sm_idx  # next global task index of this SM
    phase_begin_idx = 0  # global index of the current phase's first task
    pool_block_begin = 0  # pool block of the current wave's first expert
    wave_begin = 0
    while wave_begin < num_experts:
        # Cut the wave that starts here (FusedScheduler::cut_wave)
        wave_end, num_wave_tiles = wave_begin, 0
        while wave_end < num_experts and (wave_end == wave_begin or num_wave_tiles < min_wave_l1_tiles):
            num_wave_tiles += num_m_blocks(counts[wave_end], block_m) * num_l1_n_blocks
            wave_end += 1
        for phase, num_n in (("l1", num_l1_n_blocks), ("l2", num_l2_n_blocks)):
            # Walk the wave's experts; each owns num_m * num_n consecutive global indices of this phase
            expert_begin_idx = phase_begin_idx
            expert_pool_block = pool_block_begin
            for expert_idx in range(wave_begin, wave_end):
                num_m = num_m_blocks(counts[expert_idx], block_m)
                expert_end_idx = expert_begin_idx + num_m * num_n
                while task_idx < expert_end_idx:
                    local_idx = task_idx - expert_begin_idx
                    if phase == "l1":
                        m, n = local_idx // num_n, local_idx % num_n
                    else:
                        m, n = _l2_block(local_idx, num_m, num_n, n_major_l2)
                    yield Task(phase, expert_idx, m, n, expert_pool_block + m)  # type: ignore[arg-type]
                    task_idx += num_sms
                expert_begin_idx = expert_end_idx
                expert_pool_block += num_m
            phase_begin_idx = expert_begin_idx
        pool_block_begin = expert_pool_block
        wave_begin = wave_end


def check_schedule(
    per_sm: Sequence[Sequence[Task]],
    num_tokens_per_expert: Sequence[int],
    *,
    block_m: int,
    num_l1_n_blocks: int,
    num_l2_n_blocks: int,
) -> int:
    """Assert a per-SM schedule is complete and deadlock-free; return the number of tasks.

    Checks: every L1 and L2 tile of every expert appears exactly once; pool_block_idx matches `pool_offsets`; the
    per-SM lists are a static striding of one global sequence (task p of SM s has global index s + p * num_sms,
    and those indices are exactly 0..num_tasks-1); every L1 task (expert, m) has a smaller global index than every
    L2 task (expert, m). Raises ScheduleError on the first violation.
    """
    counts = _check_counts(num_tokens_per_expert)
    offsets = pool_offsets(counts, block_m)
    num_sms = len(per_sm)
    if num_sms == 0:
        raise ValueError("per_sm must hold at least one SM's list")

    expected: set[tuple[str, int, int, int]] = set()
    for expert_idx, count in enumerate(counts):
        for m in range(num_m_blocks(count, block_m)):
            expected.update(("l1", expert_idx, m, n) for n in range(num_l1_n_blocks))
            expected.update(("l2", expert_idx, m, n) for n in range(num_l2_n_blocks))
    num_tasks = len(expected)

    seen: dict[tuple[str, int, int, int], int] = {}
    last_l1_idx: dict[tuple[int, int], int] = {}
    first_l2_idx: dict[tuple[int, int], int] = {}
    for sm_idx, tasks in enumerate(per_sm):
        expected_len = max(0, ceil_div(num_tasks - sm_idx, num_sms))
        if len(tasks) != expected_len:
            raise ScheduleError(
                f"SM {sm_idx} has {len(tasks)} tasks, static striding of {num_tasks} gives {expected_len}"
            )
        for position, task in enumerate(tasks):
            global_idx = sm_idx + position * num_sms
            key = (task.phase, task.expert_idx, task.m_block_idx, task.n_block_idx)
            if key not in expected:
                raise ScheduleError(f"SM {sm_idx} task {position} is not a tile of this routing: {task}")
            if key in seen:
                raise ScheduleError(f"tile {key} scheduled twice (global {seen[key]} and {global_idx})")
            seen[key] = global_idx
            pool_block = offsets[task.expert_idx] // block_m + task.m_block_idx
            if task.pool_block_idx != pool_block:
                raise ScheduleError(f"{task}: pool_block_idx must be {pool_block}")
            dep_key = (task.expert_idx, task.m_block_idx)
            if task.phase == "l1":
                last_l1_idx[dep_key] = max(last_l1_idx.get(dep_key, -1), global_idx)
            else:
                first_l2_idx[dep_key] = min(first_l2_idx.get(dep_key, num_tasks), global_idx)
    missing = expected - seen.keys()
    if missing:
        raise ScheduleError(f"{len(missing)} tiles never scheduled, e.g. {sorted(missing)[:4]}")
    for dep_key, l2_idx in first_l2_idx.items():
        if last_l1_idx[dep_key] >= l2_idx:
            raise ScheduleError(
                f"L2 task (expert, m) = {dep_key} at global {l2_idx} precedes its L1 dependency "
                f"at {last_l1_idx[dep_key]}"
            )
    return num_tasks


def check_claims(per_sm: Sequence[Sequence[Task]], sequence: Sequence[Task]) -> None:
    """Assert per-SM task lists are what the device's claims can produce from the global `sequence`
    (`task_sequence`): SM s starts with global index s (when there is one), each list runs in increasing global
    index, and the lists together hold every task of the sequence exactly once. Raises ScheduleError."""
    position = {task: idx for idx, task in enumerate(sequence)}
    seen: set[Task] = set()
    for sm_idx, tasks in enumerate(per_sm):
        indices = []
        for task in tasks:
            if task not in position:
                raise ScheduleError(f"SM {sm_idx}: {task} is not a task of the sequence")
            if task in seen:
                raise ScheduleError(f"SM {sm_idx}: {task} (global {position[task]}) ran twice")
            seen.add(task)
            indices.append(position[task])
        if sm_idx < len(sequence) and indices[:1] != [sm_idx]:
            raise ScheduleError(f"SM {sm_idx} started at global index {indices[:1]}, not at its own index")
        if any(b <= a for a, b in zip(indices, indices[1:])):
            raise ScheduleError(f"SM {sm_idx} ran its tasks out of global order: {indices}")
    if len(seen) != len(sequence):
        missing = [position[task] for task in sequence if task not in seen]
        raise ScheduleError(f"{len(missing)} tasks never ran, e.g. global indices {missing[:4]}")
