"""The bound no schedule beats: each stage's work for a step, in plain PyTorch, waiting for nothing.

A step of a two-stage pipeline on a Sequential model cut at `cut` is, per micro-batch, the first
half's forward and backward and the second half's forward, loss and backward. Run both halves'
work at once (two threads, or two processes), each on inputs made beforehand, and the time is
what the machine needs for the step's arithmetic with its cores shared, its kernels at
micro-batch size, and nothing else: no bubble, no transfers, no schedule. E measured against it
says how much of what is left a schedule could still win.
"""
from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn

Step = Callable[[], None]


def stage_work(
    model: nn.Sequential, cut: int, x: torch.Tensor, y: torch.Tensor, chunks: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[Step, Step]:  # fmt: skip
    """The step's work of the stage before `cut` and of the stage from it, on copies of the
    model's layers: gradients accumulate over the micro-batches as the pipeline's do (a mean
    loss weighted by each micro-batch's share of the batch)."""
    return stage_work_on(copy.deepcopy(model[:cut]), copy.deepcopy(model[cut:]), x, y, chunks, loss_fn)


def stage_work_on(
    first: nn.Module, second: nn.Module, x: torch.Tensor, y: torch.Tensor, chunks: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[Step, Step]:  # fmt: skip
    """`stage_work` on the two stages' layers given (an optimizer may step them between steps)."""
    xs, ys = x.chunk(chunks), y.chunk(chunks)
    with torch.no_grad():
        middles = [first(xc) for xc in xs]  # the second stage's inputs, never waited for
    grads = [torch.randn_like(m) for m in middles]  # the first stage's output gradients

    def work_first() -> None:
        for p in first.parameters():
            p.grad = None
        for xc, grad in zip(xs, grads):
            first(xc).backward(grad)

    def work_second() -> None:
        for p in second.parameters():
            p.grad = None
        for middle, yc in zip(middles, ys):
            middle = middle.detach().requires_grad_()  # its gradient is the stage's to send
            (loss_fn(second(middle), yc) * (len(yc) / len(y))).backward()

    return work_first, work_second
