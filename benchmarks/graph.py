"""Chain against DAG on the same devices: step time and peak activation memory, measured and predicted.

Multi-branch models (examples/branches.py, and the four towers of issue 33) cut three ways:
stage_graph='chain' (one linear order), 'dag' (branches in stages of their own, side by side)
and 'auto' (whichever the plan predicts faster); the four towers also by hand, each tower
marked into a stage of its own (`pipe_split()`), the depth-2 DAG the search should find.

Emulated kernels: each layer of a model is a small Linear and a kernel that sleeps
`ms` per micro-batch of the batch's rows (forward; backward twice that), so that five stages
can be timed honestly on two cores, a sleep leaving the core to the other workers as a kernel
on its own device would. Every pipeline is cut with balance='time' and runs `train_step` under
`--schedule`; the step time is the median of `--repeats` steps, and the peak activation bytes
are the most any stage held in one more step with `measure_memory` on, beside the plan's
prediction of both. Real kernels: the example models themselves, on as many stages as there are
cores, where no sleep is needed.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from emulated import Sleep
from environment import command_lines, ensure_malloc_env
from tables import print_markdown

ROOT = Path(__file__).resolve().parent.parent
TOWERS_AUTO_VS_DAG = 1.10  # targets on the four towers: 'auto' within 1.1x of the depth-2 DAG ...
TOWERS_AUTO_VS_CHAIN = 0.75  # ... and at most 0.75x of the best chain


class _SleepPerRow(Sleep):
    """`Sleep` for `seconds_per_row` times the rows it gets."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds_per_row: float) -> torch.Tensor:  # type: ignore[override]
        return Sleep.forward(ctx, x, seconds_per_row * x.shape[0])


class Kernel(nn.Module):
    """A layer: a small Linear, then `ms` of sleep per micro-batch of `rows` rows."""

    def __init__(self, ms: float, rows: int) -> None:
        super().__init__()
        self.linear, self.per_row = nn.Linear(8, 8), ms / 1e3 / rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SleepPerRow.apply(torch.tanh(self.linear(x)), self.per_row)


def _tower(costs: Sequence[float], rows: int) -> nn.Sequential:
    return nn.Sequential(*[Kernel(ms, rows) for ms in costs])


class Towers(nn.Module):
    """Issue 33's model: four towers of 10 ms forward each, summed as `sum(...)` writes it, a head."""

    def __init__(self, rows: int, marked: bool = False) -> None:
        super().__init__()
        self.towers = nn.ModuleList(_tower([5.0, 5.0], rows) for _ in range(4))
        self.head, self.marked = Kernel(1.0, rows), marked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from fxpipe import pipe_split

        outs = []
        for tower in self.towers:
            outs.append(tower(x))
            if self.marked:
                pipe_split()
        return self.head(sum(outs))


class Encoders(nn.Module):
    """A multi-modal model: three encoders of unequal cost on their own inputs, a fusion head."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.encoders = nn.ModuleList(_tower([ms] * 4, rows) for ms in (3.0, 2.0, 4.0))
        self.fuse = nn.Sequential(nn.Linear(24, 8), Kernel(2.0, rows))

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return self.fuse(torch.cat([enc(x) for enc, x in zip(self.encoders, (a, b, c))], dim=1))


class Recommender(nn.Module):
    """A DLRM: a bottom MLP, eight embedding lookups of 1.5 ms, their pairwise interaction, a top MLP."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.bottom = _tower([2.0] * 3, rows)
        self.bags = nn.ModuleList(_tower([1.5], rows) for _ in range(8))
        self.top = nn.Sequential(nn.Linear(9 * 9, 8), _tower([2.0] * 3, rows))

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        vectors = torch.stack([x] + [bag(dense) for bag in self.bags], dim=1)
        return self.top(torch.bmm(vectors, vectors.transpose(1, 2)).flatten(1))


class DrugResponse(nn.Module):
    """A CANDLE-Uno: feature towers of 12, 12 and 6 ms, concatenated, two residual blocks."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.towers = nn.ModuleList(_tower([ms] * 3, rows) for ms in (4.0, 4.0, 2.0))
        self.merge = nn.Linear(24, 8)
        self.blocks = nn.ModuleList(_tower([1.5, 1.5], rows) for _ in range(2))

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        h = self.merge(torch.cat([tower(x) for tower, x in zip(self.towers, (a, b, c))], dim=1))
        for block in self.blocks:
            h = h + block(h)
        return h


# name -> (the model for micro-batches of `rows` rows, its inputs for a batch, devices)
EMULATED: dict[str, tuple[Callable[[int], nn.Module], int, int]] = {
    "four towers": (Towers, 1, 5),
    "multi-modal": (Encoders, 3, 4),
    "DLRM": (Recommender, 1, 5),
    "CANDLE-Uno": (DrugResponse, 3, 4),
}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--rows", type=int, default=2, help="rows per micro-batch")
    p.add_argument("--schedule", default="gpipe")
    p.add_argument("--repeats", type=int, default=7, help="timed steps per pipeline (the median is reported)")
    p.add_argument("--models", default=",".join(EMULATED), help=f"emulated models to run, comma-separated, of: {', '.join(EMULATED)}")
    p.add_argument("--real", action="store_true", help="also the example models on real kernels, one stage per core")
    return p.parse_args(argv)


def measure(pipe: Any, inputs: tuple[torch.Tensor, ...], target: torch.Tensor, repeats: int) -> tuple[float, float]:
    """The median step time of `train_step`, and the most activation bytes one stage held."""
    for _ in range(2):
        pipe.train_step(*inputs, target=target, loss_fn=F.mse_loss)
    steps = []
    for _ in range(repeats):
        start = time.perf_counter()
        pipe.train_step(*inputs, target=target, loss_fn=F.mse_loss)
        steps.append(time.perf_counter() - start)
    pipe.measure_memory = True
    pipe.train_step(*inputs, target=target, loss_fn=F.mse_loss)
    pipe.measure_memory = False
    return statistics.median(steps), float(max(pipe.timeline().peak_bytes.values(), default=0))


def row(name: str, how: str, pipe: Any, inputs: tuple[torch.Tensor, ...], target: torch.Tensor, repeats: int) -> tuple[list[str], float]:
    measured, peak = measure(pipe, inputs, target, repeats)
    prediction = pipe.plan.prediction()
    predicted_peak = max(prediction.peak_bytes.values(), default=0.0)
    # A cut by hand is not timed at compile: its prediction would be from FLOPs, which sleeps have none of.
    predicted = f"{prediction.timeline.makespan * 1e3:.1f}" if "measured" in pipe.plan.times else "(not timed)"
    cells = [
        name, how, f"{pipe.plan.depth} of {len(pipe.plan.stages)}", f"{measured * 1e3:.1f}", predicted,
        f"{peak / 1024:.1f}", f"{predicted_peak / 1024:.1f}",
    ]  # fmt: skip
    pipe.close()
    return cells, measured


def emulated_rows(name: str, args: argparse.Namespace) -> list[list[str]]:
    from fxpipe import compile_pipeline

    make, inputs, devices = EMULATED[name]
    torch.manual_seed(0)
    model = make(args.rows)
    batch = args.rows * args.chunks
    xs = tuple(torch.randn(batch, 8) for _ in range(inputs))
    target = model(*xs).detach()
    ways: list[tuple[str, nn.Module, dict[str, Any]]] = [(sg, copy.deepcopy(model), dict(stage_graph=sg)) for sg in ("chain", "dag", "auto")]
    if name == "four towers":
        marked = Towers(args.rows, marked=True)
        marked.load_state_dict(model.state_dict())
        ways.append(("by hand, a tower per stage", marked, {}))
    rows, times = [], {}
    for how, m, options in ways:
        balance = "time" if options else None  # the marks are the cut
        pipe = compile_pipeline(m, xs, ["cpu"] * devices, chunks=args.chunks, balance=balance, schedule=args.schedule, checkpoint="never", **options)
        cells, times[how] = row(name, how, pipe, xs, target, args.repeats)
        rows.append(cells)
    for cells in rows:
        cells.append(f"{times[cells[1]] / times['chain']:.2f}")
    if name == "four towers":
        ratio = times["auto"] / times["by hand, a tower per stage"]
        print(f"four towers: auto / by hand {ratio:.2f} (target <= {TOWERS_AUTO_VS_DAG}), "
              f"auto / chain {times['auto'] / times['chain']:.2f} (target <= {TOWERS_AUTO_VS_CHAIN})")  # fmt: skip
    return rows


def real_rows(args: argparse.Namespace) -> list[list[str]]:
    from fxpipe import compile_pipeline

    sys.path.insert(0, str(ROOT / "examples"))
    from branches import MODELS

    cores = len(os.sched_getaffinity(0))
    rows = []
    for name, kind in MODELS.items():
        torch.manual_seed(0)
        model = kind()
        xs = kind.example(16 * args.chunks)
        target = model(*xs).detach()
        times = {}
        for sg in ("chain", "dag", "auto"):
            pipe = compile_pipeline(copy.deepcopy(model), xs, ["cpu"] * cores, chunks=args.chunks, balance="time", schedule=args.schedule, stage_graph=sg)
            cells, times[sg] = row(f"{name} (real kernels)", sg, pipe, xs, target, args.repeats)
            rows.append(cells + [f"{times[sg] / times['chain']:.2f}"])
    return rows


HEADER = ["model", "stage graph", "depth of stages", "measured ms", "predicted ms", "peak act. KiB", "predicted KiB", "step / chain"]


def main(argv: Optional[Sequence[str]] = None) -> None:
    reexecuted = ensure_malloc_env()
    args = parse_args(argv)
    torch.set_num_threads(1)
    for line in command_lines(reexecuted, "steady allocator"):
        print(line)
    print(f"torch {torch.__version__}; schedule {args.schedule!r}; {args.chunks} micro-batches of {args.rows} rows; "
          "backward kernel = 2 x forward; balance='time', checkpoint='never'\n")  # fmt: skip
    rows = [r for name in args.models.split(",") for r in emulated_rows(name, args)]
    if args.real:
        rows += real_rows(args)
    print()
    print_markdown(HEADER, rows)


if __name__ == "__main__":
    main()
