"""One pipeline step: the executor that runs a schedule's actions, and the values between them.

Each worker runs its list of actions (fxpipe/schedules/schedule.py) in order; an action waits in the
mailbox for what it receives, runs, and posts what it sends. For stage j and micro-batch i:

    F  (1) take inputs ──▶ (2) run stage ──▶ (3) send outputs to each consumer's device
                             │ checkpointed: under no_grad, inputs kept for R
                             │ otherwise:    under enable_grad, graph kept for B (or I and W)
       at the loss stage of a train step: the micro-batch's loss, and its output gradients sent
    R  (5) recompute a checkpointed forward, with its random stream and buffers
    B  (4) take output gradients (summed over consumers) ──▶ (6) stage gradients ──▶ (7) send
           input gradients back
    I  (4), then the input gradients alone, sent at once; the graph is kept
    W  the weights' gradients from what I kept

`pipe(x)` runs GPipe's forwards, and `loss.backward()` the rest of its lists. A stage runs on
leaves that alias its parameters, made once per step; its backward accumulates into those
leaves' `.grad`, never into the parameters': the step's sums are handed to autograd as the
gradients of the pipeline Function's inputs (or, in a train step, of the parameters), so that
only what the caller asked for receives them, and each parameter's hooks fire once.
"""
from __future__ import annotations

import time
import weakref
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, ContextManager, Iterator, Optional, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from fxpipe.compiled.program import StageRuntime
from fxpipe.compiled.stage_compile import own_values
from fxpipe.core.edges import CALLER
from fxpipe.core.failures import Failure, RemoteFailure
from fxpipe.core.microbatch import clone_tree, leaves_of, map_tensors
from fxpipe.core.randomness import TaskRandomness, TaskStream, draw_step_seed, task_stream
from fxpipe.runtime.batchnorm import BatchStatistics, collecting
from fxpipe.runtime.checkpoint import Attributes, attributes_kept, attributes_of, checkpointing, flags_kept, flags_of, put_back_attributes, recomputing, refuse_gradients_through, swapped_slots, swapped_state
from fxpipe.runtime.context import CallerContext, worker_state
from fxpipe.runtime.devices import Aborted, Mailbox, Parcel, on_device, send
from fxpipe.runtime.hints import hint_for
from fxpipe.runtime.losses import value_grads
from fxpipe.runtime.memory import ActivationMeter
from fxpipe.runtime.raw_grads import raw_grads
from fxpipe.runtime.weight_grad import PendingWeights, Weights, backward_inputs
from fxpipe.runtime.worker import TaskGroup, Workers
from fxpipe.schedules.schedule import Action, BACKWARD, FORWARD, INPUT_GRAD, Layout, RECOMPUTE, Schedule, WEIGHT_GRAD
from fxpipe.schedules.simulate import StageCosts, simulate
from fxpipe.schedules.timeline import Record

# Seconds a task or the caller waits for a value before it reports a hang; None waits forever.
# Tests set a bound, so that a deadlock fails in seconds.
WAIT_TIMEOUT: Optional[float] = None


class StageError(RuntimeError):
    """An exception raised inside a stage; `__cause__` is the original. Across processes, `rank`
    is the rank the stage ran on, and every rank raises the same error."""

    def __init__(self, stage: int, micro_batch: int, phase: str, error: BaseException, rank: Optional[int] = None) -> None:
        where = f"stage {stage}" if rank is None else f"stage {stage} (rank {rank})"
        detail = error.failure.error if isinstance(error, RemoteFailure) else f"{type(error).__name__}: {error}{hint_for(error)}"
        super().__init__(f"{where} failed on micro-batch {micro_batch} in {phase}: {detail}")
        self.stage, self.micro_batch, self.phase, self.rank, self.detail = stage, micro_batch, phase, rank, detail


def _copy_into(target: torch.Tensor, values: torch.Tensor) -> None:
    """Values into a caller's tensor, outside autograd; an inference tensor is written in
    inference mode, the only one that may write it."""
    with torch.inference_mode() if target.is_inference() else torch.no_grad():
        target.copy_(values)


def raised_here(failure: Failure) -> Exception:
    """The error this rank raises for a failure on another: that stage's StageError, or, for a
    failure outside any stage (a rank lost at the end of a step), a RuntimeError that says so."""
    if failure.stage < 0:
        return RuntimeError(failure.describe())
    return StageError(failure.stage, failure.micro_batch, failure.phase, RemoteFailure(failure), rank=failure.rank)


class _LossError(Exception):
    """The loss function raised (the cause)."""


_PHASES = {FORWARD: "forward", RECOMPUTE: "backward", BACKWARD: "backward", INPUT_GRAD: "backward", WEIGHT_GRAD: "backward"}



@dataclass
class _Saved:
    inputs: list[Any]
    outputs: Optional[tuple[Any, ...]]  # None when checkpointed: recomputed in backward
    buffers: Optional[dict[str, torch.Tensor]] = None  # for the recompute: as the forward saw them
    pending: Optional[PendingWeights] = None  # between I and W: what W starts from
    attributes: Optional[Attributes] = None  # for the recompute: of modules called whole, as the forward saw them
    versions: Optional[list[int]] = None  # for the recompute: of the stage's parameters, as the forward saw them
    # For the recompute: the caller's tensors it reads, by input name, with their versions then.
    input_versions: list[tuple[str, torch.Tensor, int]] = field(default_factory=list)


# The loss of one micro-batch, weighted for the batch, given its index and its output values
# (fresh leaves, or the loss stage's own values: see `Step._fuses`).
LossFn = Callable[[int, dict[str, Any]], torch.Tensor]


def _refuse_parameters_written_since(params: list[torch.Tensor], versions: Optional[list[int]]) -> None:
    """A recompute reads the parameters as they are now: one written in place since its forward
    (an optimizer's step between forward and backward) would give the backward of another
    forward. The plain model's backward raises for a parameter autograd saved, and otherwise
    reads what it saved of the forward that ran."""
    written = [p for p, version in zip(params, versions or ()) if p._version != version]
    if written:
        shapes = ", ".join(str(tuple(p.shape)) for p in written[:4]) + (f" and {len(written) - 4} more" if len(written) > 4 else "")
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"{len(written)} parameter(s) of this stage (shapes {shapes}) were written in place between its forward "
            "and its backward, and its recompute would not see what its forward saw.\nHow to fix: write parameters "
            "after the backward (optimizer.step() after loss.backward()), or use checkpoint='never', whose backward "
            "reads what its forward kept, as the plain model's does. A forward that writes its own parameters "
            "(`self.w.clamp_(...)` under no_grad) writes them once per micro-batch: write them before the call."
        )


def _refuse_inputs_written_since(micro_batch: int, versions: list[tuple[str, torch.Tensor, int]]) -> None:
    """A recompute reads the caller's inputs as they are now: one written in place since its
    forward (a reused input buffer, a second forward into it) would give the backward of another
    forward. The plain model's backward raises for an input autograd saved."""
    written = sorted({name for name, t, version in versions if t._version != version})
    if written:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"the pipeline's input {', '.join(map(repr, written))} was written in place between the forward and the "
            f"backward (micro-batch {micro_batch}'s rows), and a checkpointed stage would recompute from the new values.\n"
            "How to fix: write the input after the backward (or pass a copy, x.clone(), to the pipeline), or use "
            "checkpoint='never', whose backward reads what its forward kept, as the plain model's does."
        )


def _marked(action: Action, error: BaseException) -> BaseException:
    """`error` with where it struck, for the other ranks' message (distributed.failing_together)."""
    error.fxpipe_where = (action.stage, action.micro_batch, _PHASES[action.kind])  # type: ignore[attr-defined]
    return error


# Bytes of buffers a step copies to put back if it fails: running statistics and counters are
# far below; a larger buffer (a queue of features) would cost a copy on every step, and keeps
# what a failed step wrote.
PUT_BACK_LIMIT = 16 << 20


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
        shared: Sequence[list[torch.Tensor]],
        output_device: torch.device,
        input_devices: dict[str, torch.device],
        context: CallerContext,
        schedule: Schedule,
        layout: Layout,
        batch_stats: Optional[BatchStatistics] = None,
        loss: Optional[LossFn] = None,
        meter: Optional[ActivationMeter] = None,
        mailbox: Any = None,
        rank: Optional[int] = None,
        global_rank: Optional[int] = None,
    ) -> None:
        self.stages, self.workers = stages, workers
        # Across processes: this process's worker, whose list alone runs here; `mailbox` sends
        # what the other ranks' stages receive.
        self.rank, self.global_rank = rank, global_rank
        self.local_stages = [s for s in stages if rank is None or layout.ranks[s.index] == rank]
        self.schedule, self.layout = schedule, layout
        self.loss_stage = layout.loss_stage  # read by every task: the layout computes it
        self.loss = loss
        self.meter = meter if grad else None
        self.losses: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, dict[str, Any]] = {}  # per micro-batch, detached (train steps)
        self.micro_batches = micro_batches
        self.grad, self.checkpoint_stop = grad, checkpoint_stop
        # Whether any input the caller passed requires grad: if none does, no stage sends the
        # caller input gradients, and nothing waits for them.
        self.caller_grads = grad and any(
            isinstance(t, torch.Tensor) and t.requires_grad for batch in micro_batches for v in batch.values() for t in leaves_of(v)
        )
        self.shared = shared
        self.output_device, self.input_devices = output_device, input_devices
        self.context, self.batch_stats = context, batch_stats
        self.sink = len(stages)
        self.output_names = [name for s in stages for name, dsts in s.consumers.items() if self.sink in dsts]
        self.mailbox = mailbox if mailbox is not None else Mailbox(WAIT_TIMEOUT)
        self.saved: dict[tuple[int, int], _Saved] = {}
        # Per micro-batch whose loss hangs on the loss stage's own outputs, the loss (None where it
        # needs no gradient), until the stage's backward starts from it (see `_fuses`).
        self.fused: dict[int, Optional[torch.Tensor]] = {}
        self._fusable = self._loss_fusable()
        # Per action run: from its inputs in hand to its outputs made.
        self.timeline: list[Record] = []
        self.alive = [0] * len(stages)  # micro-batches each stage holds now (F to the end of B or W)
        self.most_alive = [0] * len(stages)
        self.backward_done = False
        self.cancelled = False
        self._turns: Optional[dict[tuple[str, int, int], float]] = None
        # The flags and rates the forwards run under, for the recomputes: `pipe.eval()` or a rate
        # changed before the backward must not change what a recompute computes.
        self.flags = [flags_of(s.flagged) if grad and checkpoint_stop else None for s in stages]
        self.randomness = [stage.draws() for stage in stages]
        self.hidden_randomness = [stage.draws_hidden() for stage in stages]
        # From the caller's generator, only where a stage may draw: a model without random ops
        # leaves it as the plain model does. The seed is only read: the generator moves past it
        # once a stage drew (after the forwards), so that a stage that only may (a module called
        # whole, whose inside the graph does not show) and does not, leaves it as the plain model
        # does, for a `loss_fn` that draws too. Across processes whether a stage drew is known on
        # its own rank only: the ranks settle it at the end of the step (fxpipe/distributed/across.py), so
        # that their generators stay alike (a DataLoader's shuffle after the step).
        drawing = any(self.randomness) or any(self.hidden_randomness)
        before = torch.get_rng_state() if drawing else None
        self.seed = draw_step_seed() if drawing else 0
        if before is not None:
            torch.set_rng_state(before)
        self._peeked = before is not None
        self.drew = False  # whether a stream of this process's stages drew (once the forwards ran)
        self._streams: list[TaskStream] = []  # the forwards' streams, until that is decided
        self._buffers_before: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._inputs_before: list[tuple[torch.Tensor, torch.Tensor]] = []  # the caller's, as written back
        self._attributes_before: Attributes = []
        self.param_leaves: list[Optional[list[torch.Tensor]]] = [None] * len(stages)
        self.view_swaps: list[Optional[list[tuple[dict[str, Any], str, torch.Tensor]]]] = [None] * len(stages)
        self.shared_views: list[Optional[list[torch.Tensor]]] = [None] * len(stages)
        self.weights: list[Optional[Weights]] = [None] * len(stages)
        self.grad_patterns: list[Optional[tuple[bool, ...]]] = [None] * len(stages)

    # -- driving ---------------------------------------------------------------------------
    def _run(self, actions: Sequence[Sequence[Action]]) -> None:
        """Hand each worker its actions, in order, and wait for all of them."""
        bodies: dict[str, Callable[[int, int], tuple[float, float]]] = {
            FORWARD: self._forward_task, RECOMPUTE: self._recompute_task, BACKWARD: self._backward_task,
            INPUT_GRAD: self._input_grad_task, WEIGHT_GRAD: self._weight_grad_task,
        }  # fmt: skip

        def task(action: Action) -> Callable[[], None]:
            body = bodies[action.kind]

            def run() -> None:
                error: Optional[BaseException] = None
                try:
                    if self.cancelled or self.mailbox.aborted:  # what it needs may never have been made
                        raise Aborted()
                    start, end = body(action.micro_batch, action.stage)
                    rank = self.layout.ranks[action.stage]
                    self.timeline.append(Record(action.kind, action.stage, action.micro_batch, rank, start, end))
                except BaseException as e:  # noqa: BLE001 - handed to the caller thread
                    error = e
                    self.mailbox.abort()
                group.finish(action, None if isinstance(error, Aborted) else error)

            return run

        if self.rank is not None or len(actions) == 1:  # this process runs one list: its own
            mine = actions[self.rank or 0]
            group = TaskGroup(len(mine))
            self._run_inline([task(action) for action in mine], group, self.rank or 0)
        else:
            group = TaskGroup(sum(map(len, actions)))
            for rank, acts in enumerate(actions):
                for action in acts:
                    self.workers.submit(rank, task(action))
            try:
                # Longer than a task's own wait: a task stuck on a value reports which one.
                group.wait(None if WAIT_TIMEOUT is None else 2 * WAIT_TIMEOUT)
            except BaseException:  # Ctrl-C, or a hang: stop the step before giving up on it
                self.cancel(group)
                raise
        self._take_the_seed_if_drawn()
        if group.errors:
            interrupted = [(a, e) for a, e in group.errors.items() if not isinstance(e, Exception)]
            action, error = min(interrupted or group.errors.items(), key=lambda item: self._turn(item[0]))
            self.saved.clear()
            self.fused.clear()
            if interrupted:  # a KeyboardInterrupt or SystemExit raised in a stage: as it is, as in one stage
                raise _marked(action, error)
            if isinstance(error, RemoteFailure):
                raise raised_here(error.failure) from error
            phase = "loss" if isinstance(error, _LossError) else _PHASES[action.kind]
            cause = error.__cause__ if isinstance(error, _LossError) and error.__cause__ is not None else error
            raise StageError(action.stage, action.micro_batch, phase, cause, rank=self.global_rank) from cause

    def _run_inline(self, tasks: list[Callable[[], None]], group: TaskGroup, rank: int = 0) -> None:
        """One worker: nothing to overlap, so the caller's thread runs its list itself, and no
        other thread is woken."""
        local = self.layout.on_rank(rank)
        with worker_state(), on_device(self.stages[local[0]].device if local else torch.device("cpu")):
            for run in tasks:
                run()
                interrupted = [(a, e) for a, e in group.errors.items() if not isinstance(e, Exception)]
                if interrupted:  # Ctrl-C: stop the step, and let the caller see it as it is
                    self.cancel()
                    raise _marked(*interrupted[0])

    def _take_the_seed_if_drawn(self) -> None:
        """Once the first actions ran (every forward): the caller's generator moves past the
        step's seed if a task drew from its stream."""
        if not self._peeked:
            return
        self._peeked = False
        self.drew = any(stream.drew() for stream in self._streams)
        self._streams = []
        if self.drew and self.rank is None:  # across processes, the ranks settle it together
            draw_step_seed()

    def _turn(self, action: Action) -> tuple[float, int]:
        """When an action runs in the schedule with unit costs, then its stage: of two failures,
        the one reported is the first by this order, whichever thread raised first (for GPipe,
        the clock-cycle order)."""
        if self._turns is None:
            timeline = simulate(self.schedule, self.layout, [StageCosts(1.0, 1.0)] * len(self.stages), self.checkpoint_stop).timeline
            self._turns = {(r.kind, r.stage, r.micro_batch): r.start for r in timeline.records}
        return self._turns[(action.kind, action.stage, action.micro_batch)], action.stage

    def cancel(self, group: Optional[TaskGroup] = None) -> None:
        """Stop this step: queued tasks do nothing, waiting ones stop waiting, and nothing it
        computed is kept. Waits (bounded) for the tasks still running."""
        self.cancelled = True
        self.mailbox.abort()
        self.saved.clear()
        self.fused.clear()
        if group is not None:
            group.finished.wait(WAIT_TIMEOUT or 60.0)

    def _post_inputs(self) -> None:
        # An input some stage writes in place (into the caller's tensor, after it ran) reaches the
        # other stages as a copy, so that what they saved, or recompute from, is what they read.
        written = {name for s in self.stages for name in s.written}
        for i, batch in enumerate(self.micro_batches):
            for stage in self.local_stages:
                for name in stage.inputs:
                    if stage.sources[name] == CALLER:
                        value = clone_tree(batch[name]) if name in written and name not in stage.written else batch[name]
                        self._post_forward(stage.index, i, name, value, stage.device, _requires_grad)

    def forward(self) -> list[dict[str, Any]]:
        """Run the schedule's leading forwards; returns, per micro-batch, the output values."""
        self._post_inputs()
        with self._buffers_put_back_on_error():
            self._run(self.schedule.forward_part())
        if self.batch_stats is not None:
            self.batch_stats.commit()
        names = self.output_names
        if self.rank is not None and self.rank != self.layout.ranks[self.loss_stage]:
            return []  # the outputs are on the rank of the last stage
        return [
            dict(zip(names, self.mailbox.take([("fwd", self.sink, i, n) for n in names])))
            for i in range(len(self.micro_batches))
        ]

    def train(self) -> list[dict[str, Any]]:
        """Run the whole schedule, the loss of each micro-batch computed in the pipeline; returns,
        per micro-batch, the gradients of the pipeline's inputs (when grad is on)."""
        self._post_inputs()
        with self._buffers_put_back_on_error():
            self._run(self.schedule.actions if self.grad else self.schedule.forward_part())
        if self.batch_stats is not None:
            self.batch_stats.commit()
        self.backward_done = True
        return [self._input_grads(i) for i in range(len(self.micro_batches))] if self.grad else []

    @contextmanager
    def _buffers_put_back_on_error(self) -> Iterator[None]:
        """The buffers this process's stages may write, as they were before the step; a step
        that fails puts them back, so that it changes nothing (as it adds nothing to `.grad`)."""
        seen: dict[int, torch.Tensor] = {}
        wholes: dict[int, nn.Module] = {}
        for j in self.layout.on_rank(self.rank) if self.rank is not None else range(len(self.stages)):
            seen.update({id(b): b for b in self.stages[j].writable_buffers.values() if not b.is_meta})
            wholes.update({id(m): m for m in self.stages[j].whole_modules})
        if sum(b.numel() * b.element_size() for b in seen.values()) <= PUT_BACK_LIMIT:
            self._buffers_before = [(b, b.detach().clone()) for b in seen.values()]
        self._attributes_before = attributes_of(list(wholes.values()))  # a counter a module called whole keeps
        try:
            yield
        except BaseException:
            self.put_back_buffers()
            raise

    def put_back_buffers(self) -> None:
        """What the step's forwards wrote into buffers and into the caller's inputs, and assigned
        to the attributes of modules called whole, undone."""
        with torch.no_grad():
            for buffer, values in self._buffers_before:
                buffer.copy_(values)
            for target, values in reversed(self._inputs_before):
                _copy_into(target, values)
        put_back_attributes(self._attributes_before)

    def backward(self, output_grads: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Run the rest of the schedule, given per micro-batch the gradients of the output
        values; returns, per micro-batch, the gradients of the pipeline's inputs."""
        if self.backward_done:
            raise RuntimeError(
                "backward through this pipeline step ran already and its saved state is freed.\n"
                "How to fix: run the forward again for a second backward (retain_graph is not supported). "
                "torch.autograd.functional.jacobian and hessian run one backward per output element: use the "
                "plain model for them."
            )
        self.backward_done = True
        for i, grads in enumerate(output_grads):
            self._post_output_grads(i, grads)
        self._run(self.schedule.rest())
        return [self._input_grads(i) for i in range(len(self.micro_batches))]

    def _post_output_grads(self, i: int, grads: dict[str, Any]) -> None:
        for stage in self.stages:
            for name, dsts in stage.consumers.items():
                if self.sink in dsts:
                    self.mailbox.put(("bwd", stage.index, i, name, self.sink), send(grads.get(name), stage.device))

    def _input_grads(self, i: int) -> dict[str, Any]:
        grads: dict[str, Any] = {}
        if not self.caller_grads:
            return grads
        for stage in self.local_stages:
            for name in stage.inputs:
                if stage.sources[name] == CALLER:
                    (grad,) = self.mailbox.take([("bwd", CALLER, i, name, stage.index)])
                    grads[name] = _add(grads.get(name), grad)
        return grads

    # -- tasks -----------------------------------------------------------------------------
    def _post_forward(
        self, dst: int, i: int, name: str, value: Any, device: torch.device, wants: Callable[[torch.Tensor], bool]
    ) -> None:
        leaf = self.grad and (dst != self.sink or self.loss is not None)
        self.mailbox.put(("fwd", dst, i, name), send(value, device, wants if leaf else None))

    def _param_views(self, stage: StageRuntime) -> list[tuple[dict[str, Any], str, torch.Tensor]]:
        """The stage's parameters for this step, with the slots they go into: a leaf per
        parameter (same memory), whose `.grad` autograd accumulates in place, as each gradient
        is made. Under the caller's autocast the stage reads an alias of it, so autocast casts every
        use alike (it caches casts of leaves only, for as long as the caller's region lasts) and a
        recompute matches its forward; otherwise the leaf itself, as the plain model reads its
        parameters (an alias is one more node per parameter in every backward). Autograd never
        reaches the parameters themselves: their `.grad` and hooks are the pipeline Function's to
        feed."""
        if not self.grad or not stage.params:
            return []
        swaps = self.view_swaps[stage.index]
        if swaps is None:
            with torch.enable_grad():
                leaves = [p.detach().requires_grad_() if p.requires_grad else p for p in stage.params]
                views = [self._as_read(leaf) for leaf in leaves]
            if stage.compiled is not None and stage.compiled.static_outputs:
                _own_grads([leaf for leaf in leaves if leaf.requires_grad])
            swaps = [(table, attr, view) for view, slots in zip(views, stage.param_slots) for table, attr in slots]
            self.param_leaves[stage.index], self.view_swaps[stage.index] = leaves, swaps
        return swaps

    def _shared_views(self, stage: StageRuntime) -> list[torch.Tensor]:
        """The stage's copies of shared parameters as it reads them, made once per step: like
        its own parameters, aliases of them under the caller's autocast (it caches casts of leaves
        only), else the copies themselves."""
        views = self.shared_views[stage.index]
        if views is None:
            with torch.enable_grad():
                views = [self._as_read(c) for c in self.shared[stage.index]]
            if stage.compiled is not None and stage.compiled.static_outputs:
                _own_grads([c for c in self.shared[stage.index] if c.requires_grad])
            self.shared_views[stage.index] = views
        return views

    def _as_read(self, leaf: torch.Tensor) -> torch.Tensor:
        """What a stage reads for a leaf of its parameters or shared copies: an alias of it under
        the caller's autocast, else the leaf itself (see `_param_views`). An alias's backward
        passes its gradient on as it is: a sparse one (an embedding's) too."""
        return torch.ops.aten.alias.default(leaf) if leaf.requires_grad and self.context.autocast else leaf

    def _call(self, stage: StageRuntime, i: int, inputs: list[Any], buffers: Optional[dict[str, torch.Tensor]] = None) -> tuple[Any, ...]:
        args = [*inputs, *self._shared_views(stage)]
        views = self._param_views(stage)
        if stage.compiled is None:
            forward = stage.module.forward  # type: ignore[attr-defined]
        else:
            forward = stage.compiled.runner(self.randomness[stage.index], self.hidden_randomness[stage.index], bool(views))
        if self.context.plain and not self.randomness[stage.index] and not views and buffers is None:
            return forward(*args)
        with ExitStack() as stack:
            self.context.enter(stack)
            if self.randomness[stage.index]:
                stream = TaskStream(self.seed, i, stage.index)
                if self._peeked:
                    self._streams.append(stream)
                stack.enter_context(task_stream(stream))
                if self.hidden_randomness[stage.index]:
                    stack.enter_context(TaskRandomness(stream))
            if views:
                stack.enter_context(swapped_slots(views))
            if buffers is not None:
                stack.enter_context(swapped_state(stage.module, buffers))  # type: ignore[arg-type]
            return forward(*args)

    def _versions_read(self, stage: StageRuntime, kept: list[Any]) -> list[tuple[str, torch.Tensor, int]]:
        """The caller's tensors a checkpointed forward read (not copies), with their versions."""
        return [
            (name, t, t._version) for name, value in zip(stage.inputs, kept)
            if stage.sources[name] == CALLER and name not in stage.written for t in leaves_of(value) if isinstance(t, torch.Tensor)
        ]  # fmt: skip

    def _params_requiring_grad(self, stage: int) -> tuple[bool, ...]:
        """Which of the stage's parameters and shared copies require grad (once per step)."""
        found = self.grad_patterns[stage]
        if found is None:
            found = self.grad_patterns[stage] = tuple(p.requires_grad for p in [*self.stages[stage].params, *self.shared[stage]])
        return found

    def _params_read(self, stage: int) -> list[torch.Tensor]:
        """The stage's parameters, and its copies of shared ones (a copy on the parameter's
        device is the parameter's memory: a write to one is seen by the other)."""
        return [*self.stages[stage].params, *(t for t in self.shared[stage] if t.requires_grad)]

    def _upstream(self, stage: int) -> list[torch.Tensor]:
        """Every parameter and caller input requiring grad that stages up to `stage` read (the
        stages run in the graph's order: what comes later cannot feed it)."""
        found: dict[int, torch.Tensor] = {id(p): p for s in self.stages[: stage + 1] for p in s.params if p.requires_grad}
        found.update((id(t), t) for copies in self.shared for t in copies if isinstance(t, torch.Tensor) and t.requires_grad)
        leaves = [t for batch in self.micro_batches for v in batch.values() for t in leaves_of(v)]
        found.update((id(t), t) for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad)
        return list(found.values())

    # Each task returns when its work started (after what it waits for was in hand) and ended
    # (before it sends what it made: a receiver may start at once).
    def _forward_task(self, i: int, j: int) -> tuple[float, float]:
        stage = self.stages[j]
        inputs = self.mailbox.take([("fwd", j, i, name) for name in stage.inputs])  # (1)
        start = time.perf_counter()
        checkpointed = self.grad and i < self.checkpoint_stop
        fused = not checkpointed and self._fuses(i, j, inputs)
        if checkpointed:
            buffers = {name: b.clone() for name, b in stage.writable_buffers.items()} or None
            attributes = attributes_of(stage.whole_modules) if stage.whole_modules else None
            # Which outputs require grad is learnt by the first checkpointed forward of each
            # pattern of inputs and parameters requiring grad, run under grad (see `_differentiable_outputs`).
            pattern = (tuple(t.requires_grad for v in inputs for t in leaves_of(v) if isinstance(t, torch.Tensor)), self._params_requiring_grad(j))
            known = stage.output_grads.get(pattern)
            with torch.no_grad() if known is not None else torch.enable_grad(), checkpointing(), collecting(self.batch_stats):  # (2)
                results = self._call(stage, i, inputs)
            # The caller's tensors are about to be written: the recompute needs them as they were.
            kept = [clone_tree(v) if n in stage.written else v for n, v in zip(stage.inputs, inputs)]
            versions = [p._version for p in self._params_read(j)]
            self._keep(i, j, _Saved(kept, None, buffers, attributes=attributes, versions=versions, input_versions=self._versions_read(stage, kept)))
            if self.meter is not None:
                self.meter.add(i, j, [t for v in kept for t in leaves_of(v)])
            outputs = self._write_back(stage, i, results)
            if known is None:
                known = stage.output_grads[pattern] = [t.requires_grad for v in outputs for t in leaves_of(v) if isinstance(t, torch.Tensor)]
            wants = _differentiable_outputs(outputs, known)
        else:
            with torch.set_grad_enabled(self.grad), collecting(self.batch_stats), self._metered(i, j):
                results = self._call(stage, i, inputs)
            outputs = self._write_back(stage, i, results)
            if self.grad:
                self._keep(i, j, _Saved(inputs, outputs))
            wants = _requires_grad
        if self.grad and stage.stored:
            refuse_gradients_through(stage.stored, self._upstream(j))
        end = time.perf_counter()
        for name, value in zip(stage.outputs, outputs):  # (3)
            posted = wants
            if name in stage.state_outputs:
                copies = map_tensors(torch.clone, value)
                posted = _as_their_originals(wants, value, copies)
                value = copies
            for dst in stage.consumers[name]:
                if fused and dst == self.sink:  # as it is: the loss's graph goes on from the stage's
                    self.mailbox.put(("fwd", dst, i, name), Parcel(value, self.output_device, []))
                    continue
                device = self.output_device if dst == self.sink else self.stages[dst].device
                self._post_forward(dst, i, name, value, device, posted)
        if self.loss is not None and j == self.loss_stage:
            self._loss_task(i, fused)  # its gradients go to stages that wait for them
            end = time.perf_counter()
        return start, end

    def _keep(self, i: int, j: int, saved: _Saved) -> None:
        self.saved[(i, j)] = saved
        self.alive[j] += 1
        self.most_alive[j] = max(self.most_alive[j], self.alive[j])

    def _release(self, i: int, j: int) -> _Saved:
        self.alive[j] -= 1
        if self.meter is not None:
            self.meter.release(i, j)
        return self.saved.pop((i, j))

    def _metered(self, i: int, j: int) -> ContextManager[None]:
        return self.meter.saving(i, j) if self.meter is not None else nullcontext()

    def _loss_task(self, i: int, fused: bool) -> None:
        """The micro-batch's loss, once all its outputs are in: the gradients of the outputs go
        back to the stages that made them; or, `fused`, the loss stays for the loss stage's
        backward to start from."""
        names = self.output_names
        values = dict(zip(names, self.mailbox.take([("fwd", self.sink, i, n) for n in names])))
        assert self.loss is not None
        try:
            with torch.set_grad_enabled(self.grad), ExitStack() as stack:
                self.context.enter(stack)
                loss = self.loss(i, values)
                grads = value_grads(loss, values) if self.grad and not fused else {}
        except Exception as e:
            raise _LossError() from e
        self.losses[i] = loss.detach()
        self.outputs[i] = {name: map_tensors(torch.Tensor.detach, v) for name, v in values.items()}
        if fused:
            self.fused[i] = loss if loss.requires_grad else None
        elif self.grad:
            self._post_output_grads(i, grads)

    def _loss_fusable(self) -> bool:
        """Whether a micro-batch's loss can hang on the loss stage's own outputs (see `_fuses`):
        every output comes from that stage, on the device the outputs go to, and not in a CUDA
        graph's buffers (the next replay writes them before the backward reads them)."""
        if self.loss is None or not self.grad:
            return False
        j = self.loss_stage
        makers = {s.index for s in self.stages for dsts in s.consumers.values() if self.sink in dsts}
        stage = self.stages[j]
        static = stage.compiled is not None and stage.compiled.static_outputs
        return makers == {j} and stage.device == self.output_device and not static

    def _fuses(self, i: int, j: int, inputs: list[Any]) -> bool:
        """Whether micro-batch `i`'s loss is computed on stage `j`'s outputs as they are, so that
        the stage's backward starts from the loss, in one autograd call as `loss.backward()` is
        in the plain model, rather than from output gradients a call of its own made first (on
        the critical path of every schedule, the last stage's, once per micro-batch). Not where
        the stage recomputes (the loss would read outputs the recompute replaces), nor where its
        backward is split into I and W (W takes the stage's weights alone, not what else the
        loss reaches), nor where an input is not a leaf (the backward names what it stops at,
        which would leave out what else the loss reaches)."""
        return (
            self._fusable and j == self.loss_stage and (j, i) not in self.schedule.split
            and all(t.is_leaf for v in inputs for t in leaves_of(v) if isinstance(t, torch.Tensor) and t.requires_grad)
        )  # fmt: skip

    def _write_back(self, stage: StageRuntime, i: int, results: tuple[Any, ...]) -> tuple[Any, ...]:
        """Copy what the stage wrote into its inputs from the caller back into the caller's
        tensors (this micro-batch's slice of them); returns the stage's outputs proper."""
        outputs, written = results[: len(stage.outputs)], results[len(stage.outputs) :]
        for name, value in zip(stage.written, written):
            if stage.sources[name] == CALLER:
                # The stage wrote its own copy (cloned on entry, `_version` 0): a leaf it changed
                # has a version above 0.
                # (An inference tensor keeps no version: it is copied back whether written or not.)
                pairs = [(t, final) for t, final in zip(leaves_of(self.micro_batches[i][name]), leaves_of(value))
                         if isinstance(t, torch.Tensor) and t is not final and (final.is_inference() or final._version > 0)]  # fmt: skip
                if self.grad:
                    _refuse_written_leaves(name, [t for t, _ in pairs])
                for target, final in pairs:
                    self._inputs_before.append((target, target.detach().clone()))  # a failed step puts it back
                    _copy_into(target, final)
        return outputs

    def _recompute_task(self, i: int, j: int) -> tuple[float, float]:  # (5)
        start = time.perf_counter()
        stage, saved = self.stages[j], self.saved[(i, j)]
        _refuse_parameters_written_since(self._params_read(j), saved.versions)
        _refuse_inputs_written_since(i, saved.input_versions)
        flags = self.flags[j]
        with torch.enable_grad(), recomputing(), attributes_kept(stage.whole_modules, saved.attributes), self._metered(i, j), \
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
                    total = _add(total, next(received))
            grads.append(total)
        return grads

    def _received(self, i: int, j: int, saved: _Saved) -> tuple[float, list[torch.Tensor], list[torch.Tensor]]:
        """(4) for B and I: the output gradients, once in hand (the action starts then), with the
        outputs that take one; the stage lets go of its outputs."""
        grads = self._output_grads(i, j)
        start = time.perf_counter()
        assert saved.outputs is not None, "a checkpointed micro-batch's backward runs after its recompute"
        tensors, grad_tensors = _differentiable(saved.outputs, grads)
        saved.outputs = None
        loss = self.fused.pop(i, None) if j == self.loss_stage else None
        if loss is not None:
            tensors.append(loss)
            grad_tensors.append(torch.ones_like(loss))
        return start, tensors, grad_tensors

    def _backward_task(self, i: int, j: int) -> tuple[float, float]:
        stage, saved = self.stages[j], self.saved[(i, j)]
        start, tensors, grad_tensors = self._received(i, j, saved)
        self._release(i, j)
        input_grads, _ = self._stage_gradients(stage, saved.inputs, tensors, grad_tensors)  # (6)
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
        input_grads, pending = self._stage_gradients(stage, saved.inputs, tensors, grad_tensors, split=split)
        saved.pending = pending if pending is not None else PendingWeights()
        del tensors, grad_tensors
        end = time.perf_counter()
        self._send_input_grads(stage, i, input_grads)
        return start, end

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

    def _stage_gradients(
        self, stage: StageRuntime, inputs: list[Any], tensors: list[torch.Tensor], grad_tensors: list[torch.Tensor], split: bool = False
    ) -> tuple[list[Any], Optional[PendingWeights]]:
        """Gradients of the stage's inputs (returned, shaped like them). Those of its parameter
        views and shared copies accumulate in their `.grad` over the step's micro-batches, added
        by autograd as each is made (while it is still in cache); with `split`, later, by W,
        from what is returned with the input gradients."""
        flat_inputs = [([value], None) if isinstance(value, torch.Tensor) else tree_flatten(value) for value in inputs]
        leaves = [t for leaves, _ in flat_inputs for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        pending = None
        compiled = stage.compiled.backward() if stage.compiled is not None else nullcontext()
        with raw_grads(leaves) as raw, compiled:  # sent back in the layout the producer's backward would get
            if split:
                pending = backward_inputs(tensors, grad_tensors, leaves, self._weights(stage))
            elif tensors and (wanted := [*leaves, *self._weights(stage).tensors]):
                # Every leaf the stage's graph reaches that requires grad is wanted (compile refuses
                # loose ones), so autograd needs `inputs=`, whose graph walk costs ~10% of a small
                # task, only to stop at an input that is not a leaf (a copy kept for a recompute).
                torch.autograd.backward(tensors, grad_tensors, inputs=None if all(t.is_leaf for t in leaves) else wanted)
        grads = [
            raw.of(leaves_[0]) if spec is None else tree_unflatten([raw.of(t) for t in leaves_], spec)
            for leaves_, spec in flat_inputs
        ]
        if stage.compiled is not None and stage.compiled.static_outputs:
            grads = own_values(grads)
        return grads, pending

    def take_parameter_grads(self, stage: int) -> list[Optional[torch.Tensor]]:
        """The step's gradient of each of the stage's own parameters (None: none reached it),
        handed over: the step's leaves let go of them, so that autograd can move them into the
        parameters' `.grad` as they are instead of copying them."""
        leaves = self.param_leaves[stage]
        if leaves is None:
            return [None] * len(self.stages[stage].params)
        grads = []
        for leaf in leaves:
            grads.append(leaf.grad)
            if leaf.requires_grad:  # the step's own leaf (a frozen parameter is its own leaf)
                leaf.grad = None
        return grads

    def shared_grads(self, stage: int) -> list[Optional[torch.Tensor]]:
        """The step's gradient of the stage's copy of each shared tensor."""
        return [c.grad if c.requires_grad else None for c in self.shared[stage]]


def _own_grads(leaves: Sequence[torch.Tensor]) -> None:
    """For leaves a CUDA graph's backward reaches: the first gradient each receives is copied
    before autograd keeps it as `.grad` (later ones are added into that), where autograd would
    keep it as it came, in the graph's static memory, which the next replay writes."""
    for leaf in leaves:
        leaf.register_hook(partial(_copied_if_first, weakref.ref(leaf)))


def _copied_if_first(leaf: "weakref.ref[torch.Tensor]", grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    held = leaf()
    return grad.clone() if grad is not None and held is not None and held.grad is None else grad


def _requires_grad(t: torch.Tensor) -> bool:
    return t.requires_grad


def _as_their_originals(wants: Callable[[torch.Tensor], bool], originals: Any, copies: Any) -> Callable[[torch.Tensor], bool]:
    """`wants` asked of each copy's original."""
    pairs = {id(c): o for c, o in zip(leaves_of(copies), leaves_of(originals))}
    return lambda t: wants(pairs.get(id(t), t))


def _differentiable_outputs(outputs: Sequence[Any], known: list[bool]) -> Callable[[torch.Tensor], bool]:
    """Which of a checkpointed forward's outputs require grad, as a forward under grad made them:
    under no_grad, nothing tells. Taking every floating-point one to (as before) gave the blocks
    of a reentrant `torch.utils.checkpoint` on a value that requires none gradients the plain
    model does not give them."""
    leaves = [t for v in outputs for t in leaves_of(v) if isinstance(t, torch.Tensor)]
    flags = dict(zip(map(id, leaves), known))
    return lambda t: flags.get(id(t), False)


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


def _differentiable(outputs: Sequence[Any], grads: Sequence[Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The (output, gradient) pairs that autograd can take: outputs that require grad and got one."""
    tensors, grad_tensors = [], []
    for output, grad in zip(outputs, grads):
        if grad is None:
            continue
        for t, g in zip(leaves_of(output), leaves_of(grad)):
            if isinstance(t, torch.Tensor) and t.requires_grad and g is not None:
                tensors.append(t)
                grad_tensors.append(g)
    return tensors, grad_tensors


def _refuse_written_leaves(name: str, written: list[torch.Tensor]) -> None:
    """Under grad mode, an input written in place that requires grad (a micro-batch's slice of
    it): a leaf, or a view of one, as the plain model's write refuses it; any other, since the
    pipeline writes the caller's tensor outside autograd, and a gradient through its value after
    the call would reach what it was before the write."""
    for t in written:
        base = t._base if t._is_view() and t._base is not None else t
        if t.requires_grad and base.is_leaf:
            raise RuntimeError(
                f"the model writes its input {name!r} in place, and it is a leaf that requires grad (or a view of "
                "one): PyTorch refuses that (\"a leaf Variable that requires grad is being used in an in-place "
                "operation\").\nHow to fix: pass a copy (x.clone()), or write a copy of the input in the model."
            )
        if t.requires_grad:
            raise RuntimeError(
                f"the model writes its input {name!r} in place, and it requires grad: the pipeline writes the "
                "caller's tensor outside autograd, so a gradient through its value after the call would miss the "
                "write.\nHow to fix: write a copy of the input in the model (x = x * 2 in place of x.mul_(2)); or, "
                "when the input's gradient is not needed, pass x.detach(), or call the pipeline under torch.no_grad()."
            )
