"""The pipeline as autograd sees it: two Functions around a step, so backward runs on the workers.

    inputs ─▶ [_Forward] ─▶ token (CPU, empty) ─▶ [_Outputs] ─▶ outputs ─▶ loss

`loss.backward()` reaches `_Outputs` first, which only stores the output gradients: on CUDA it runs
on the autograd engine's thread for the outputs' device, and must not block it, because the stage
workers' own backward calls need that thread. It hands a CPU gradient to `_Forward`, whose backward
therefore runs on the caller's thread and drives the backward schedule on the stage workers.
Parameter gradients land in `.grad` from the stages' own backward calls.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch.autograd.function import FunctionCtx
from torch.utils._pytree import tree_flatten

from fxpipe.gather import Gathered
from fxpipe.microbatch import gather_grads
from fxpipe.step import Step


class InputSlot:
    """An input tensor that requires grad: which value and leaf it is, and whether it was split."""

    def __init__(self, name: str, index: int, tensor: torch.Tensor, split: bool) -> None:
        self.name, self.index, self.tensor, self.split = name, index, tensor, split


class Run:
    """One call of the pipeline with autograd: its step, the inputs that want gradients, and the
    outputs once gathered."""

    def __init__(
        self,
        step: Step,
        inputs: Sequence[InputSlot],
        gather: Callable[[list[dict[str, Any]]], Gathered],
        finish: Callable[[], None],
    ) -> None:
        self.step, self.inputs, self.gather, self.finish = step, list(inputs), gather, finish
        self.gathered: Optional[Gathered] = None
        self.output_grads: Optional[Sequence[Optional[torch.Tensor]]] = None

    def forward(self) -> None:
        self.gathered = self.gather(self.step.forward())

    def backward(self) -> list[Optional[torch.Tensor]]:
        assert self.gathered is not None
        grads = self.output_grads or [None] * len(self.gathered.slots)
        input_grads = self.step.backward(self.gathered.route(grads))
        self.finish()
        result = []
        for slot in self.inputs:
            parts = [_leaf(g.get(slot.name), slot.index) for g in input_grads]
            pieces = [_leaf(mb[slot.name], slot.index) for mb in self.step.micro_batches]
            grad = gather_grads(parts, pieces, slot.split)
            result.append(grad.to(slot.tensor.device) if grad is not None else None)
        return result


def _leaf(value: Any, index: int) -> Any:
    return None if value is None else tree_flatten(value)[0][index]


class _Forward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, run: Run, phony: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        run.forward()
        ctx.run = run  # type: ignore[attr-defined]
        return phony.new_empty(0)

    @staticmethod
    def backward(ctx: FunctionCtx, token_grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        run: Run = ctx.run  # type: ignore[attr-defined]
        return (None, None, *run.backward())


class _Outputs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, run: Run, token: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        assert run.gathered is not None
        ctx.run = run  # type: ignore[attr-defined]
        ctx.set_materialize_grads(False)
        tensors = run.gathered.tensors
        ctx.mark_non_differentiable(*[t for t in tensors if not (t.is_floating_point() or t.is_complex())])
        return tuple(tensors)

    @staticmethod
    def backward(ctx: FunctionCtx, *grads: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        run: Run = ctx.run  # type: ignore[attr-defined]
        run.output_grads = grads
        return None, torch.zeros(0)


def run_with_autograd(run: Run) -> Any:
    """Run the step inside the two Functions; returns the model's output structure."""
    phony = torch.empty(0, requires_grad=True)
    token = _Forward.apply(run, phony, *[slot.tensor for slot in run.inputs])
    assert run.gathered is not None
    tensors = _Outputs.apply(run, token) if run.gathered.tensors else ()
    return run.gathered.rebuild(tensors)
