"""`train_steps` under schedule='2bw': the steps of consecutive batches overlap, each batch on the weights of the batch before last.

The workers run one 1F1B stream over the micro-batches of every batch (fxpipe/schedules/two_bw.py),
submitted a segment at a time: as soon as batch k is read, each worker gets its actions up to
the first that needs batch k + 1. The caller's thread meanwhile finishes batch k - 1: its loss,
its gradients into `.grad`, `after_backward`; then each stage's update of it runs on the stage's
worker, ahead of the stage's first forward of batch k + 1 (fxpipe/runtime/versions.py):

    W(t + 1) = W(t) - lr * grad f_t(W(t - 1))     (the optimizer's own rule in place of - lr * grad)

A loop that stops (the caller breaks out, a stage or the batches raise) waits for what is in
flight, drops the batches whose loss it has not given, and completes the update of the last
batch whose loss it gave: the parameters are then those of the synchronous loop stopped there.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterator, Optional

import torch

from fxpipe.compiled.program import Program
from fxpipe.runtime.batch_loss import loss_and_outputs
from fxpipe.runtime.call import Call
from fxpipe.runtime.devices import Aborted
from fxpipe.runtime.grads import accumulate, parameter_grads
from fxpipe.runtime.losses import LeafGrads
import fxpipe.runtime.step as steps
from fxpipe.runtime.step import Step
from fxpipe.runtime.versions import Versions, storage_bytes
from fxpipe.runtime.worker import TaskGroup
from fxpipe.schedules.actions import Action, checkpoint_stop
from fxpipe.schedules.timeline import Record
from fxpipe.schedules.two_bw import UPDATE, refuse_too_few_micro_batches, segment, two_bw

# The Pipeline the loop runs (fxpipe/pipeline.py, which imports this module: not imported here).
PipelineLike = Any

Batch = tuple[int, tuple[Any, ...], dict[str, Any], Any]  # index, args, kwargs, target
Hook = Optional[Callable[[], Any]]


@dataclass
class _InFlight:
    call: Call
    step: Step
    group: TaskGroup
    target: Any


class _Overlap:
    """The state of one loop: its steps in flight, what each worker was given, the updates."""

    def __init__(self, pipe: PipelineLike, optimizer: torch.optim.Optimizer, loss_fn: Any, reduction: str) -> None:
        self.pipe, self.optimizer, self.loss_fn, self.reduction = pipe, optimizer, loss_fn, reduction
        self.program = pipe._programs[True]
        self.layout, self.m = self.program.layout, pipe.chunks
        refuse_too_few_micro_batches(self.layout, self.m)
        self.checkpointed = checkpoint_stop(pipe.checkpoint, self.m)
        self.versions = Versions(self.program, optimizer, steps.WAIT_TIMEOUT)  # read now: tests bound it
        self.steps: dict[int, _InFlight] = {}
        self.updates: dict[int, TaskGroup] = {}
        self.given = [0] * self.layout.workers
        self.read = 0  # batches read so far
        self.finished = 0  # batches whose loss was given
        self.held: Optional[Program] = None
        self.records: list[Record] = []  # what ran, for pipe.timeline()

    # -- submitting -----------------------------------------------------------------------
    def start(self, batch: Batch) -> None:
        """Batch `batch`'s step, and each worker's actions up to the first that needs the next batch."""
        index, args, kwargs, target = batch
        call, step = self.pipe._train_call(
            args, kwargs, target, self.loss_fn, self.reduction, LeafGrads(), versions=self.versions, batch=index, held=self.held,
        )  # fmt: skip
        self.held = call.program  # checked against the model on the first batch, before anything ran
        if len(call.sizes) != self.m:
            raise ValueError(
                f"train_steps with schedule='2bw': batch {index} splits into {len(call.sizes)} micro-batches, not "
                f"chunks={self.m}: every batch of the loop must (its samples at least chunks).\nHow to fix: drop the "
                "last, smaller batch (DataLoader(drop_last=True))."
            )
        step._post_inputs()
        self.steps[index] = _InFlight(call, step, TaskGroup(self.layout.stages * (2 * self.m + self.checkpointed)), target)
        self.updates[index] = TaskGroup(self.layout.stages)
        self.read = index + 1
        streams = two_bw(self.layout, self.m, self.read + 1, self.checkpointed)
        self._submit(streams, segment(streams, self.m, index))

    def end(self) -> None:
        """No batch after those read: every worker gets the rest of its list (the drain, the last updates)."""
        streams = two_bw(self.layout, self.m, self.read, self.checkpointed)
        self._submit(streams, [len(acts) for acts in streams])

    def _submit(self, streams: list[list[Action]], cuts: list[int]) -> None:
        for worker, (acts, cut) in enumerate(zip(streams, cuts)):
            for action in acts[self.given[worker] : cut]:
                self.pipe._workers.submit(worker, self._task(action))
            self.given[worker] = max(self.given[worker], cut)

    def _task(self, action: Action) -> Callable[[], None]:
        if action.kind == UPDATE:
            return self._update_task(action)
        flight = self.steps[action.micro_batch // self.m]
        return flight.step.task(Action(action.kind, action.stage, action.micro_batch % self.m), flight.group)

    def _update_task(self, action: Action) -> Callable[[], None]:
        group = self.updates[action.micro_batch]

        def run() -> None:
            error: Optional[BaseException] = None
            try:
                start = time.perf_counter()
                self.versions.update(action.micro_batch, action.stage)
                self._count_parameter_memory()
                worker = self.layout.ranks[action.stage]
                self.records.append(Record(UPDATE, action.stage, action.micro_batch, worker, start, time.perf_counter()))
            except BaseException as e:  # noqa: BLE001 - the caller's thread raises it
                error = e
                self._stop_in_flight()
            group.finish(action, None if isinstance(error, Aborted) else error)

        return run

    def _count_parameter_memory(self) -> None:
        """The parameters' memory right after an update, the old versions in-flight steps hold
        included: the most is `pipe.last_parameter_bytes`."""
        flights = list(self.steps.values())  # one call: the caller's thread may change the dict
        held = [t for f in flights for leaves in (*f.step.param_leaves, *f.step.shared) for t in leaves or () if isinstance(t, torch.Tensor)]
        found = storage_bytes([*self.program.parameters, *held])
        self.pipe.__dict__["last_parameter_bytes"] = max(found, self.pipe.__dict__.get("last_parameter_bytes", 0))

    # -- finishing ------------------------------------------------------------------------
    def finish(self, index: int, after_backward: Hook, after_step: Hook) -> torch.Tensor:
        """Batch `index` done: the update of the batch before it (and `after_step`), then its
        loss, its gradients in `.grad` and `after_backward`; its own update may then run."""
        flight = self.steps[index]
        _wait(flight.group)
        flight.step.settle(flight.group)
        if flight.step.batch_stats is not None:
            flight.step.batch_stats.commit()
        flight.step.backward_done = True
        # The loop's timeline: micro-batches by their index in the loop, updates by batch.
        self.records += [dataclasses.replace(r, micro_batch=index * self.m + r.micro_batch) for r in flight.step.timeline]
        self.pipe.__dict__["last_timeline"] = self.records
        if index >= 1:
            self._updated(index - 1, after_step)
        input_grads = [flight.step._input_grads(i) for i in range(self.m)]
        total, _ = loss_and_outputs(flight.call, flight.step, self.loss_fn, flight.target, self.reduction, False)
        self.optimizer.zero_grad()
        accumulate(flight.call, input_grads, parameter_grads(flight.call.program, flight.step, flight.call.params))
        if after_backward is not None:
            with self.versions.gate.shut():  # no stage holds the model's parameter slots meanwhile
                after_backward()
        del self.steps[index]
        self.versions.ready(index)
        self.finished = index + 1
        return total

    def _updated(self, index: int, after_step: Hook) -> None:
        """Every stage's update of batch `index` done (raising the first that failed), then `after_step`."""
        group = self.updates.pop(index)
        _wait(group)
        if group.errors:
            error = next(iter(group.errors.values()))
            error.add_note(
                f"train_steps (schedule='2bw'): the optimizer's step on batch {index} failed on a stage: the stages "
                "whose step ran hold that update, the others do not (an optimizer's step is not undone)."
            )
            raise error
        if after_step is not None:
            with self.versions.gate.shut():
                after_step()

    def last_update(self, after_step: Hook) -> None:
        if self.finished:
            self._updated(self.finished - 1, after_step)

    def _stop_in_flight(self) -> None:
        self.versions.abort()
        for flight in self.steps.values():
            flight.step.cancel()

    def stop(self, after_step: Hook) -> None:
        """After a failure, or the caller's break: what is in flight stopped and waited for, and
        the update of the last batch whose loss was given completed on every stage."""
        self._stop_in_flight()
        self.end()  # the rest of every list, which now returns at once: every group then finishes
        for group in [*(f.group for f in self.steps.values()), *self.updates.values()]:
            _wait(group)
        self.steps.clear()
        pending = self.finished - 1
        if pending < 0 or pending not in self.updates:
            return
        for stage in range(self.layout.stages):
            if not self.versions.is_done(pending, stage):
                self.versions.apply(pending, stage)
        self.updates.pop(pending)
        if after_step is not None:
            after_step()


def _wait(group: TaskGroup) -> None:
    group.wait(None if steps.WAIT_TIMEOUT is None else 2 * steps.WAIT_TIMEOUT)


def overlapped_steps(
    pipe: PipelineLike, batches: Iterator[Batch], loss_fn: Any, optimizer: torch.optim.Optimizer, reduction: str,
    after_backward: Hook, after_step: Hook,
) -> Generator[torch.Tensor, None, None]:
    """The loop: each batch's loss once its gradients are in `.grad`; the next batch is read
    (and started) before the caller's thread waits for a batch, so the workers never flush."""
    run = _Overlap(pipe, optimizer, loss_fn, reduction)
    pipe.__dict__["last_parameter_bytes"] = storage_bytes(run.program.parameters)
    done = False
    pipe.__dict__["_overlapping"] = run.versions.gate  # refuses calls, holds the stages still for reads
    try:
        first = next(batches, None)
        if first is None:
            done = True
            return
        run.start(first)
        ended = False
        while run.finished < run.read:
            if not ended and run.read == run.finished + 1:  # start the next batch before waiting on this one
                following = next(batches, None)
                if following is None:
                    ended = True
                    run.end()
                else:
                    run.start(following)
            yield run.finish(run.finished, after_backward, after_step)
        run.last_update(after_step)
        done = True
    finally:
        pipe.__dict__["_overlapping"] = None
        if not done:
            run.stop(after_step)
