"""Wave scheduler model: every tile exactly once, per-SM walk equals the global striding, no deadlock, and the
claimed per-SM lists the device produces (check_claims)."""
from __future__ import annotations

import random

import pytest

from megamoe.scheduler import (
    ScheduleError,
    Task,
    check_claims,
    check_schedule,
    iterate_sm,
    num_m_blocks,
    num_pool_blocks,
    pool_offsets,
    schedule,
    task_sequence,
    wave_bounds,
)


def _routings() -> dict[str, list[int]]:
    rng = random.Random(1234)
    return {
        "uniform": [96] * 8,
        "skewed": [0, 0, 5000, 0, 0, 0, 0, 0],
        "empty_experts": [0, 33, 0, 128, 1, 0, 64, 0],
        "all_zero": [0] * 6,
        "single_expert": [77],
        "random_small": [rng.randint(0, 40) for _ in range(16)],
        "random_large": [rng.randint(0, 700) for _ in range(12)],
        "random_sparse": [rng.choice((0, 0, 0, rng.randint(1, 300))) for _ in range(48)],
    }


ROUTINGS = _routings()
# (block_m, num_l1_n_blocks = 2I/128, num_l2_n_blocks = H/128, min_wave_l1_tiles, num_sms)
GEOMETRIES = [
    (32, 4, 2, 0, 7),  # one expert per wave
    (64, 32, 32, 132, 132),
    (128, 48, 56, 264, 132),
    (128, 2, 1, 78, 78),
    (32, 3, 5, 2**32 - 1, 1),  # one wave
    (64, 1, 1, 1000, 1000),  # more SMs than tasks
]


def test_num_m_blocks_and_pool_offsets() -> None:
    assert [num_m_blocks(n, 32) for n in (0, 1, 32, 33, 64)] == [0, 1, 1, 2, 2]
    assert pool_offsets([0, 1, 32, 33, 0, 5], 32) == [0, 0, 32, 64, 128, 128]
    assert pool_offsets([130, 0, 1], 128) == [0, 256, 256]
    assert num_pool_blocks([0, 1, 32, 33, 0, 5], 32) == 5
    assert all(o % 64 == 0 for o in pool_offsets([3, 70, 129, 1], 64))
    with pytest.raises(ValueError, match="block_m"):
        pool_offsets([1], 48)
    with pytest.raises(ValueError, match="num_tokens_per_expert"):
        pool_offsets([1, -1], 32)


@pytest.mark.parametrize("routing", list(ROUTINGS), ids=list(ROUTINGS))
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[f"bm{g[0]}-n{g[1]}x{g[2]}-wt{g[3]}-sm{g[4]}" for g in GEOMETRIES])
@pytest.mark.parametrize("n_major_l2", [False, True], ids=["m_major", "n_major"])
def test_every_tile_once_and_iterate_sm_matches(routing: str, geometry: tuple, n_major_l2: bool) -> None:
    counts = ROUTINGS[routing]
    block_m, num_l1_n, num_l2_n, wave_tiles, num_sms = geometry
    kwargs = dict(block_m=block_m, num_l1_n_blocks=num_l1_n, num_l2_n_blocks=num_l2_n,
                  min_wave_l1_tiles=wave_tiles, num_sms=num_sms, n_major_l2=n_major_l2)
    per_sm = schedule(counts, **kwargs)
    assert len(per_sm) == num_sms
    num_tasks = check_schedule(per_sm, counts, block_m=block_m, num_l1_n_blocks=num_l1_n, num_l2_n_blocks=num_l2_n)
    num_blocks = sum(num_m_blocks(c, block_m) for c in counts)
    assert num_tasks == num_blocks * (num_l1_n + num_l2_n)
    assert sum(len(tasks) for tasks in per_sm) == num_tasks
    # The per-SM walk (the device form) yields exactly the same tasks in the same order.
    for sm_idx in range(num_sms):
        assert list(iterate_sm(sm_idx, counts, **kwargs)) == per_sm[sm_idx]


@pytest.mark.parametrize("n_major_l2", [False, True])
def test_sequence_order(n_major_l2: bool) -> None:
    counts = [40, 0, 70, 10]
    # L1 tiles per expert: 4, 0, 6, 2. Waves of at least 4: [0], [1, 2] (expert 1 empty), [3].
    sequence = task_sequence(counts, block_m=32, num_l1_n_blocks=2, num_l2_n_blocks=3,
                             min_wave_l1_tiles=4, n_major_l2=n_major_l2)
    phases = [(t.phase, t.expert_idx) for t in sequence]
    assert phases == ([("l1", 0)] * 4 + [("l2", 0)] * 6 + [("l1", 2)] * 6 + [("l2", 2)] * 9
                      + [("l1", 3)] * 2 + [("l2", 3)] * 3)
    l1 = [(t.m_block_idx, t.n_block_idx) for t in sequence if t.phase == "l1" and t.expert_idx == 2]
    assert l1 == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    l2 = [(t.m_block_idx, t.n_block_idx) for t in sequence if t.phase == "l2" and t.expert_idx == 2]
    if n_major_l2:
        assert l2 == [(m, n) for n in range(3) for m in range(3)]
    else:
        assert l2 == [(m, n) for m in range(3) for n in range(3)]
    assert {t.pool_block_idx for t in sequence if t.expert_idx == 3} == {2 + 3}
    assert sequence[0] == Task("l1", 0, 0, 0, 0)


def test_wave_bounds() -> None:
    counts = [40, 0, 70, 10, 0]  # L1 tiles (block_m 32, 2 n blocks): 4, 0, 6, 2, 0
    kwargs = dict(block_m=32, num_l1_n_blocks=2)
    assert wave_bounds(counts, **kwargs, min_wave_l1_tiles=0) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    assert wave_bounds(counts, **kwargs, min_wave_l1_tiles=4) == [(0, 1), (1, 3), (3, 5)]
    assert wave_bounds(counts, **kwargs, min_wave_l1_tiles=10) == [(0, 3), (3, 5)]
    assert wave_bounds(counts, **kwargs, min_wave_l1_tiles=2**32 - 1) == [(0, 5)]
    assert wave_bounds([0, 0], **kwargs, min_wave_l1_tiles=1) == [(0, 2)]
    assert wave_bounds([], **kwargs, min_wave_l1_tiles=1) == []


def test_dependencies_have_smaller_global_index() -> None:
    rng = random.Random(7)
    for _ in range(50):
        counts = [rng.choice((0, rng.randint(1, 400))) for _ in range(rng.randint(1, 24))]
        block_m = rng.choice((32, 64, 128))
        wave_tiles = rng.choice((0, 1, rng.randint(1, 400), 2**32 - 1))
        n_major = rng.random() < 0.5
        sequence = task_sequence(counts, block_m=block_m, num_l1_n_blocks=rng.randint(1, 48),
                                 num_l2_n_blocks=rng.randint(1, 56), min_wave_l1_tiles=wave_tiles,
                                 n_major_l2=n_major)
        last_l1: dict[tuple[int, int], int] = {}
        for g, task in enumerate(sequence):
            if task.phase == "l1":
                last_l1[(task.expert_idx, task.m_block_idx)] = g
        for g, task in enumerate(sequence):
            if task.phase == "l2":
                # The L1 tasks of (expert, m) all precede it: the last one has a smaller global index.
                assert last_l1[(task.expert_idx, task.m_block_idx)] < g


def test_check_schedule_catches_errors() -> None:
    counts = [40, 70]
    kwargs = dict(block_m=32, num_l1_n_blocks=2, num_l2_n_blocks=2)
    good = schedule(counts, **kwargs, min_wave_l1_tiles=0, num_sms=3, n_major_l2=False)
    check_schedule(good, counts, **kwargs)
    # A missing tile
    with pytest.raises(ScheduleError):
        check_schedule([good[0], good[1], good[2][:-1]], counts, **kwargs)
    # A duplicated tile
    with pytest.raises(ScheduleError):
        check_schedule([good[0], good[1], good[2][:-1] + [good[0][0]]], counts, **kwargs)
    # L2 before its L1 dependency: swap the whole sequence into L2-first order
    sequence = task_sequence(counts, **kwargs, min_wave_l1_tiles=0, n_major_l2=False)
    sequence = sorted(sequence, key=lambda t: t.phase != "l2")
    bad = [sequence[s::3] for s in range(3)]
    with pytest.raises(ScheduleError, match="precedes"):
        check_schedule(bad, counts, **kwargs)
    # Wrong pool block
    broken = [list(sm) for sm in good]
    t = broken[0][0]
    broken[0][0] = Task(t.phase, t.expert_idx, t.m_block_idx, t.n_block_idx, t.pool_block_idx + 1)
    with pytest.raises(ScheduleError, match="pool_block_idx"):
        check_schedule(broken, counts, **kwargs)


def _claimed(sequence: list[Task], rates: list[float]) -> list[list[Task]]:
    """The device's claims (assembler/fused_roles.cuh: TaskClaims), simulated: SM s runs index s first, then the
    SM that finishes its task first (1 / rate per task) claims the next unclaimed index."""
    per_sm: list[list[Task]] = [[sequence[s]] if s < len(sequence) else [] for s in range(len(rates))]
    free_at = [1.0 / r if s < len(sequence) else 0.0 for s, r in enumerate(rates)]
    for task in sequence[len(rates):]:
        s = min(range(len(rates)), key=lambda i: free_at[i])
        per_sm[s].append(task)
        free_at[s] += 1.0 / rates[s]
    return per_sm


def test_check_claims() -> None:
    rng = random.Random(11)
    for routing in ROUTINGS.values():
        for block_m, num_l1_n, num_l2_n, wave_tiles, num_sms in GEOMETRIES:
            sequence = task_sequence(routing, block_m=block_m, num_l1_n_blocks=num_l1_n, num_l2_n_blocks=num_l2_n,
                                     min_wave_l1_tiles=wave_tiles, n_major_l2=True)
            # Equal rates claim exactly the static striding; one slow SM (a third of the rate) takes fewer tasks
            equal = _claimed(sequence, [1.0] * num_sms)
            check_claims(equal, sequence)
            assert equal == schedule(routing, block_m=block_m, num_l1_n_blocks=num_l1_n, num_l2_n_blocks=num_l2_n,
                                     min_wave_l1_tiles=wave_tiles, num_sms=num_sms, n_major_l2=True)
            check_claims(_claimed(sequence, [rng.uniform(0.5, 1.5) for _ in range(num_sms)]), sequence)
    sequence = task_sequence([40, 70], block_m=32, num_l1_n_blocks=2, num_l2_n_blocks=2, min_wave_l1_tiles=0,
                             n_major_l2=False)
    good = _claimed(sequence, [1.0, 0.3, 1.0])
    assert len(good[1]) < len(good[0])
    check_claims(good, sequence)
    with pytest.raises(ScheduleError, match="never ran"):
        check_claims([good[0], good[1], good[2][:-1]], sequence)
    with pytest.raises(ScheduleError, match="twice"):
        check_claims([good[0], good[1], good[2] + [good[0][-1]]], sequence)
    with pytest.raises(ScheduleError, match="out of global order"):
        check_claims([good[0][:1] + good[0][1:][::-1], good[1], good[2]], sequence)
    with pytest.raises(ScheduleError, match="own index"):
        check_claims([good[1], good[0], good[2]], sequence)


def test_argument_validation() -> None:
    kwargs = dict(block_m=32, num_l1_n_blocks=2, num_l2_n_blocks=2, min_wave_l1_tiles=0, num_sms=4,
                  n_major_l2=False)
    with pytest.raises(ValueError, match="sm_idx"):
        list(iterate_sm(4, [1], **kwargs))
    with pytest.raises(ValueError, match="num_sms"):
        schedule([1], **{**kwargs, "num_sms": 0})
    with pytest.raises(ValueError, match="min_wave_l1_tiles"):
        schedule([1], **{**kwargs, "min_wave_l1_tiles": -1})
    with pytest.raises(ValueError, match="block_m"):
        schedule([1], **{**kwargs, "block_m": 16})
