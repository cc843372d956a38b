"""One pipeline step: the forward schedule, the backward schedule, and the values between them.

A task is one (micro-batch, stage) pair. The caller thread hands each stage's worker its tasks in
clock-cycle order; a task waits in the mailbox for what it receives, runs, and posts what it sends.
Forward, for stage j and micro-batch i:

    (1) take inputs ──▶ (2) run stage ──▶ (3) send outputs to each consumer's device
                          │ checkpointed: under no_grad, inputs kept for (5)
                          │ otherwise:    under enable_grad, graph kept for (6)

Backward, in reverse order:

    (5) recompute if checkpointed ──▶ (4) take output gradients ──▶ (6) stage backward
        (with the forward's random        (summed over consumers)        ──▶ (7) send input
         stream, before the gradients                                          gradients back
         arrive)
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from fxpipe.checkpoint import checkpointing, recomputing
from fxpipe.devices import Parcel, send
from fxpipe.microbatch import leaves_of, map_tensors
from fxpipe.randomness import TaskRandomness, task_seed
from fxpipe.schedule import clock_cycles
from fxpipe.worker import Workers

CALLER = -1


class StageError(RuntimeError):
    """An exception raised inside a stage; `__cause__` is the original."""

    def __init__(self, stage: int, micro_batch: int, phase: str, error: BaseException) -> None:
        super().__init__(f"stage {stage} failed on micro-batch {micro_batch} in {phase}: {type(error).__name__}: {error}")
        self.stage, self.micro_batch, self.phase = stage, micro_batch, phase


class _Aborted(Exception):
    """Another task failed; this one stops waiting."""


@dataclass
class StageRuntime:
    """What the runtime needs of one stage."""

    index: int
    device: torch.device
    module: Callable[..., tuple[Any, ...]]
    inputs: list[str]
    outputs: list[str]
    sources: dict[str, int]  # input value -> producing stage (CALLER for the pipeline's inputs)
    consumers: dict[str, list[int]]  # output value -> consuming stages (n stands for the output)
    random_free: set[Hashable] = field(default_factory=set)  # training-mode keys seen drawing nothing

    def mode_key(self) -> Hashable:
        modules: Sequence[Any] = list(getattr(self.module, "modules", lambda: [])())
        return tuple(m.training for m in modules)


class Mailbox:
    """Parcels keyed by (direction, stage, micro-batch, value, ...); `take` waits for its keys."""

    def __init__(self) -> None:
        self.items: dict[Hashable, Parcel] = {}
        self.cond = threading.Condition()
        self.aborted = False

    def put(self, key: Hashable, parcel: Parcel) -> None:
        with self.cond:
            self.items[key] = parcel
            self.cond.notify_all()

    def take(self, keys: Sequence[Hashable]) -> list[Any]:
        with self.cond:
            self.cond.wait_for(lambda: self.aborted or all(k in self.items for k in keys))
            if self.aborted:
                raise _Aborted()
            parcels = [self.items.pop(k) for k in keys]
        return [p.open() for p in parcels]

    def abort(self) -> None:
        with self.cond:
            self.aborted = True
            self.items.clear()
            self.cond.notify_all()


@dataclass
class _Saved:
    inputs: list[Any]
    outputs: Optional[tuple[Any, ...]]  # None when checkpointed: recomputed in backward
    randomness: bool


class Step:
    """The state of one call of the pipeline, from forward to the end of backward."""

    def __init__(
        self,
        stages: Sequence[StageRuntime],
        workers: Workers,
        micro_batches: Sequence[dict[str, Any]],
        *,
        grad: bool,
        checkpoint_stop: int,
        seed: int,
        shared: Sequence[list[torch.Tensor]],
        output_device: torch.device,
        input_devices: dict[str, torch.device],
    ) -> None:
        self.stages, self.workers = stages, workers
        self.micro_batches = micro_batches
        self.grad, self.checkpoint_stop, self.seed = grad, checkpoint_stop, seed
        self.shared = shared
        self.output_device, self.input_devices = output_device, input_devices
        self.sink = len(stages)
        self.mailbox = Mailbox()
        self.saved: dict[tuple[int, int], _Saved] = {}
        # (phase, micro-batch, stage, start, end): forward from inputs in hand to outputs made,
        # backward from the start of the recompute to the end of the stage's backward.
        self.timeline: list[tuple[str, int, int, float, float]] = []
        self.backward_done = False
        self.order = [pair for tick in clock_cycles(len(micro_batches), len(stages)) for pair in tick]
        keys = [stage.mode_key() for stage in stages]
        self.randomness = [key not in stage.random_free for key, stage in zip(keys, stages)]
        self.mode_keys = keys

    # -- driving ---------------------------------------------------------------------------
    def _run(self, tasks: list[tuple[int, int]], body: Callable[[int, int], None], phase: str) -> None:
        done: queue.SimpleQueue[tuple[int, int, Optional[BaseException]]] = queue.SimpleQueue()

        def task(i: int, j: int) -> Callable[[], None]:
            def run() -> None:
                try:
                    body(i, j)
                    error = None
                except BaseException as e:  # noqa: BLE001 - handed to the caller thread
                    error = e
                    self.mailbox.abort()
                done.put((i, j, error))

            return run

        for i, j in tasks:
            self.workers.submit(j, task(i, j))
        errors = {}
        for _ in tasks:
            i, j, error = done.get()
            if error is not None and not isinstance(error, _Aborted):
                errors[(i, j)] = error
        if errors:
            (i, j), error = min(errors.items(), key=lambda item: tasks.index(item[0]))
            self.saved.clear()
            raise StageError(j, i, phase, error) from error

    def forward(self) -> list[dict[str, Any]]:
        """Run every forward task; returns, per micro-batch, the values bound for the output."""
        for i, batch in enumerate(self.micro_batches):
            for stage in self.stages:
                for name in stage.inputs:
                    if stage.sources[name] == CALLER:
                        self._post_forward(stage.index, i, name, batch[name], stage.device, _requires_grad)
        self._run(self.order, self._forward_task, "forward")
        names = [name for s in self.stages for name, dsts in s.consumers.items() if self.sink in dsts]
        return [
            dict(zip(names, self.mailbox.take([("fwd", self.sink, i, n) for n in names])))
            for i in range(len(self.micro_batches))
        ]

    def backward(self, output_grads: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Run every backward task, given per micro-batch the gradients of the output values;
        returns, per micro-batch, the gradients of the pipeline's inputs."""
        if self.backward_done:
            raise RuntimeError(
                "backward through this pipeline step ran already and its saved state is freed.\n"
                "How to fix: run the forward again for a second backward (retain_graph is not supported)."
            )
        self.backward_done = True
        for i, grads in enumerate(output_grads):
            for stage in self.stages:
                for name, dsts in stage.consumers.items():
                    if self.sink in dsts:
                        parcel = send(grads.get(name), stage.device)
                        self.mailbox.put(("bwd", stage.index, i, name, self.sink), parcel)
        self._run(self.order[::-1], self._backward_task, "backward")
        return [self._input_grads(i) for i in range(len(self.micro_batches))]

    def _input_grads(self, i: int) -> dict[str, Any]:
        grads: dict[str, Any] = {}
        for stage in self.stages:
            for name in stage.inputs:
                if stage.sources[name] == CALLER:
                    (grad,) = self.mailbox.take([("bwd", CALLER, i, name, stage.index)])
                    grads[name] = _add(grads.get(name), grad)
        return grads

    # -- tasks -----------------------------------------------------------------------------
    def _post_forward(
        self, dst: int, i: int, name: str, value: Any, device: torch.device, wants: Callable[[torch.Tensor], bool]
    ) -> None:
        leaf = self.grad and dst != self.sink
        self.mailbox.put(("fwd", dst, i, name), send(value, device, wants if leaf else None))

    def _call(self, stage: StageRuntime, i: int, inputs: list[Any], randomness: bool) -> tuple[Any, ...]:
        args = [*inputs, *self.shared[stage.index]]
        if not randomness:
            return stage.module(*args)
        mode = TaskRandomness(task_seed(self.seed, i, stage.index))
        with mode:
            outputs = stage.module(*args)
        if not mode.drew:
            stage.random_free.add(self.mode_keys[stage.index])
        return outputs

    def _forward_task(self, i: int, j: int) -> None:
        stage = self.stages[j]
        inputs = self.mailbox.take([("fwd", j, i, name) for name in stage.inputs])  # (1)
        start = time.perf_counter()
        randomness = self.randomness[j]
        checkpointed = self.grad and i < self.checkpoint_stop
        if checkpointed:
            with torch.no_grad(), checkpointing():  # (2)
                outputs = self._call(stage, i, inputs, randomness)
            self.saved[(i, j)] = _Saved(inputs, None, randomness)
        else:
            with torch.set_grad_enabled(self.grad):
                outputs = self._call(stage, i, inputs, randomness)
            if self.grad:
                self.saved[(i, j)] = _Saved(inputs, outputs, randomness)
        self.timeline.append(("forward", i, j, start, time.perf_counter()))
        wants = _floating if checkpointed else _requires_grad
        for name, value in zip(stage.outputs, outputs):  # (3)
            for dst in stage.consumers[name]:
                device = self.output_device if dst == self.sink else self.stages[dst].device
                self._post_forward(dst, i, name, value, device, wants)

    def _backward_task(self, i: int, j: int) -> None:
        stage = self.stages[j]
        saved = self.saved.pop((i, j))
        start = time.perf_counter()
        outputs = saved.outputs
        if outputs is None:  # (5)
            with torch.enable_grad(), recomputing():
                outputs = self._call(stage, i, saved.inputs, saved.randomness)
        keys = [("bwd", j, i, name, dst) for name in stage.outputs for dst in stage.consumers[name]]
        received = iter(self.mailbox.take(keys))  # (4)
        grads = []
        for name in stage.outputs:
            total = None
            for _ in stage.consumers[name]:
                total = _add(total, next(received))
            grads.append(total)
        _stage_backward(outputs, grads)  # (6)
        del outputs, grads
        self.timeline.append(("backward", i, j, start, time.perf_counter()))
        for name, value in zip(stage.inputs, saved.inputs):  # (7)
            src = stage.sources[name]
            device = self.stages[src].device if src != CALLER else self.input_devices[name]
            grad = map_tensors(lambda t: t.grad, value)
            self.mailbox.put(("bwd", src, i, name, j), send(grad, device))


def _requires_grad(t: torch.Tensor) -> bool:
    return t.requires_grad


def _floating(t: torch.Tensor) -> bool:
    # A checkpointed forward ran under no_grad, so nothing tells which outputs are differentiable:
    # every floating-point one is taken to be, and a gradient that never comes back is None.
    return t.is_floating_point() or t.is_complex()


def _add(a: Any, b: Any) -> Any:
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


def _stage_backward(outputs: Sequence[Any], grads: Sequence[Any]) -> None:
    tensors, grad_tensors = [], []
    for output, grad in zip(outputs, grads):
        if grad is None:
            continue
        out_leaves, grad_leaves = leaves_of(output), leaves_of(grad)
        for t, g in zip(out_leaves, grad_leaves):
            if isinstance(t, torch.Tensor) and t.requires_grad and g is not None:
                tensors.append(t)
                grad_tensors.append(g)
    if tensors:
        torch.autograd.backward(tensors, grad_tensors)
