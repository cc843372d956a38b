"""The pipeline as autograd sees it: two Functions around a step, so backward runs on the workers.

    inputs, parameters ─▶ [_Forward] ─▶ token (CPU, empty) ─▶ [_Outputs] ─▶ outputs ─▶ loss

`loss.backward()` reaches `_Outputs` first, which only stores the output gradients: on CUDA it runs
on the autograd engine's thread for the outputs' device, and must not block it, because the stage
workers' own backward calls need that thread. It hands a CPU gradient to `_Forward`, whose backward
therefore runs on the caller's thread and drives the backward schedule on the stage workers.
The parameters are inputs of `_Forward`, and their gradients its gradients: autograd routes them
as it would in the plain model, into `.grad` for `loss.backward()`, to the caller for
`torch.autograd.grad`, nowhere for `backward(inputs=[x])`, through the parameters' hooks.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
from torch.autograd.function import FunctionCtx
from torch.utils._pytree import tree_flatten

from fxpipe.core.microbatch import gather_grads, takes_gradients
from fxpipe.core.wording import listed
from fxpipe.runtime.gather import Gathered
from fxpipe.runtime.stage_error import StageError
from fxpipe.runtime.step import Step


class InputSlot:
    """An input tensor that requires grad: which value and leaf it is, and the dim it was split
    along (None: whole, in every micro-batch)."""

    def __init__(self, name: str, index: int, tensor: torch.Tensor, dim: Optional[int]) -> None:
        self.name, self.index, self.tensor, self.dim = name, index, tensor, dim


class Run:
    """One call of the pipeline with autograd: its step, the inputs and parameters that want
    gradients (`pieces`: what the caller's inputs were split into, whose gradients the step
    gives), and the outputs once gathered. `parameter_grads()` gives the step's gradient of each
    parameter, in the order of `parameters`."""

    def __init__(
        self,
        step: Step,
        inputs: Sequence[InputSlot],
        pieces: Sequence[dict[str, Any]],
        parameters: Sequence[torch.Tensor],
        gather: Callable[[list[dict[str, Any]]], Gathered],
        parameter_grads: Callable[[], list[Optional[torch.Tensor]]],
    ) -> None:
        self.step, self.inputs, self.pieces, self.parameters, self.gather = step, list(inputs), pieces, list(parameters), gather
        self.parameter_grads = parameter_grads
        self.differentiable: Callable[[str], bool] = lambda name: True  # by output value
        self.gathered: Optional[Gathered] = None
        self.found: list[tuple[torch.Tensor, int]] = []  # what it read of the caller's, with its version then
        self.output_grads: Optional[Sequence[Optional[torch.Tensor]]] = None
        self.taking: list[int] = []  # the gathered outputs that take gradients
        self.left: tuple[int, int] = (0, 0)  # of those, how many the backward did not reach, of how many
        # What must live as long as the outputs' graph: the pipeline, whose garbage collection
        # stops the workers the backward runs on (as the plain model's graph keeps its weights).
        self.owner: Any = None
        self.alone: ContextManager[Any] = nullcontext()  # held by the backward: one call on the model at a time

    def forward(self) -> None:
        self.gathered = self.gather(self.step.forward())
        # What the backward reads of the caller's, as the forward left it: written in between
        # (optimizer.step() before backward()), autograd's error is told so.
        buffers = [b for stage in self.step.stages for b in getattr(stage, "read_buffers", {}).values()]
        # (An inference tensor has no version to read: none can be written outside inference mode.)
        read = [*self.parameters, *buffers, *tree_flatten(self.pieces)[0]]
        self.found = [(t, t._version) for t in read if isinstance(t, torch.Tensor) and not t.is_inference()]

    def backward(self) -> list[Optional[torch.Tensor]]:
        assert self.gathered is not None
        if torch.is_grad_enabled():
            raise RuntimeError(
                "a Pipeline cannot make its gradients differentiable (backward with create_graph=True, "
                "or torch.autograd.grad(..., create_graph=True), which torch.autograd.functional's jvp, hvp, vhp and "
                "hessian use).\nHow to fix: compute higher-order gradients with the plain model."
            )
        grads = self.output_grads or [None] * len(self.gathered.slots)
        if self.step.backward_done and self.left[0]:
            raise RuntimeError(
                f"backward through this pipeline call ran already, from some of its outputs alone ({self.left[1] - self.left[0]} "
                f"of the {self.left[1]} that take gradients), and freed its saved state: a call runs one backward for all "
                "its outputs, where the plain model may run one per output whose graphs share nothing.\nHow to fix: one "
                "backward for all the losses ((loss1 + loss2).backward(), or torch.autograd.backward([loss1, loss2])), "
                "or run the forward again for the second."
            )
        self.left = (sum(grads[i] is None for i in self.taking), len(self.taking))
        if any(g is not None and _batched(g) for g in grads):
            raise RuntimeError(
                "a Pipeline cannot take batched gradients (torch.autograd.functional.jacobian(..., vectorize=True), "
                "torch.autograd.grad(..., is_grads_batched=True)): its stages run each backward on tensors of their "
                "own, one gradient at a time.\nHow to fix: compute Jacobians with the plain model."
            )
        with self.alone:
            try:
                input_grads = self.step.backward(self.gathered.route(grads))
            except StageError as error:
                self._note_written_since_forward(error)
                raise
        return [*whole_input_grads(self.inputs, self.pieces, input_grads), *self.parameter_grads()]

    def _note_written_since_forward(self, error: StageError) -> None:
        written = list({id(t): t for t, version in self.found if t._version != version}.values())
        if written and "modified by an inplace operation" in str(error):
            shapes = listed((str(tuple(t.shape)) for t in written), most=4)
            error.add_note(
                f"Here, tensors this call read were written in place after its forward (shapes {shapes}): by the caller, "
                "between pipe(x) and backward (optimizer.step() before loss.backward(), an input buffer filled again); "
                "the plain model's backward fails alike there.\nHow to fix: run the backward first (loss.backward(); "
                "optimizer.step()), or pass a copy of an input that is written again (pipe(x.clone()))."
            )


def _batched(grad: torch.Tensor) -> bool:
    """A gradient of autograd's own vmap (`is_grads_batched`, `jacobian(vectorize=True)`)."""
    legacy = getattr(torch._C._functorch, "is_legacy_batchedtensor", None)
    return bool(legacy(grad)) if legacy is not None else "Batched" in str(torch._C._dispatch_keys(grad))


def whole_input_grads(slots: Sequence[InputSlot], micro_batches: Sequence[dict[str, Any]], input_grads: Sequence[dict[str, Any]]) -> list[Optional[torch.Tensor]]:
    """The gradient of each input slot, put together from its micro-batch pieces' gradients."""
    result = []
    for slot in slots:
        parts = [_leaf(g.get(slot.name), slot.index) for g in input_grads]
        pieces = [_leaf(mb[slot.name], slot.index) for mb in micro_batches]
        grad = gather_grads(parts, pieces, slot.dim)
        result.append(grad.to(slot.tensor.device) if grad is not None else None)
    return result


def _leaf(value: Any, index: int) -> Any:
    return None if value is None else tree_flatten(value)[0][index]


class _Forward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, run: Run, phony: torch.Tensor, *inputs_and_parameters: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
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
        run.taking = [i for i, (t, slot) in enumerate(zip(tensors, run.gathered.slots)) if takes_gradients(t) and run.differentiable(slot[0])]
        ctx.mark_non_differentiable(*(t for i, t in enumerate(tensors) if i not in run.taking))
        return tuple(tensors)

    @staticmethod
    def backward(ctx: FunctionCtx, *grads: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        run: Run = ctx.run  # type: ignore[attr-defined]
        run.output_grads = grads
        return None, torch.zeros(0)


def run_with_autograd(run: Run) -> Any:
    """Run the step inside the two Functions; returns the model's output structure."""
    phony = torch.empty(0, requires_grad=True)
    token = _Forward.apply(run, phony, *[slot.tensor for slot in run.inputs], *run.parameters)
    assert run.gathered is not None
    tensors = _Outputs.apply(run, token) if run.gathered.tensors else ()
    return run.gathered.rebuild(tensors)
