"""Schedules at scale on emulated kernels: how close a step comes to its schedule's ideal.

Each stage is one kernel that sleeps (a custom autograd Function: forward k ms, backward 2k ms
per micro-batch, whatever its rows), so that 8 stages can be timed honestly on 2 cores: a sleep
leaves the core to the other workers, as a kernel on its own device would. The ideal is the
plan's simulator run on those exact costs; efficiency = ideal / measured step time. What is
left is fxpipe's cost per task (thread hand-offs, bookkeeping, the autograd calls) on the
critical path, and the workers' Python sharing one interpreter lock.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from environment import command_lines, ensure_malloc_env
from tables import print_markdown


class _Kernel(torch.autograd.Function):
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
        return _Kernel.apply(self.linear(x), self.seconds)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--kernels-ms", default="4,1,0.5", help="forward kernel times to run, ms (backward is twice)")
    p.add_argument("--stages", default="2,8", help="stage counts to run")
    p.add_argument("--chunks", type=int, default=32)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--repeats", type=int, default=7, help="timed steps per row (the median is reported)")
    return p.parse_args(argv)


def ideal_seconds(pipe: Any, forward: float, chunks: int) -> float:
    """The schedule's step on exact kernel times: the plan's simulator, nothing else."""
    plan = copy.deepcopy(pipe.plan)
    for stage in plan.stages:
        stage.time, stage.forward_share = 3 * forward * chunks, 1 / 3
    return float(plan.prediction().timeline.makespan)


def row(stages: int, forward: float, args: argparse.Namespace) -> list[str]:
    from fxpipe import compile_pipeline

    model = nn.Sequential(*[Kernel(forward) for _ in range(stages)])
    x, y = torch.randn(args.chunks * 2, 8), torch.randn(args.chunks * 2, 8)
    pipe = compile_pipeline(
        model, x, ["cpu"] * stages, chunks=args.chunks, schedule=args.schedule, checkpoint="never",
        balance=[2] * stages,
    )  # fmt: skip
    for _ in range(2):
        pipe.train_step(x, target=y, loss_fn=F.mse_loss)
    steps = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        pipe.train_step(x, target=y, loss_fn=F.mse_loss)
        steps.append(time.perf_counter() - start)
    measured, ideal = statistics.median(steps), ideal_seconds(pipe, forward, args.chunks)
    tasks = 2 * stages * args.chunks
    beyond = (measured - ideal) / (2 * args.chunks + 2 * (stages - 1)) * 1e6  # per critical-path task
    return [
        f"{stages} x {args.chunks}", f"{forward * 1e3:g} ms", f"{ideal * 1e3:.1f}", f"{measured * 1e3:.1f}",
        f"{ideal / measured:.3f}", f"{beyond:.0f}", str(tasks),
    ]  # fmt: skip


HEADER = ["stages x micro-batches", "forward kernel", "ideal ms", "measured ms", "efficiency", "us beyond, per critical task", "tasks"]


def main(argv: Optional[Sequence[str]] = None) -> None:
    reexecuted = ensure_malloc_env()
    args = parse_args(argv)
    torch.set_num_threads(1)
    for line in command_lines(reexecuted, "steady allocator"):
        print(line)
    print(f"torch {torch.__version__}; schedule {args.schedule!r}; backward kernel = 2 x forward; efficiency = ideal / measured\n")
    rows = [row(int(s), float(k) / 1e3, args) for s in args.stages.split(",") for k in args.kernels_ms.split(",")]
    print_markdown(HEADER, rows)


if __name__ == "__main__":
    main()
