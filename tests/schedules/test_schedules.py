"""Schedules as data: the schedule functions, the checker, the simulator, and the executor that
runs exactly the checked lists; timelines as Chrome traces and Gantt charts."""
from __future__ import annotations

import copy
import html
import json
import xml.etree.ElementTree as ET
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import FanOut, assert_grads_equal
from fxpipe import StageError, compile_pipeline
from fxpipe.schedules.actions import BACKWARD, FORWARD, INPUT_GRAD, SCHEDULES, WEIGHT_GRAD, Action, Layout, Schedule
from fxpipe.schedules.check import ScheduleError, check, make_schedule
from fxpipe.schedules.simulate import StageCosts, simulate


def chain(stages: int, workers: int = 0) -> Layout:
    workers = workers or stages
    return Layout(tuple(s % workers for s in range(stages)), frozenset((s, s + 1) for s in range(stages - 1)), (stages - 1,))


@st.composite
def layouts(draw: Any, one_per_worker: bool = True) -> Layout:
    """A stage graph whose links go forward: a chain plus skips, outputs from the last stage and
    perhaps from others."""
    n = draw(st.integers(1, 5))
    links = {(s, s + 1) for s in range(n - 1)}
    links |= {(a, b) for a in range(n) for b in range(a + 2, n) if draw(st.booleans())}
    outputs = {n - 1} | {s for s in range(n - 1) if draw(st.integers(0, 3)) == 0}
    return Layout(tuple(range(n)), frozenset(links), tuple(sorted(outputs)))


@st.composite
def dags(draw: Any) -> Layout:
    """A stage graph whose links go forward but need not form a chain: each stage feeds one or
    more later ones (branches side by side, joins), the last makes the output."""
    n = draw(st.integers(2, 6))
    links = {(s, draw(st.integers(s + 1, n - 1))) for s in range(n - 1)}
    links |= {(a, b) for a in range(n) for b in range(a + 1, n) if draw(st.integers(0, 3)) == 0}
    return Layout(tuple(range(n)), frozenset(links), (n - 1,))


def test_the_longest_path_sets_the_depth_and_what_each_stage_waits_for() -> None:
    towers = Layout((0, 1, 2), frozenset({(0, 2), (1, 2)}), (2,))  # two branches, then a join
    assert towers.depth == 2 and [towers.stages_after(s) for s in range(3)] == [1, 1, 0]
    skip = Layout((0, 1, 2, 3), frozenset({(0, 1), (1, 2), (2, 3), (0, 3)}), (3,))
    assert skip.depth == 4 and [skip.stages_after(s) for s in range(4)] == [3, 2, 1, 0]
    assert chain(5).depth == 5 and [chain(5).stages_after(s) for s in range(5)] == [4, 3, 2, 1, 0]


def test_1f1b_warms_each_branch_up_by_the_stages_after_it_on_the_longest_path() -> None:
    towers = Layout((0, 1, 2), frozenset({(0, 2), (1, 2)}), (2,))
    schedule = make_schedule("1f1b", towers, 6, 0)
    for stage, warmup in ((0, 1), (1, 1), (2, 0)):
        kinds = [a.kind for a in schedule.actions[stage]]
        assert kinds[: warmup + 1] == [FORWARD] * (warmup + 1) and kinds[warmup + 1] == BACKWARD, (stage, kinds)
    timeline = simulate(schedule, towers, [StageCosts(1.0, 2.0)] * 3, 0).timeline
    assert max(timeline.most_alive().values()) <= towers.depth  # the chain's first stage would hold 3
    zb = make_schedule("zb-h1", towers, 6, 0)
    assert max(simulate(zb, towers, [StageCosts(1.0, 2.0)] * 3, 0).timeline.most_alive().values()) <= towers.depth


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(layout=st.one_of(layouts(), dags()), m=st.integers(1, 9), name=st.sampled_from(["gpipe", "1f1b", "zb-h1"]), data=st.data())
def test_every_schedule_is_complete_and_free_of_deadlock_on_stage_graphs(layout: Layout, m: int, name: str, data: Any) -> None:
    checkpointed = data.draw(st.integers(0, m))
    make_schedule.cache_clear()
    schedule = make_schedule(name, layout, m, checkpointed)  # checks it, or raises
    check(schedule, layout, checkpointed)


@pytest.mark.parametrize("workers,per_worker,m", [(1, 3, 2), (2, 2, 4), (2, 3, 6), (3, 2, 3), (4, 2, 8), (3, 3, 9)])
def test_interleaved_schedules_are_valid(workers: int, per_worker: int, m: int) -> None:
    layout = chain(workers * per_worker, workers)
    for checkpointed in (0, m - 1, m):
        check(make_schedule("interleaved-1f1b", layout, m, checkpointed), layout, checkpointed)


def _broken(schedule: Schedule, worker: int, acts: list[Action]) -> Schedule:
    rows = list(schedule.actions)
    rows[worker] = tuple(acts)
    return Schedule("edited", tuple(rows), schedule.micro_batches, schedule.loss)


def test_the_checker_rejects_a_missing_action() -> None:
    layout = chain(2)
    good = make_schedule("1f1b", layout, 3, 0)
    bad = _broken(good, 1, [a for a in good.actions[1] if a != Action(BACKWARD, 1, 2)])
    with pytest.raises(ScheduleError, match=r"missing: B2@1"):
        check(bad, layout, 0)


def test_the_checker_rejects_an_action_before_its_input() -> None:
    layout = chain(2)
    good = make_schedule("1f1b", layout, 3, 0)
    acts = list(good.actions[0])  # worker 0: F0 F1 B0 F2 B1 B2 -> B0 first: its gradient needs F0
    acts.remove(Action(BACKWARD, 0, 0))
    with pytest.raises(ScheduleError, match=r"deadlock: .*B0@0"):
        check(_broken(good, 0, [Action(BACKWARD, 0, 0), *acts]), layout, 0)


def test_the_checker_rejects_a_cycle_between_workers() -> None:
    layout = chain(2)
    good = make_schedule("gpipe", layout, 2, 0)
    # Worker 1 runs F1 before F0, and worker 0 sends F1 only after its backward of micro-batch 0,
    # which waits for worker 1's B0, which runs after F1: a cycle.
    w0 = [Action(FORWARD, 0, 0), Action(BACKWARD, 0, 0), Action(FORWARD, 0, 1), Action(BACKWARD, 0, 1)]
    w1 = [Action(FORWARD, 1, 1), Action(FORWARD, 1, 0), Action(BACKWARD, 1, 0), Action(BACKWARD, 1, 1)]
    with pytest.raises(ScheduleError, match="deadlock"):
        check(_broken(_broken(good, 0, w0), 1, w1), layout, 0)


def test_the_checker_rejects_repeats_and_misplaced_actions() -> None:
    layout = chain(2)
    good = make_schedule("gpipe", layout, 2, 0)
    with pytest.raises(ScheduleError) as info:
        check(_broken(good, 0, [*good.actions[0], Action(FORWARD, 0, 0), Action(FORWARD, 1, 5)]), layout, 0)
    message = str(info.value)
    assert "listed more than once: F0@0" in message and "not part of this step: F5@1" in message
    assert "worker 0 lists actions of other workers' stages: F5@1" in message


@pytest.mark.parametrize("n,m", [(2, 1), (2, 4), (4, 8), (3, 5)])
def test_the_simulated_gpipe_and_1f1b_take_the_textbook_time(n: int, m: int) -> None:
    layout = chain(n)
    costs = [StageCosts(forward=1.0, backward=2.0)] * n
    for name in ("gpipe", "1f1b"):
        timeline = simulate(make_schedule(name, layout, m, 0), layout, costs).timeline
        assert timeline.makespan == pytest.approx(3.0 * (m + n - 1))
        assert timeline.bubble() == pytest.approx((n - 1) / (m + n - 1))


def test_zero_bubble_is_shorter_and_interleaving_too() -> None:
    n, m = 4, 8
    one_f_one_b = simulate(make_schedule("1f1b", chain(n), m, 0), chain(n), [StageCosts(1.0, 2.0)] * n)
    zb = simulate(make_schedule("zb-h1", chain(n), m, 0), chain(n), [StageCosts(1.0, 2.0)] * n)
    inter_layout = chain(2 * n, n)
    inter = simulate(make_schedule("interleaved-1f1b", inter_layout, m, 0), inter_layout, [StageCosts(0.5, 1.0)] * (2 * n))
    assert zb.timeline.makespan < one_f_one_b.timeline.makespan
    assert inter.timeline.makespan < one_f_one_b.timeline.makespan
    assert max(zb.timeline.most_alive().values()) <= n  # ZB-H1 holds no more than 1F1B's first stage


def test_a_schedule_may_split_some_backwards_and_not_others() -> None:
    """The checker takes each backward as the schedule lists it: B, or I and W."""
    layout = chain(2)
    F_, B_, I_, W_ = FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD
    w0 = [Action(F_, 0, 0), Action(F_, 0, 1), Action(B_, 0, 0), Action(I_, 0, 1), Action(W_, 0, 1)]
    w1 = [Action(F_, 1, 0), Action(I_, 1, 0), Action(F_, 1, 1), Action(B_, 1, 1), Action(W_, 1, 0)]
    mixed = Schedule("mixed", (tuple(w0), tuple(w1)), 2)
    assert mixed.split == {(0, 1), (1, 0)}
    check(mixed, layout, 0)
    assert simulate(mixed, layout, [StageCosts(1.0, 2.0)] * 2).timeline.makespan == pytest.approx(8.0)
    without_w = Schedule("mixed", (tuple(w0[:-1]), tuple(w1)), 2)
    with pytest.raises(ScheduleError, match="missing: W1@0"):
        check(without_w, layout, 0)
    both = Schedule("mixed", (tuple(w0), (*w1, Action(B_, 1, 0))), 2)
    with pytest.raises(ScheduleError, match="not part of this step: B0@1"):
        check(both, layout, 0)


def test_the_simulator_counts_transfers_and_held_bytes() -> None:
    layout = chain(2)
    costs = [StageCosts(1.0, 2.0, activation_bytes=10.0)] * 2
    free = simulate(make_schedule("gpipe", layout, 4, 0), layout, costs)
    slow = simulate(make_schedule("gpipe", layout, 4, 0), layout, costs, transfer={(0, 1): 0.5})
    assert slow.timeline.makespan == pytest.approx(free.timeline.makespan + 2 * 0.5)  # there and back
    assert free.peak_bytes == {0: 40.0, 1: 40.0}
    one_f = simulate(make_schedule("1f1b", layout, 4, 0), layout, costs)
    assert one_f.peak_bytes == {0: 20.0, 1: 10.0}


@pytest.mark.parametrize("name", SCHEDULES)
def test_the_executor_runs_exactly_the_checked_lists(name: str) -> None:
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    kwargs: dict[str, Any] = dict(stages_per_device=2) if name == "interleaved-1f1b" else {}
    devices = ["cpu"] * (2 if name == "interleaved-1f1b" else 4)
    pipe = compile_pipeline(FanOut().double(), x, devices, chunks=4, schedule=name, **kwargs)
    pipe.train_step(x, target=y, loss_fn=F.mse_loss)
    schedule = pipe.schedule()
    timeline = pipe.timeline()
    for rank, acts in enumerate(schedule.actions):
        assert timeline.order(rank) == [(a.kind, a.stage, a.micro_batch) for a in acts]


@pytest.mark.parametrize("stages,chunks", [(2, 4), (3, 6), (4, 4), (4, 8)])
def test_1f1b_holds_at_most_n_minus_j_micro_batches_at_stage_j_and_gpipe_all(stages: int, chunks: int) -> None:
    x, y = torch.randn(16, 6, dtype=torch.float64), torch.randn(16, 6, dtype=torch.float64)
    for name, expected in (("1f1b", [min(stages - j, chunks) for j in range(stages)]), ("gpipe", [chunks] * stages)):
        pipe = compile_pipeline(FanOut().double(), x, ["cpu"] * stages, chunks=chunks, checkpoint="never", schedule=name)
        pipe.train_step(x, target=y, loss_fn=F.mse_loss)
        assert pipe.last_most_alive == expected, name
        assert pipe.timeline().most_alive() == dict(enumerate(expected)), name


def test_an_interleaved_trace_has_a_track_per_stage_under_its_worker() -> None:
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(FanOut().double(), x, ["cpu"] * 2, chunks=4, schedule="interleaved-1f1b", stages_per_device=2)
    pipe.train_step(x, target=y, loss_fn=F.mse_loss)
    trace = json.loads(pipe.timeline().to_chrome_trace())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {(e["pid"], e["tid"]) for e in events} == {(0, 0), (1, 1), (0, 2), (1, 3)}
    workers = sorted({e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"})
    assert workers == ["worker 0", "worker 1"]
    # The Gantt chart's rows name the stages each worker ran (before: 'worker 0 · level 0', the
    # level of its first stage alone).
    svg = pipe.timeline().to_svg()
    assert "worker 0 · stages 0, 2" in svg and "worker 1 · stages 1, 3" in svg and "level" not in svg


def test_timelines_write_chrome_traces_and_gantt_charts(tmp_path: Any) -> None:
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(FanOut().double(), x, ["cpu"] * 3, chunks=4, schedule="zb-h1")
    pipe.train_step(x, target=y, loss_fn=F.mse_loss)
    timeline = pipe.timeline()
    trace = json.loads(timeline.to_chrome_trace(str(tmp_path / "trace.json")))
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == sum(len(acts) for acts in pipe.schedule().actions)
    assert {(e["pid"], e["tid"]) for e in events} == {(0, 0), (1, 1), (2, 2)}  # a track per stage
    tracks = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"]
    assert tracks == ["stage 0", "stage 1", "stage 2"]
    assert json.loads((tmp_path / "trace.json").read_text()) == trace
    svg = timeline.to_svg(str(tmp_path / "gantt.svg"), predicted=pipe.plan.prediction().timeline)
    root = ET.fromstring(svg)
    rects = root.findall("{http://www.w3.org/2000/svg}rect")
    assert len(rects) == 2 * len(events)  # measured and predicted, one box per action
    assert "predicted" in svg and "bubble" in svg


class _Cats(nn.Module):
    """A small U-Net of Linear layers: its decoder's backward is mostly on its inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.e1, self.e2, self.e3, self.mid = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.d3, self.d2, self.d1, self.out = nn.Linear(16, 8), nn.Linear(16, 8), nn.Linear(16, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.e1(x).tanh()
        b = self.e2(a).tanh()
        c = self.e3(b).tanh()
        m = self.mid(c).tanh()
        u = self.d3(torch.cat([m, c], -1)).tanh()
        u = self.d2(torch.cat([u, b], -1)).tanh()
        return self.out(self.d1(torch.cat([u, a], -1)).tanh())


def test_the_summary_says_where_zb_h1_keeps_1f1b_s_order() -> None:
    """zb-h1 keeps 1F1B's order where its split backward finishes no sooner on the plan's times.
    Before, the summary said schedule='zb-h1' with no word of it, and the timeline had no I or W."""
    x = torch.randn(10, 8, dtype=torch.float64)
    kept = compile_pipeline(_Cats().double(), x, ["cpu"] * 2, chunks=8, schedule="zb-h1")
    split = compile_pipeline(FanOut().double(), torch.randn(8, 6, dtype=torch.float64), ["cpu"] * 3, chunks=4, schedule="zb-h1")
    for pipe, keeps in ((kept, True), (split, False)):
        kinds = {r.kind for r in pipe.plan.prediction().timeline.records}
        assert ("I" not in kinds) == keeps, kinds
        assert ("zb-h1 keeps 1F1B's order here" in pipe.plan.summary()) == keeps
    kept.train_step(x, target=torch.randn(10, 4, dtype=torch.float64), loss_fn=F.mse_loss)
    assert "I" not in {r.kind for r in kept.timeline().records}  # what the summary said ran


def test_the_plan_summary_reports_the_schedule_prediction() -> None:
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(FanOut().double(), x, ["cpu"] * 4, chunks=8, schedule="1f1b", checkpoint="never")
    summary = pipe.plan.summary()
    prediction = pipe.plan.prediction()
    assert "schedule='1f1b'" in summary
    assert f"bubble {prediction.timeline.bubble():.0%}" in summary
    gpipe = pipe.plan.prediction("gpipe")
    assert prediction.peak_bytes[0] < gpipe.peak_bytes[0]  # 1F1B holds 4 micro-batches at stage 0, GPipe 8


def test_a_prediction_says_where_its_times_come_from(tmp_path: Any) -> None:
    """From FLOPs at an assumed rate unless the plan measured them: a chart drew 537 ms
    predicted above 369 measured with no word of why."""
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    by_flops = compile_pipeline(FanOut().double(), x, ["cpu"] * 2, chunks=4, flop_rate=2e9)
    measured = compile_pipeline(FanOut().double(), x, ["cpu"] * 2, chunks=4, balance="time")
    assert by_flops.plan.times == "from FLOPs at an assumed 2e+09 FLOP/s; balance='time' measures them"
    assert measured.plan.times == "from measured times"
    for pipe in (by_flops, measured):
        assert f"predicted ({pipe.plan.times}): " in pipe.plan.summary()
        pipe.train_step(x, target=y, loss_fn=F.mse_loss)
        svg = pipe.timeline().to_svg(predicted=pipe.plan.prediction().timeline, predicted_title=f"predicted {pipe.plan.times}")
        assert f"predicted {pipe.plan.times}: " in html.unescape(svg)


def test_on_cpu_devices_no_device_peak_is_reported_and_stage_peaks_are() -> None:
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(FanOut().double(), x, ["cpu"] * 2, chunks=4, schedule="1f1b")
    pipe.measure_memory = True
    pipe.train_step(x, target=y, loss_fn=F.mse_loss)
    timeline = pipe.timeline()
    assert timeline.device_peak_bytes == {}
    assert set(timeline.peak_bytes) == {0, 1} and all(b > 0 for b in timeline.peak_bytes.values())


class _Checkpointed(torch.nn.Module):
    """Blocks run under torch.utils.checkpoint(use_reentrant=True) inside the model's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(6, 6)  # a reentrant checkpoint's input must require grad
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        for block in self.blocks:
            x = torch.tanh(torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True))
        return x


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")  # compiling runs it under no_grad
def test_zero_bubble_names_the_fix_for_a_reentrant_checkpoint_in_the_model() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    model = _Checkpointed().double()
    reference = copy.deepcopy(model)
    F.mse_loss(reference(x), y).backward()
    pipe = compile_pipeline(copy.deepcopy(model), x, ["cpu", "cpu"], chunks=2, schedule="1f1b")
    pipe.train_step(x, target=y, loss_fn=F.mse_loss)
    assert_grads_equal(pipe, reference)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2, schedule="zb-h1")
    with pytest.raises(StageError, match=r"(?s)use_reentrant=True.*torch.utils.checkpoint\(\.\.\., use_reentrant=False\), or another schedule"):
        pipe.train_step(x, target=y, loss_fn=F.mse_loss)
