"""Schedules at scale on emulated kernels: how close a step comes to its schedule's ideal.

Each stage is one kernel that sleeps (a custom autograd Function: forward k ms, backward 2k ms
per micro-batch, whatever its rows), so that 8 stages can be timed honestly on 2 cores: a sleep
leaves the core to the other workers, as a kernel on its own device would. Two ideals, each the
plan's simulator run on given costs, efficiency = ideal / measured step time:
- on the kernels' nominal times (k ms forward, 2k backward, nothing else);
- on the plain model's own times: the unpipelined model run micro-batch by micro-batch in this
  process, forward, loss and backward timed apart, shared evenly among the stages (the loss goes
  to the last stage's forward, where the pipeline computes it). On this machine a kernel's small
  Linear, its autograd calls and the loss cost the plain model 0.2-0.8 ms per micro-batch beyond
  its sleeps: no pipeline can run faster than its stages do alone;
and, beside the second, the plain model's CPU time for the batch: the workers' Python shares one
interpreter lock, so one process cannot step in less (at 8 stages and 1 ms on a slow machine it
is above the schedule's ideal). The last column measures against the larger of the two: what
is left is fxpipe's own cost per task (thread hand-offs, bookkeeping, the autograd calls).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from environment import command_lines, ensure_malloc_env
from fxpipe.schedules.simulate import StageCosts
from tables import print_markdown


class Sleep(torch.autograd.Function):
    """An emulated kernel: forward sleeps `seconds`, backward twice that; the values pass through."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:  # type: ignore[override]
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        time.sleep(2 * ctx.seconds)
        return grad, None


class Kernel(nn.Module):
    """A stage's work: a small Linear (the stage has a weight, as real ones do) and a kernel of
    fixed cost."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.linear, self.seconds = nn.Linear(8, 8), seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Sleep.apply(self.linear(x), self.seconds)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--kernels-ms", default="4,1,0.5", help="forward kernel times to run, ms (backward is twice)")
    p.add_argument("--stages", default="2,8", help="stage counts to run")
    p.add_argument("--chunks", type=int, default=32)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--repeats", type=int, default=7, help="timed steps per row (the median is reported)")
    p.add_argument("--balance", default="counts", choices=("counts", "time"),
                   help="'counts': a kernel per stage by node counts; 'time': measured at compile, which zb-h1 orders by")  # fmt: skip
    return p.parse_args(argv)


def ideal_seconds(pipe: Any, costs: list[StageCosts]) -> float:
    """The schedule's step on the given per-micro-batch stage costs: the plan's simulator, nothing else."""
    return float(pipe.plan.simulate(costs).timeline.makespan)


def plain_costs(model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunks: int, stages: int) -> tuple[list[StageCosts], float]:
    """Per stage, the seconds per micro-batch that the plain model spends on it: the model run on
    each micro-batch in turn (medians over three passes), forward and backward shared evenly among
    the stages, the loss's forward added to the last one; and the CPU seconds of one such pass
    (the least of the three)."""
    forward, loss, backward, cpu = [], [], [], []
    for _ in range(3):
        cpu_start = time.process_time()
        for xi, yi in zip(x.chunk(chunks), y.chunk(chunks)):
            t0 = time.perf_counter()
            out = model(xi)
            t1 = time.perf_counter()
            value = F.mse_loss(out, yi)
            t2 = time.perf_counter()
            value.backward()
            t3 = time.perf_counter()
            forward.append(t1 - t0)
            loss.append(t2 - t1)
            backward.append(t3 - t2)
        cpu.append(time.process_time() - cpu_start)
    f, b = statistics.median(forward) / stages, statistics.median(backward) / stages
    return [StageCosts(f, b) for _ in range(stages - 1)] + [StageCosts(f + statistics.median(loss), b)], min(cpu)


def row(stages: int, forward: float, args: argparse.Namespace) -> list[str]:
    from fxpipe import compile_pipeline

    model = nn.Sequential(*[Kernel(forward) for _ in range(stages)])
    x, y = torch.randn(args.chunks * 2, 8), torch.randn(args.chunks * 2, 8)
    pipe = compile_pipeline(
        model, x, ["cpu"] * stages, chunks=args.chunks, schedule=args.schedule, checkpoint="never",
        balance=[2] * stages if args.balance == "counts" else "time",
    )  # fmt: skip
    for _ in range(2):
        pipe.train_step(x, target=y, loss_fn=F.mse_loss)
    steps = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        pipe.train_step(x, target=y, loss_fn=F.mse_loss)
        steps.append(time.perf_counter() - start)
    measured = statistics.median(steps)
    nominal = ideal_seconds(pipe, [StageCosts(forward, 2 * forward)] * stages)
    costs, cpu = plain_costs(model, x, y, args.chunks, stages)
    plain = ideal_seconds(pipe, costs)
    # The workers' Python runs under one interpreter lock: one process cannot step faster than
    # the plain model's own CPU time for the batch, whatever the schedule overlaps.
    bound = max(plain, cpu)
    return [
        f"{stages} x {args.chunks}", f"{forward * 1e3:g} ms", f"{measured * 1e3:.1f}",
        f"{nominal * 1e3:.1f}", f"{nominal / measured:.3f}", f"{plain * 1e3:.1f}", f"{cpu * 1e3:.1f}",
        f"{bound / measured:.3f}",
    ]  # fmt: skip


HEADER = [
    "stages x micro-batches", "forward kernel", "measured ms", "ideal on kernels, ms", "efficiency",
    "ideal on the plain model, ms", "plain model's CPU, ms", "efficiency against the larger",
]  # fmt: skip


def main(argv: Optional[Sequence[str]] = None) -> None:
    reexecuted = ensure_malloc_env()
    args = parse_args(argv)
    torch.set_num_threads(1)
    for line in command_lines(reexecuted, "steady allocator"):
        print(line)
    print(f"torch {torch.__version__}; schedule {args.schedule!r}; balance {args.balance!r}; backward kernel = 2 x forward; "
          "efficiency = ideal / measured\n")  # fmt: skip
    rows = [row(int(s), float(k) / 1e3, args) for s in args.stages.split(",") for k in args.kernels_ms.split(",")]
    print_markdown(HEADER, rows)


if __name__ == "__main__":
    main()
