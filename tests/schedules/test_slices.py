"""The slice lengths chosen for one sequence are the best cut the predicted slice times allow (fxpipe/schedules/slices.py)."""
from __future__ import annotations

import itertools
import random

import pytest

from fxpipe.schedules.slices import best_slices, pipeline_time, slice_time


def compositions(length: int, granularity: int) -> list[list[int]]:
    """Every cut of `length` into slices that start at multiples of `granularity`."""
    points = list(range(granularity, length, granularity))
    found = []
    for r in range(len(points) + 1):
        for inner in itertools.combinations(points, r):
            ends = [0, *inner, length]
            found.append([b - a for a, b in zip(ends, ends[1:])])
    return found


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("stages", [1, 2, 4])
def test_the_program_finds_the_best_of_every_cut(seed: int, stages: int) -> None:
    rng = random.Random(seed)
    length, granularity = rng.choice([(9, 1), (12, 2), (11, 3)])
    if seed % 2:  # a time of the model's kind
        time = slice_time(rng.uniform(0, 2), rng.uniform(0, 0.5), rng.uniform(0, 4))
    else:  # any time at all, looked up
        table = {(n, b): rng.uniform(0.1, 5) for n in range(1, length + 1) for b in range(length)}
        time = lambda n, b: table[n, b]  # noqa: E731
    chosen = best_slices(length, stages, time, granularity)
    assert sum(chosen) == length and all(n % granularity == 0 for n in chosen[:-1])
    best = min(pipeline_time(cut, stages, time) for cut in compositions(length, granularity))
    assert pipeline_time(chosen, stages, time) == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_a_count_of_slices_gets_the_best_cut_of_that_many(seed: int) -> None:
    rng = random.Random(seed)
    length, granularity, stages = 11, rng.choice([1, 2]), rng.choice([1, 2, 3])
    time = slice_time(rng.uniform(0, 2), rng.uniform(0, 0.5), rng.uniform(0, 4))
    cuts = compositions(length, granularity)
    for count in sorted({len(cut) for cut in cuts}):
        chosen = best_slices(length, stages, time, granularity, count)
        assert len(chosen) == count and sum(chosen) == length and all(n % granularity == 0 for n in chosen[:-1])
        best = min(pipeline_time(cut, stages, time) for cut in cuts if len(cut) == count)
        assert pipeline_time(chosen, stages, time) == pytest.approx(best, rel=1e-12)
    with pytest.raises(ValueError, match="into 12 slices"):
        best_slices(length, stages, time, 1, 12)


def test_later_slices_are_shorter_when_attention_costs_and_slices_pay_for_themselves() -> None:
    time = slice_time(1.0, 0.01, 5.0)
    chosen = best_slices(1024, 2, time, 16)
    assert chosen == sorted(chosen, reverse=True) and len(chosen) > 8
    for k in (1, 2, 4, 8, 16):
        assert pipeline_time(chosen, 2, time) < pipeline_time([1024 // k] * k, 2, time)
    # One stage has no pipeline to fill: without attention, a slice only adds its own cost.
    assert best_slices(64, 1, slice_time(1.0, 0.0, 5.0), 8) == [64]
    # Attention's scores stop at each slice's last key: slicing saves the masked pairs.
    assert len(best_slices(64, 1, slice_time(0.0, 1.0, 5.0), 8)) > 1


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="1 or more"):
        best_slices(0, 2, slice_time(1, 0, 0))


def test_rows_made_slices_keep_each_row_s_order_and_the_checker_holds_carries() -> None:
    from fxpipe.schedules.actions import BACKWARD, FORWARD, Action, Layout, Schedule, by_rows, one_f_one_b
    from fxpipe.schedules.check import ScheduleError, check, make_schedule

    layout = Layout.of([], [0, 1])
    rows = one_f_one_b(layout, 3)
    expanded = by_rows(rows, 2)
    # Stage 1 alternates at once: row 0's two forwards, then its backwards in reverse, and so on.
    assert " ".join(map(str, expanded[1])) == "F0@1 F1@1 B1@1 B0@1 F2@1 F3@1 B3@1 B2@1 F4@1 F5@1 B5@1 B4@1"
    schedule = make_schedule("1f1b", layout, 6, 0, True, 2)
    assert schedule.slices == 2 and [list(a) for a in schedule.actions] == expanded
    # A row's backwards in order would need a carry's gradient before it is made: refused.
    wrong = [[Action(FORWARD, s, i) for i in range(4)] + [Action(BACKWARD, s, i) for i in range(4)] for s in range(2)]
    with pytest.raises(ScheduleError, match="deadlock"):
        check(Schedule("gpipe", tuple(map(tuple, wrong)), 4, True, 2), layout, 0)
    check(Schedule("gpipe", tuple(map(tuple, wrong)), 4, True, 1), layout, 0)  # the same order, without carries: fine
