"""The clock-cycle schedule, the order tasks really run in, and what checkpointing recomputes."""
from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from helpers import FanOut
from fxpipe import compile_pipeline, is_checkpointing, is_recomputing
from fxpipe.schedules.actions import clock_cycles


def test_clock_cycles_exact() -> None:
    assert list(clock_cycles(3, 3)) == [
        [(0, 0)],
        [(1, 0), (0, 1)],
        [(2, 0), (1, 1), (0, 2)],
        [(2, 1), (1, 2)],
        [(2, 2)],
    ]
    assert list(clock_cycles(4, 2)) == [[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(3, 0), (2, 1)], [(3, 1)]]
    assert list(clock_cycles(1, 3)) == [[(0, 0)], [(0, 1)], [(0, 2)]]
    assert list(clock_cycles(2, 1)) == [[(0, 0)], [(1, 0)]]


@pytest.mark.parametrize("m,n", [(m, n) for m in range(1, 7) for n in range(1, 6)])
def test_clock_cycles_cover_every_pair_once_at_tick_i_plus_j(m: int, n: int) -> None:
    ticks = list(clock_cycles(m, n))
    assert len(ticks) == m + n - 1
    seen = [(i, j, t) for t, tick in enumerate(ticks) for i, j in tick]
    assert sorted((i, j) for i, j, _ in seen) == [(i, j) for i in range(m) for j in range(n)]
    assert all(t == i + j for i, j, t in seen)


def test_runtime_follows_the_schedule() -> None:
    model = FanOut().double()
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 4, chunks=4, checkpoint="except_last")
    pipe(x).sum().backward()
    records = pipe.timeline().records
    forward = {(r.micro_batch, r.stage): (r.start, r.end) for r in records if r.kind == "F"}
    backward = {(r.micro_batch, r.stage): (r.start, r.end) for r in records if r.kind == "B"}
    assert set(forward) == set(backward) == {(i, j) for i in range(4) for j in range(4)}
    for j in range(4):
        starts = [forward[(i, j)][0] for i in range(4)]
        assert starts == sorted(starts), f"stage {j} ran its forward micro-batches out of order"
        starts = [backward[(i, j)][0] for i in range(4)]
        assert starts == sorted(starts, reverse=True), f"stage {j} ran backward micro-batches out of order"
    for i in range(4):
        for j in range(1, 4):
            assert forward[(i, j)][0] >= forward[(i, j - 1)][1], "a stage started before its input was made"
    assert min(s for s, _ in backward.values()) >= max(e for _, e in forward.values())


class Recorder(nn.Module):
    """Records, per call, whether it ran as a checkpointed forward or a recompute."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.calls: list[tuple[bool, bool]] = []
        self.lock = threading.Lock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.lock:
            self.calls.append((is_checkpointing(), is_recomputing()))
        return self.linear(x)


class TwoRecorders(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = Recorder(), Recorder()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("mode,checkpointed", [("always", 4), ("except_last", 3), ("never", 0)])
def test_checkpoint_modes_count_recomputes(mode: str, checkpointed: int) -> None:
    model = TwoRecorders()
    x = torch.randn(8, 4)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=4, checkpoint=mode, leaf_modules=[Recorder])
    for recorder in (model.a, model.b):
        recorder.calls.clear()
    pipe(x).sum().backward()
    for recorder in (model.a, model.b):
        assert recorder.calls.count((True, False)) == checkpointed
        assert recorder.calls.count((False, True)) == checkpointed
        assert recorder.calls.count((False, False)) == 4 - checkpointed
        assert (True, True) not in recorder.calls
    assert not is_checkpointing() and not is_recomputing()


@pytest.mark.parametrize("context", ["eval", "no_grad"])
def test_eval_and_no_grad_checkpoint_nothing(context: str) -> None:
    model = TwoRecorders()
    x = torch.randn(8, 4)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=4, checkpoint="always", leaf_modules=[Recorder])
    model.a.calls.clear()
    if context == "eval":
        pipe.eval()
        out = pipe(x)
        out.sum().backward()  # eval keeps autograd working, it only stops checkpointing
    else:
        with torch.no_grad():
            out = pipe(x)
        assert not out.requires_grad
    assert model.a.calls == [(False, False)] * 4


class Tagger(nn.Module):
    """Records, per call, which micro-batch it saw (by the tag in column 0) and in which pass."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.calls: list[tuple[int, bool, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append((int(x[0, 0]), is_checkpointing(), is_recomputing()))
        return self.linear(x)


@pytest.mark.parametrize("mode,checkpointed", [("always", {0, 1, 2, 3}), ("except_last", {0, 1, 2}), ("never", set())])
def test_the_first_micro_batches_are_checkpointed_by_index(mode: str, checkpointed: set[int]) -> None:
    """'except_last' checkpoints micro-batches 0..m-2 and keeps the last: its backward comes
    first, so keeping another one instead would hold memory for longer and save nothing."""
    linear, tagger = nn.Linear(4, 4), Tagger()
    model = nn.Sequential(linear, tagger)
    x = torch.randn(10, 4)
    x[:, 0] = torch.cat([torch.full((len(p),), float(i)) for i, p in enumerate(torch.tensor_split(x, 4))])
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=4, checkpoint=mode, leaf_modules=[Tagger], balance=[1, 1])
    linear.weight.data = torch.eye(4)
    linear.bias.data.zero_()
    tagger.calls.clear()
    pipe(x).sum().backward()
    forward = {i for i, saving, recomputing in tagger.calls if saving}
    recomputed = {i for i, saving, recomputing in tagger.calls if recomputing}
    assert forward == recomputed == checkpointed
    assert {i for i, saving, recomputing in tagger.calls if not saving and not recomputing} == {0, 1, 2, 3} - checkpointed
