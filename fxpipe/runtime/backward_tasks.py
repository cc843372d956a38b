"""The backward bodies of a step's actions: a stage's recompute, and its backward whole or split into I and W.

Each runs on one stage and one micro-batch; the forward bodies, and the state all of them read,
are in fxpipe/runtime/tasks.py.
"""
from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from fxpipe.compiled.program import StageRuntime
from fxpipe.compiled.stage_compile import own_values
from fxpipe.core.edges import CALLER
from fxpipe.core.microbatch import flatten
from fxpipe.runtime.checkpoint import attributes_kept, flags_kept, recomputing
from fxpipe.runtime.devices import send
from fxpipe.runtime.engine import run_backward
from fxpipe.runtime.raw_grads import raw_grads
from fxpipe.runtime.saved import Saved, refuse_buffers_written_since, refuse_inputs_written_since, refuse_parameters_written_since
from fxpipe.runtime.tasks import StageTasks, differentiable
from fxpipe.runtime.weight_grad import PendingWeights, Weights, backward_inputs


_NOTHING = nullcontext()  # reusable: it keeps no state


@contextmanager
def _inputs_named_if_written(micro_batch: int, saved: Saved) -> Iterator[None]:
    """Where autograd finds a tensor it saved written in place: if the caller wrote an input
    since the forward (a reused input buffer), the error names it."""
    try:
        yield
    except RuntimeError as error:
        if "modified by an inplace operation" in str(error):
            try:
                refuse_inputs_written_since(micro_batch, saved.input_versions, recomputed=False)
            except RuntimeError as named:
                raise named from error
        raise


class BackwardTasks(StageTasks):
    """The step's action bodies that run after a micro-batch's forward: R, B, I and W."""

    def _recompute_task(self, i: int, j: int) -> tuple[float, float]:  # (5)
        start = time.perf_counter()
        stage, saved = self.stages[j], self.saved[(i, j)]
        refuse_parameters_written_since(self._params_read(j), saved.versions)
        refuse_buffers_written_since(stage.read_buffers, saved.buffer_versions)
        refuse_inputs_written_since(i, saved.input_versions)
        flags = self.flags[j]
        # Under overlapping steps, inside the gate: the flags and attributes it sets, and puts
        # back after, are the model's, which the caller's hooks may be changing meanwhile.
        gate = self.versions.gate.entered() if self.versions is not None else nullcontext()
        with gate, torch.enable_grad(), recomputing(), attributes_kept(stage.whole_modules, saved.attributes), self._metered(i, j), \
                flags_kept(stage.flagged, flags) if flags is not None else nullcontext():  # fmt: skip
            saved.outputs = self._call(stage, i, saved.inputs, saved.buffers)[: len(stage.outputs)]
        saved.buffers = saved.attributes = None
        return start, time.perf_counter()

    def _output_grads(self, i: int, j: int) -> list[Any]:  # (4)
        stage = self.stages[j]
        # A fused loss stage's outputs get theirs from the loss, in its own backward.
        skip = self.sink if j == self.loss_stage and i in self.fused else None
        keys = [("bwd", j, i, name, dst) for name in stage.outputs for dst in stage.consumers[name] if dst != skip]
        received = iter(self.mailbox.take(keys))
        grads = []
        for name in stage.outputs:
            total = None
            for dst in stage.consumers[name]:
                if dst != skip:
                    total = add_grads(total, next(received))
            grads.append(total)
        return grads

    def _received(self, i: int, j: int, saved: Saved) -> tuple[float, list[torch.Tensor], list[torch.Tensor]]:
        """(4) for B and I: the output gradients, once in hand (the action starts then), with the
        outputs that take one; the stage lets go of its outputs."""
        grads = self._output_grads(i, j)
        start = time.perf_counter()
        assert saved.outputs is not None, "a checkpointed micro-batch's backward runs after its recompute"
        tensors, grad_tensors = differentiable(saved.outputs, grads)
        outputs, saved.outputs = saved.outputs, None
        loss = self.fused.pop(i, None) if j == self.loss_stage else None
        if loss is not None:
            tensors.append(loss)
            grad_tensors.append(torch.ones_like(loss))
        if self.stages[j].compiled is not None:
            saved.given = frozenset(k for k, grad in enumerate(grads) if grad is not None) | _reached_by(loss, outputs)
        if self.slices is not None:  # what the slice carried, with the gradients the next slice gave it
            made = self.carry_made.pop((j, i), {})
            if not self.slices.last(i) and (j, i) not in self.carry_grads and any(t.requires_grad for t in made.values()):
                raise RuntimeError(
                    f"stage {j} ran the backward of slice {i} before that of the slice after it, whose gradients "
                    "it needs: slices of a sequence run under a schedule made of rows (fxpipe/schedules/actions.py, by_rows)."
                )
            given = self.carry_grads.pop((j, i), {})
            for c, t in made.items():
                grad = given.get(c)
                if t.requires_grad and grad is not None:
                    tensors.append(t)
                    grad_tensors.append(grad)
        return start, tensors, grad_tensors

    def _backward_task(self, i: int, j: int) -> tuple[float, float]:
        stage, saved = self.stages[j], self.saved[(i, j)]
        start, tensors, grad_tensors = self._received(i, j, saved)
        self._release(i, j)
        carried = self.carry_in.pop((j, i), {}) if self.slices is not None else {}
        with _inputs_named_if_written(i, saved):
            input_grads, _, carried_grads = self._stage_gradients(stage, saved.inputs, tensors, grad_tensors, carried=carried, given=saved.given)  # (6)
        self._hand_back_carries(i, j, carried_grads)
        del tensors, grad_tensors
        end = time.perf_counter()
        self._send_input_grads(stage, i, input_grads)  # (7)
        return start, end

    def _input_grad_task(self, i: int, j: int) -> tuple[float, float]:
        """I: the gradients of the stage's inputs only, sent at once; what the weights' gradients
        need stays in `pending` for W."""
        stage, saved = self.stages[j], self.saved[(i, j)]
        start, tensors, grad_tensors = self._received(i, j, saved)
        # A compiled stage's backward is one node that computes every gradient at once (and frees
        # what it saved): I runs all of it, and W has nothing left to do.
        split = stage.compiled is None
        carried = self.carry_in.pop((j, i), {}) if self.slices is not None else {}
        with _inputs_named_if_written(i, saved):
            input_grads, pending, carried_grads = self._stage_gradients(
                stage, saved.inputs, tensors, grad_tensors, split=split, carried=carried, given=saved.given,
            )  # fmt: skip
        self._hand_back_carries(i, j, carried_grads)
        saved.pending = pending if pending is not None else PendingWeights()
        del tensors, grad_tensors
        end = time.perf_counter()
        self._send_input_grads(stage, i, input_grads)
        return start, end

    def _hand_back_carries(self, i: int, j: int, grads: dict[int, Optional[torch.Tensor]]) -> None:
        """The gradients of what slice `i` read as carries, for the backward of the slice before."""
        if grads:
            self.carry_grads[(j, i - 1)] = grads

    def _weight_grad_task(self, i: int, j: int) -> tuple[float, float]:
        """W: the gradients of the stage's parameters and shared copies, from what I kept."""
        start = time.perf_counter()
        saved = self._release(i, j)
        assert saved.pending is not None
        saved.pending.run()
        return start, time.perf_counter()

    def _send_input_grads(self, stage: StageRuntime, i: int, input_grads: list[Any]) -> None:
        for name, grad in zip(stage.inputs, input_grads):
            src = stage.sources[name]
            if src == CALLER and not self.caller_grads:
                continue
            device = self.stages[src].device if src != CALLER else self.input_devices[name]
            self.mailbox.put(("bwd", src, i, name, stage.index), send(grad, device))

    def _weights(self, stage: StageRuntime) -> Weights:
        """The stage's parameter leaves and shared copies that take gradients, the same over
        the step (made at its first forward)."""
        weights = self.weights[stage.index]
        if weights is None:
            params = [leaf for leaf in self.param_leaves[stage.index] or () if leaf.requires_grad]
            weights = Weights([*params, *(c for c in self.shared[stage.index] if c.requires_grad)])
            self.weights[stage.index] = weights
        return weights

    def _unreached(self, stage: StageRuntime, inputs: int, given: Optional[frozenset[int]]) -> tuple[Optional[frozenset[int]], list[torch.Tensor]]:
        """Of a compiled stage, whose backward is one node that gives every input and parameter a
        gradient (zeros where no output reaches it), the inputs its `given` outputs reach (None:
        all, an eager stage), and the parameter leaves and shared copies they do not reach that
        have no `.grad` yet: their `.grad` stays None, as the plain model's autograd leaves it."""
        if stage.compiled is None or given is None:
            return None, []
        reached, params = stage.compiled.unreached(given, stage.param_slots)
        leaves = self.param_leaves[stage.index] or []
        shared = self.shared[stage.index]
        untouched = [leaves[k] for k in params if k < len(leaves)]
        untouched += [copy for m, copy in enumerate(shared) if inputs + m not in reached and isinstance(copy, torch.Tensor)]
        return reached, [t for t in untouched if t.requires_grad and t.grad is None]

    def _stage_gradients(
        self, stage: StageRuntime, inputs: list[Any], tensors: list[torch.Tensor], grad_tensors: list[torch.Tensor], split: bool = False,
        carried: Optional[dict[int, torch.Tensor]] = None, given: Optional[frozenset[int]] = None,
    ) -> tuple[list[Any], Optional[PendingWeights], dict[int, Optional[torch.Tensor]]]:
        """Gradients of the stage's inputs (returned, shaped like them), and of the carries it
        read (by index). Those of its parameter views and shared copies accumulate in their
        `.grad` over the step's micro-batches, added by autograd as each is made (while it is
        still in cache); with `split`, later, by W, from what is returned with the input gradients.
        `given`: of a compiled stage, the outputs a gradient reaches (see `_unreached`)."""
        carried = {c: t for c, t in (carried or {}).items() if t.requires_grad}
        flat_inputs = [flatten(value) for value in inputs]
        leaves = [t for leaves, _ in flat_inputs for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        leaves += carried.values()
        pending = None
        inputs_reached, untouched = self._unreached(stage, len(inputs), given)
        compiled = stage.compiled.backward() if stage.compiled is not None else _NOTHING
        with raw_grads(leaves) as raw, compiled, self._slots_held(stage):  # sent back in the layout the producer's backward would get
            if split:
                pending = backward_inputs(tensors, grad_tensors, leaves, self._weights(stage))
            elif tensors and (wanted := [*leaves, *self._weights(stage).tensors]):
                # Every leaf the stage's graph reaches that requires grad is wanted (compile refuses
                # loose ones), so autograd needs `inputs=`, whose graph walk costs ~10% of a small
                # task, only to stop at an input that is not a leaf (a copy kept for a recompute).
                run_backward(tensors, grad_tensors, None if all(t.is_leaf for t in leaves) else wanted)
        for leaf in untouched:
            leaf.grad = None
        grads = [
            None if inputs_reached is not None and p not in inputs_reached else
            raw.of(leaves_[0]) if spec is None else tree_unflatten([raw.of(t) for t in leaves_], spec)
            for p, (leaves_, spec) in enumerate(flat_inputs)
        ]  # fmt: skip
        if stage.compiled is not None and stage.compiled.static_outputs:
            grads = own_values(grads)
        return grads, pending, {c: raw.of(t) for c, t in carried.items()}


def _reached_by(loss: Optional[torch.Tensor], outputs: Any) -> frozenset[int]:
    """The positions of the `outputs` that a fused `loss` is computed from (none without one)."""
    if loss is None or loss.grad_fn is None:
        return frozenset()
    ends = {(t.grad_fn, t.output_nr): k for k, out in enumerate(outputs or ()) for t in tree_flatten(out)[0]
            if isinstance(t, torch.Tensor) and t.grad_fn is not None}  # fmt: skip
    found: set[int] = set()
    seen: set[Any] = set()
    stack: list[Any] = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for child, nr in node.next_functions:
            if (child, nr) in ends:
                found.add(ends[child, nr])
            else:
                stack.append(child)
    return frozenset(found)


def add_grads(a: Any, b: Any) -> Any:
    """Sum two gradient trees of the same structure; None stands for zero."""
    if a is None:
        return b
    if b is None:
        return a
    if isinstance(a, torch.Tensor):
        return a + b
    left, spec = tree_flatten(a)
    right, _ = tree_flatten(b)
    return tree_unflatten([x if y is None else y if x is None else x + y for x, y in zip(left, right)], spec)
