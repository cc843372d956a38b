"""One pipeline step: the executor that runs a schedule's actions, and the values between them.

Each worker runs its list of actions (fxpipe/schedules/actions.py) in order; an action waits in the
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

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from fxpipe.compiled.program import StageRuntime
from fxpipe.core.edges import CALLER
from fxpipe.core.failures import RemoteFailure
from fxpipe.core.microbatch import clone_tree, leaves_of
from fxpipe.core.randomness import TaskStream, Unseen, draw_step_seed
from fxpipe.runtime.batchnorm import BatchStatistics, collecting_now
from fxpipe.runtime.checkpoint import flags_of
from fxpipe.runtime.context import CallerContext, worker_state
from fxpipe.runtime.devices import Aborted, Mailbox, on_device
from fxpipe.runtime.memory import ActivationMeter
from fxpipe.runtime.rollback import Rollback
from fxpipe.runtime.saved import Saved
from fxpipe.runtime.slices import SliceGrid
from fxpipe.runtime.stage_error import StageError, marked, phase_and_cause, raised_here
from fxpipe.runtime.backward_tasks import BackwardTasks, add_grads
from fxpipe.runtime.tasks import LossFn, requires_grad
from fxpipe.runtime.versions import Versions
from fxpipe.runtime.weight_grad import Weights
from fxpipe.runtime.worker import TaskGroup, Workers
from fxpipe.schedules.actions import BACKWARD, FORWARD, INPUT_GRAD, RECOMPUTE, WEIGHT_GRAD, Action, Layout, Schedule
from fxpipe.schedules.simulate import StageCosts, simulate
from fxpipe.schedules.timeline import Record

# The body of each kind of action: a method's name, so that a step holds no reference to itself.
_BODIES = {
    FORWARD: "_forward_task", RECOMPUTE: "_recompute_task", BACKWARD: "_backward_task",
    INPUT_GRAD: "_input_grad_task", WEIGHT_GRAD: "_weight_grad_task",
}  # fmt: skip

# Seconds a task or the caller waits for a value before it reports a hang; None waits forever.
# Tests set a bound, so that a deadlock fails in seconds.
WAIT_TIMEOUT: Optional[float] = None


class Step(BackwardTasks):
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
        weights: Optional[Versions] = None,
        batch: int = 0,
        slices: Optional[SliceGrid] = None,
        sizes: Optional[Sequence[int]] = None,
    ) -> None:
        self.stages, self.workers = stages, workers
        self.sizes = sizes  # the micro-batches' samples, where known (for the errors)
        # Slices of a sequence (fxpipe/runtime/slices.py): the micro-batches are its slices.
        self.slices, self.carry_in, self.carry_made, self.carry_grads = slices, {}, {}, {}
        # Across processes: this process's worker, whose list alone runs here; `mailbox` sends
        # what the other ranks' stages receive.
        self.rank, self.global_rank = rank, global_rank
        # Steps that overlap (2BW): batch `batch` of the loop, its weights' versions kept apart
        # (fxpipe/runtime/versions.py); each stage's copies of tied weights made at its first forward.
        self.versions, self.batch = weights, batch
        self.copies_made = [weights is None] * len(stages)
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
        self.saved: dict[tuple[int, int], Saved] = {}
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
        draws = [stage.draws() for stage in stages]
        self.randomness = [visible for visible, _ in draws]
        self.hidden_randomness = [hidden for _, hidden in draws]
        # From the caller's generator, only where a stage may draw: a model without random ops
        # leaves it as the plain model does. The seed is only read: the generator moves past it
        # once a stage drew (after the forwards), so that a stage that only may (a module called
        # whole, whose inside the graph does not show) and does not, leaves it as the plain model
        # does, for a `loss_fn` that draws too. Across processes whether a stage drew is known on
        # its own rank only: the ranks settle it at the end of the step (fxpipe/distributed/rank_call.py), so
        # that their generators stay alike (a DataLoader's shuffle after the step).
        # Overlapping steps (2BW) take their seeds at once, in order: the next step starts before
        # this one knows whether it drew, and must not peek the same seed.
        drawing = any(self.randomness) or any(h is not Unseen.NOWHERE for h in self.hidden_randomness)
        before = torch.get_rng_state() if drawing and weights is None else None
        self.seed = draw_step_seed() if drawing else 0
        if before is not None:
            torch.set_rng_state(before)
        self._peeked = before is not None
        self.drew = False  # whether a stream of this process's stages drew (once the forwards ran)
        self._streams: list[TaskStream] = []  # the forwards' streams, until that is decided
        self.rollback = Rollback()
        self.param_leaves: list[Optional[list[torch.Tensor]]] = [None] * len(stages)
        self.view_swaps: list[Optional[list[tuple[dict[str, Any], str, torch.Tensor]]]] = [None] * len(stages)
        self.shared_views: list[Optional[list[torch.Tensor]]] = [None] * len(stages)
        self.weights: list[Optional[Weights]] = [None] * len(stages)
        self.grad_patterns: list[Optional[tuple[bool, ...]]] = [None] * len(stages)
        # What a task need not enter (see `StageTasks._run_forward`): the caller's state is the
        # worker's; no BatchNorm statistics to collect, here or in a step around this one (a
        # pipeline called inside another's stage, on its thread); no memory to meter.
        self.bare_forward = context.plain and batch_stats is None and self.meter is None and not collecting_now()

    # -- driving ---------------------------------------------------------------------------
    def _run(self, actions: Sequence[Sequence[Action]]) -> None:
        """Hand each worker its actions, in order, and wait for all of them."""
        if self.rank is not None or len(actions) == 1:  # this process runs one list: its own
            mine = actions[self.rank or 0]
            group = TaskGroup(len(mine))
            self._run_inline([self.task(action, group) for action in mine], group, self.rank or 0)
        else:
            group = TaskGroup(sum(map(len, actions)))
            lists = [[self.task(action, group) for action in acts] for acts in actions]
            for rank, tasks in enumerate(lists):
                self.workers.submit(rank, tasks)
            try:
                # Longer than a task's own wait: a task stuck on a value reports which one.
                group.wait(None if WAIT_TIMEOUT is None else 2 * WAIT_TIMEOUT)
            except BaseException:  # Ctrl-C, or a hang: stop the step before giving up on it
                self.cancel(group)
                raise
        self.settle(group)

    def task(self, action: Action, group: TaskGroup) -> Callable[[], None]:
        """What a worker runs for `action`: its body, timed, its error (if any) kept in `group`
        and the step's mailbox aborted, so that no other task waits for ever."""
        body: Callable[[int, int], tuple[float, float]] = getattr(self, _BODIES[action.kind])

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

    def settle(self, group: TaskGroup) -> None:
        """Once `group`'s tasks ran: the caller's generator moved past the step's seed if a
        stream drew, the compiled stages' warnings said (on the caller's thread), and the first
        failure (in the schedule's order) raised as a StageError."""
        self._take_the_seed_if_drawn()
        for stage in self.stages:
            if stage.compiled is not None:
                stage.compiled.report()
        if group.errors:
            interrupted = [(a, e) for a, e in group.errors.items() if not isinstance(e, Exception)]
            action, error = min(interrupted or group.errors.items(), key=lambda item: self._turn(item[0]))
            self.saved.clear()
            self.fused.clear()
            if interrupted:  # a KeyboardInterrupt or SystemExit raised in a stage: as it is, as in one stage
                raise marked(action, error)
            if isinstance(error, RemoteFailure):
                raise raised_here(error.failure) from error
            phase, cause = phase_and_cause(action, error)
            alone = self.sizes is not None and len(self.sizes) > 1 and self.sizes[action.micro_batch] == 1
            raise StageError(
                action.stage, action.micro_batch, phase, cause, rank=self.global_rank, micro_batches=len(self.micro_batches),
                one_of=sum(self.sizes) if alone and self.sizes is not None else 0,
            ) from cause

    def _run_inline(self, tasks: list[Callable[[], None]], group: TaskGroup, rank: int = 0) -> None:
        """One worker: nothing to overlap, so the caller's thread runs its list itself, and no
        other thread is woken."""
        local = self.layout.on_rank(rank)
        with worker_state(), on_device(self.stages[local[0]].device if local else torch.device("cpu")):
            for run in tasks:
                run()
                if not group.errors:
                    continue
                interrupted = [(a, e) for a, e in group.errors.items() if not isinstance(e, Exception)]
                if interrupted:  # Ctrl-C: stop the step, and let the caller see it as it is
                    self.cancel()
                    raise marked(*interrupted[0])

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
                        self._post_forward(stage.index, i, name, value, stage.device, requires_grad)

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
        return self._caller_input_grads() if self.grad else []

    @contextmanager
    def _buffers_put_back_on_error(self) -> Iterator[None]:
        """What this process's stages may write, as it was before the step; a step that fails
        puts it back (fxpipe/runtime/rollback.py)."""
        self.rollback.keep(self.local_stages)
        try:
            yield
        except BaseException as error:
            try:
                self.put_back_buffers()
            except Exception as failure:  # noqa: BLE001 - the step's own error is the one to see
                error.add_note(f"What the failed step wrote could not all be put back: {type(failure).__name__}: {failure}")
            raise

    def put_back_buffers(self) -> None:
        """What the step's forwards wrote into buffers and into the caller's inputs, and assigned
        to the attributes of modules called whole, undone."""
        self.rollback.put_back()

    def backward(self, output_grads: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Run the rest of the schedule, given per micro-batch the gradients of the output
        values; returns, per micro-batch, the gradients of the pipeline's inputs."""
        if self.backward_done:
            raise RuntimeError(
                "backward through this pipeline step ran already and its saved state is freed.\n"
                "How to fix: run the forward again for a second backward (retain_graph is not supported). "
                "torch.autograd.functional.jacobian and hessian, and torch.autograd.gradcheck, run one backward per "
                "output element: use the plain model for them."
            )
        self.backward_done = True
        for i, grads in enumerate(output_grads):
            self._post_output_grads(i, grads)
        self._run(self.schedule.rest())
        return self._caller_input_grads()

    def _caller_input_grads(self) -> list[dict[str, Any]]:
        """Per piece the caller's inputs were split into (`Call.caller_micro_batches`: the
        micro-batches, or the rows their slices were cut from), the gradients of those inputs."""
        grads = [self._input_grads(i) for i in range(len(self.micro_batches))]
        return self.slices.join_input_grads(grads) if self.slices is not None else grads

    def _input_grads(self, i: int) -> dict[str, Any]:
        grads: dict[str, Any] = {}
        if not self.caller_grads:
            return grads
        for stage in self.local_stages:
            for name in stage.inputs:
                if stage.sources[name] == CALLER:
                    (grad,) = self.mailbox.take([("bwd", CALLER, i, name, stage.index)])
                    grads[name] = add_grads(grads.get(name), grad)
        return grads

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

