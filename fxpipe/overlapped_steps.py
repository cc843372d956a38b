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

Across processes each rank runs its stage's list on a thread of its own, and the ranks agree on
each batch before it runs and on its end before any rank updates on it
(fxpipe/distributed/loop_ranks.py): a failure on one rank stops every rank at the same batch.
"""
from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterator, Optional, Sequence

import torch
import torch.optim.optimizer as every_optimizer
from torch.utils._pytree import tree_flatten

from fxpipe.compiled.program import OtherCall, Program
from fxpipe.compiled.stage_compile import drawing_between_compiles
from fxpipe.core.failures import Failure, RemoteFailure
from fxpipe.core.hooks import gradient_hooks, steps_after_accumulating
from fxpipe.core.own_code import caller_stacklevel
from fxpipe.core.randomness import default_generator_held, generator_put_back_on_error
from fxpipe.core.wording import listed
from fxpipe.distributed.loop_ranks import LoopRanks, TiedSums, read_or_failed, summed_tied, tied_parts
from fxpipe.distributed.rank_call import call_signature, first_line
from fxpipe.guards import refuse_without_gradients
from fxpipe.loop_changes import ModelAsFound
from fxpipe.runtime.batch_loss import loss_and_outputs, write_targets_back
from fxpipe.runtime.loss_state import LossStateKept, calls_of_loss_fn
from fxpipe.runtime.call import Call
from fxpipe.runtime.devices import Aborted
from fxpipe.runtime.grads import accumulate, parameter_grads
from fxpipe.runtime.losses import LeafGrads
import fxpipe.runtime.step as steps
from fxpipe.runtime.step import Step
from fxpipe.runtime.stage_error import StageError, phase_and_cause
from fxpipe.runtime.versions import Versions, storage_bytes
from fxpipe.runtime.worker import TaskGroup, Workers
from fxpipe.schedules.actions import Action, checkpoint_stop
from fxpipe.schedules.slices import SliceSpec
from fxpipe.schedules.timeline import Record
from fxpipe.schedules.two_bw import UPDATE, refuse_too_few_micro_batches, segment, two_bw

# The Pipeline the loop runs (fxpipe/pipeline.py, which imports this module: not imported here).
PipelineLike = Any

Batch = tuple[int, tuple[Any, ...], dict[str, Any], Any]  # index, args, kwargs, target
Hook = Optional[Callable[[], Any]]


# A batch's tensors as it was read: each with its name and its version then.
Read = list[tuple[str, torch.Tensor, int]]


@dataclass
class _Started:
    """A batch read, its call made and its step built: nothing of it runs yet."""

    index: int
    call: Call
    step: Step
    target: Any
    read: Read


@dataclass
class _InFlight:
    call: Call
    step: Step
    group: TaskGroup
    target: Any
    read: Read


class _Overlap:
    """The state of one loop: its steps in flight, what each worker was given, the updates."""

    def __init__(self, pipe: PipelineLike, optimizer: torch.optim.Optimizer, loss_fn: Any, reduction: str) -> None:
        self.pipe, self.optimizer, self.loss_fn, self.reduction = pipe, optimizer, loss_fn, reduction
        self.program = pipe._programs[True]
        self.layout = self.program.layout
        refuse_too_few_micro_batches(self.layout, pipe._chunks)
        # Every batch runs as many micro-batches: its rows' slices. With sequence_chunks='auto',
        # the count the first batch is cut into, kept for the loop (`_fix_slices`).
        self.spec: Optional[SliceSpec] = pipe._compiled.slicing
        self._fix_slices(1 if self.spec is None else self.spec.count() or 1)
        placement = pipe._compiled.placement
        # Across processes: this rank's stage alone, on a thread of its own.
        self.ranks = None if placement is None else LoopRanks(pipe._across(), placement)
        self.here = None if self.ranks is None else [s for s, rank in enumerate(self.layout.ranks) if rank == self.ranks.me]
        here = self.here
        self.local = list(range(self.layout.stages)) if here is None else here
        self.versions = Versions(self.program, optimizer, steps.WAIT_TIMEOUT, here)  # read now: tests bound it
        self.refused: Optional[BaseException] = None  # across processes, said at the first meeting (`next_batch`)
        try:
            self._take_the_model()
        except Exception as error:  # (a parameter replaced on this rank alone): every rank raises it at once
            if self.ranks is None:
                raise
            self.refused = error
        self.workers = pipe._workers if here is None else Workers([self.program.stages[here[0]].device], name="fxpipe-2bw")
        self.steps: dict[int, _InFlight] = {}
        self.updates: dict[int, TaskGroup] = {}
        self.given = [0] * self.layout.workers
        self.read = 0  # batches read so far
        self.finished = 0  # batches whose loss was given
        self.held: Optional[Program] = None
        # The model as the loop's first batch finds it (`_after_reading`): what hooks may not change.
        self.found = ModelAsFound(pipe, self.program)
        self.records: list[Record] = []  # what ran, for pipe.timeline()
        # The caller's generator before and after reading each batch (its iterable and its step's
        # seed draw there): a batch a stopped loop drops is read as if never (`_unread_dropped`).
        self.generator: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # What the loss object keeps, as the loop found it: each batch calls loss_fn once per
        # micro-batch and once more, and state it keeps is refused (fxpipe/runtime/loss_state.py).
        self.loss_state = LossStateKept(loss_fn, calls=calls_of_loss_fn(pipe._chunks))
        # The gradients the last batch's update will step on, as `after_backward` left them:
        # each parameter's `.grad`, the gradient's version and memory (`.grad.data = ...` swaps
        # it), and the parameter's own version (no update runs before the caller's code ends).
        self.grads_held: list[tuple[torch.nn.Parameter, Optional[torch.Tensor], tuple[int, int], int]] = []
        self.checked = -1  # the last batch whose update `after_the_callers_code` held what it steps on for

    def _take_the_model(self) -> None:
        """The stages built again on what the model holds now, where it holds other tensors than
        they were built on (a parameter added since compiling, or by the iterable before its first
        batch), and the versions kept of theirs: else the versions would update the old ones."""
        self.pipe._held_program()
        if self.pipe._programs[True] is not self.program:
            self.program = self.pipe._programs[True]
            self.versions = Versions(self.program, self.optimizer, steps.WAIT_TIMEOUT, self.here)

    def _fix_slices(self, per_row: int) -> None:
        self.slices = per_row
        self.m = self.pipe._chunks * per_row
        self.checkpointed = checkpoint_stop(self.pipe._checkpoint, self.m)

    # -- submitting -----------------------------------------------------------------------
    def next_batch(self, batches: Iterator[Batch]) -> Optional[_Started]:
        """The next batch, its call made and its step built (nothing runs yet), or None at the
        end; across processes, every rank agrees on it first (or every rank raises)."""
        index, started, failure = self.read, None, None
        with generator_put_back_on_error():  # a batch refused leaves it as it was (its step drew a seed)
            try:
                if self.refused is not None:
                    raise self.refused
                refuse_without_gradients(index)  # (the loop may be iterated under another grad mode than it began in)
                if index == 0 and self.ranks is not None:  # every rank refuses at once (in one process, when the loop is made)
                    refuse_where_steps_cannot_overlap(self.pipe, self.optimizer)
                if index >= 2:  # the caller's code after the loss of batch index - 2 ran since the last batch was read
                    self.found.refuse_changes(f"between two losses (after batch {index - 2}'s)", self.held, slots=False, watch=self.versions.slots)
                with drawing_between_compiles(), default_generator_held():  # the caller's iterable and the step's seed may draw
                    before = torch.get_rng_state()
                    batch = next(batches, None)
                    self._after_reading(index, batch)
                    started = None if batch is None else self._made(batch)
                if started is not None:
                    self.generator[index] = (before, torch.get_rng_state())
            except BaseException as error:  # noqa: BLE001 - raised here, after the other ranks hear of it
                if self.ranks is None:
                    raise
                failure = error
            if self.ranks is not None:
                said = read_or_failed("end" if started is None else "batch", failure)
                kind = f"train_steps, schedule='2bw', reduction={self.reduction!r}"
                signature = None if started is None else call_signature(self.ranks.host, started.call, kind, started.target, started.step.seed)
                self.ranks.start(index, said, signature, failure)
        return started

    def _after_reading(self, index: int, batch: Optional[Batch]) -> None:
        """The caller's iterable ran there: before the first batch nothing is in flight, and
        the loop takes the model as it is then; after it, batches are (the one before, at least)."""
        if index == 0:
            self._take_the_model()
            _refuse_steps_in_backward(self.pipe._owner)
            self.found.take(self.program)
        elif batch is not None:
            self.found.refuse_changes(f"in the batches' iterable, while batch {index} was read", self.held, slots=False, watch=self.versions.slots)
            self._refuse_batches_written(f"by the batches' iterable while it made batch {index}")

    def _made(self, batch: Batch) -> _Started:
        index, args, kwargs, target = batch
        try:
            call, step = self.pipe._train_call(
                args, kwargs, target, self.loss_fn, self.reduction, _OutputsAlone(self.pipe._owner, target), versions=self.versions, batch=index, held=self.held,
                slicing=self.spec,
            )  # fmt: skip
        except OtherCall as other:  # the synchronous schedules compile stages of their own for it
            reason = str(other).partition("\nHow to fix")[0]
            raise TypeError(
                f"train_steps (schedule='2bw') runs every batch as the example's kind of call, and batch {index} is of "
                f"another: {reason}\nHow to fix: compile the pipeline with an "
                "example of the loop's kind (the same arguments given, the same left None: example_kwargs=...), a "
                "pipeline per kind; or use a synchronous schedule (1f1b), which compiles stages for each kind itself."
            ) from other
        self.held = call.program  # checked against the model on the first batch, before anything ran
        if self.spec is not None and self.spec.count() is None:  # 'auto': its cut of the first batch fixes the count
            assert call.slices is not None
            self.spec = dataclasses.replace(self.spec, fixed_count=call.slices.per_row)
            self._fix_slices(call.slices.per_row)
        if len(call.sizes) != self.m:
            per_row = call.slices.per_row if call.slices is not None else 1
            raise ValueError(
                f"train_steps with schedule='2bw': batch {index} splits into {len(call.sizes) // per_row} micro-batches, not "
                f"chunks={self.m // per_row}: every batch of the loop must split into chunks micro-batches, so have at least "
                "chunks samples" + (f" (each cut into {per_row} slices of its sequence)" if per_row > 1 else "") + ".\nHow to fix: "
                "give every batch chunks samples or more (DataLoader(drop_last=True) drops a smaller last one)"
                + ("; a loop of batches smaller than chunks runs under a synchronous schedule (compile with schedule='1f1b')." if index == 0 else ".")
            )
        return _Started(index, call, step, target, _tensors_read(call, target))

    def start(self, started: _Started) -> None:
        """Batch `started`'s step, and each worker's actions up to the first that needs the next batch."""
        index, step = started.index, started.step
        step._post_inputs()
        self.steps[index] = _InFlight(started.call, step, TaskGroup(len(self.local) * (2 * self.m + self.checkpointed)), started.target, started.read)
        self.updates[index] = TaskGroup(len(self.local))
        self.read = index + 1
        streams = two_bw(self.layout, self.m, self.read + 1, self.checkpointed, self.slices)
        self._submit(streams, segment(streams, self.m, index))

    def end(self) -> None:
        """No batch after those read: every worker gets the rest of its list (the drain, the last updates)."""
        streams = two_bw(self.layout, self.m, self.read, self.checkpointed, self.slices)
        self._submit(streams, [len(acts) for acts in streams])

    def _submit(self, streams: list[list[Action]], cuts: list[int]) -> None:
        lists: dict[int, list[Callable[[], None]]] = {}
        for worker, (acts, cut) in enumerate(zip(streams, cuts)):
            if self.ranks is not None and worker != self.ranks.me:
                continue  # another rank's list
            lists[worker] = [self._task(action) for action in acts[self.given[worker] : cut]]
            self.given[worker] = max(self.given[worker], cut)
        for worker, tasks in lists.items():  # every list made before any worker starts on one
            if tasks:
                self.workers.submit(worker if self.ranks is None else 0, tasks)

    def _task(self, action: Action) -> Callable[[], None]:
        if action.kind == UPDATE:
            return self._update_task(action)
        flight = self.steps[action.micro_batch // self.m]
        local = Action(action.kind, action.stage, action.micro_batch % self.m)
        task = flight.step.task(local, flight.group)
        if self.ranks is None:
            return task
        me, channel = self.ranks.global_rank, self.ranks.host.channel

        def told() -> None:
            task()
            error = flight.group.errors.get(local)
            if error is None or channel.failed:
                return
            if isinstance(error, RemoteFailure):
                # Passed on: a rank reads only from the ranks its stages take values from, so one
                # that reads nothing from the failed rank hears of it from those it reads from.
                self._tell_the_others(error.failure)
                return
            phase, cause = phase_and_cause(local, error)
            self._tell_the_others(StageError(local.stage, local.micro_batch, phase, cause, rank=me).failure())

        return told

    def _tell_the_others(self, failure: Failure) -> None:
        """Across processes: a failure here, sent at once, so that no other rank's stage waits
        on a value this one will not send (best effort: a rank may be gone)."""
        assert self.ranks is not None
        self.ranks.host.channel.fail(failure)

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
                if self.ranks is not None and not isinstance(e, Aborted) and not self.ranks.host.channel.failed:
                    # the other ranks' stages wait on values this one's will not send now
                    where = f"the optimizer's step of stage {action.stage} on batch {action.micro_batch}"
                    self._tell_the_others(Failure(self.ranks.global_rank, -1, -1, where, first_line(e)))
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
        loss, its gradients in `.grad` and `after_backward`, the optimizer's settings its update will
        run with (it runs once the caller's code after the loss did)."""
        flight = self.steps[index]
        parts = None
        if self.ranks is None:
            self._settled(index, flight, after_step)
            input_grads = flight.step._caller_input_grads()
            with drawing_between_compiles(), default_generator_held(), self.loss_state:  # a loss function may draw
                total, _ = loss_and_outputs(flight.call, flight.step, self.loss_fn, flight.target, self.reduction, False)
            write_targets_back(flight.step)
            grads = parameter_grads(flight.call.program, flight.step, flight.call.params)
        else:
            input_grads, (total, grads, parts) = [], self._agreed(index, flight, after_step)
        failure = None
        try:
            if parts is not None:  # (a refusal here is one more failure the ranks agree on below)
                grads = summed_tied(flight.call.program, flight.call.params, grads, parts, self.pipe._owner)
            grads = _trained_now(flight.call.program, flight.call.params, grads, index, self.pipe._owner)
            self.optimizer.zero_grad()
            if _gradient_hooked(flight.call.params):  # they may step an optimizer of their own, as the stages run
                where = f"in the hooks on the parameters' gradients (register_post_accumulate_grad_hook, register_hook) of batch {index}"
                self._run_hook(lambda: accumulate(flight.call, input_grads, grads), where)
            else:
                accumulate(flight.call, input_grads, grads)
            if after_backward is not None:
                self._run_hook(after_backward, f"in after_backward of batch {index}")
            self.versions.hold_settings(index)  # the optimizer as a synchronous loop would step it now
            self.grads_held = [(p, p.grad, _grad_state(p.grad), p._version) for p in dict.fromkeys(self.program.parameters)]
        except BaseException as error:  # noqa: BLE001 - raised below (across processes, once the others know)
            failure = error
        if self.ranks is not None:
            self.ranks.hooks_ran(index, failure)
        elif failure is not None:
            raise failure
        del self.steps[index]
        self.generator.pop(index, None)
        self.finished = index + 1
        return total

    def after_the_callers_code(self, index: int) -> None:
        """After the caller's code that follows batch `index`'s loss: `.grad` as `after_backward`
        left it, which the batch's update (run after that code, unlike a synchronous loop's)
        steps on; a gradient that code set to None or replaced is put back (in a synchronous
        loop it changes nothing: the update ran before it), one written in place is refused, and
        so is a change to the optimizer's state, which the update reads. (Its settings and groups
        are held, `Versions.hold_settings`.)"""
        self.checked = index
        failure = None
        try:
            self._refuse_changes_the_update_reads(index)
        except BaseException as error:  # noqa: BLE001 - raised here, across processes once the others know
            failure = error
        if self.ranks is not None:
            self.ranks.code_ran(index, failure)
        elif failure is not None:
            raise failure

    def say_stopped(self) -> None:
        """Across processes, the caller stopped the loop at the loss of the last batch it was
        given (a break, close(), an error in the loop's body): the other ranks, which meet
        after that loss, hear of it there at once, rather than wait out the timeout. Where
        they stopped there too, no rank raises."""
        assert self.ranks is not None
        index = self.finished - 1
        stopped = RuntimeError(f"the loop was stopped on this rank after the loss of batch {index} (a break, close(), or an error in the loop's body)")
        try:
            self.ranks.code_ran(index, stopped)
        except BaseException:  # noqa: BLE001 - its own, or another rank's news, as it stops anyway
            pass

    def _refuse_changes_the_update_reads(self, index: int) -> None:
        """Gradients of batch `index` written in place, or the optimizer's state changed, by the
        caller's code after its loss: refused; and so is a batch read ahead written there."""
        self._refuse_batches_written(f"by the code after the loss of batch {index}", by_the_loop=True)
        written, changed, params = self._held_for_the_update()
        if params:
            raise RuntimeError(
                f"train_steps (schedule='2bw'): parameters were written in place after the loss of batch {index} "
                f"({listed(params)}: a weight clamped, or torch.nn.init run on a module, say). {_UPDATE_AFTER_THE_CALLERS_CODE} "
                "from the values as written, where a synchronous loop has stepped already (and the next batch, read "
                "ahead, runs on them meanwhile); the loop stopped, and that update ran on them as written.\nHow to fix: "
                "write the parameters between loops (break out of this one, which completes the update of the last loss "
                "it gave; write them; start another), or use a synchronous schedule ('1f1b')."
            )
        if written:
            raise RuntimeError(
                f"train_steps (schedule='2bw'): the gradients of batch {index} were written in place after its loss "
                f"({listed(written)}: clip_grad_norm_, zero_grad(set_to_none=False), `.grad.data = ...`, say). "
                f"{_UPDATE_AFTER_THE_CALLERS_CODE} on the gradients as written there, where a synchronous loop has "
                "stepped already; the loop stopped, and that update ran on them as written.\nHow to fix: change gradients "
                "in after_backward (train_steps(..., after_backward=...)), which runs before every schedule's update."
            )
        if changed:
            raise RuntimeError(
                f"train_steps (schedule='2bw'): the optimizer's state was changed after the loss of batch {index} (of "
                f"{listed(changed)}: optimizer.load_state_dict, optimizer.state.clear(), a momentum buffer written, say). "
                f"{_UPDATE_AFTER_THE_CALLERS_CODE} from the state as changed there, where a synchronous loop has stepped "
                "already; the loop stopped, and that update ran on it as changed.\nHow to fix: change the optimizer's "
                "state in after_step (train_steps(..., after_step=...)), which runs once every stage's update of the "
                "batch is done, as a synchronous loop's step is."
            )

    def _refuse_batches_written(self, where: str, only: Optional[int] = None, by_the_loop: bool = False) -> None:
        """The batches in flight (or batch `only`) as they were read, or refused: the loop reads
        a batch while the one before runs, so a loader that fills one buffer again for each
        batch writes the one still running (or, `by_the_loop`, the caller's code after a loss
        writes a batch read ahead of it)."""
        for index, flight in list(self.steps.items()) if only is None else [(only, self.steps[only])]:
            written = [name for name, t, version in flight.read if t._version != version]
            if not written:
                continue
            cause, fix = (
                ("code that changes a batch in place once its loss is given (x.mul_(2) on the next batch the loop "
                 "body holds, say). Under 2bw the loop reads a batch before the loss of the one before is given, and runs it "
                 "meanwhile, so it would run partly on the values as changed", "change batches before the loop reads them "
                 "(in the iterable, or out of place: x = x * 2)")
                if by_the_loop else
                ("a loader that fills one buffer again for each batch (buf.copy_(x); yield buf, y), say. Under 2bw the "
                 "loop reads the next batch while the one before runs, so that one would run partly on the next one's values",
                 "give each batch tensors of its own (yield buf.clone(), or two buffers in turn)")
            )
            raise RuntimeError(
                f"train_steps (schedule='2bw'): tensors of batch {index} ({', '.join(dict.fromkeys(written))}) were written "
                f"in place {where}, before its micro-batches were all through: {cause}.\nHow to fix: {fix}, or use a "
                "synchronous schedule ('1f1b'), which reads a batch once the one before is done."
            )

    def _held_for_the_update(self) -> tuple[list[str], list[str], list[str]]:
        """The last batch's gradients put back where the caller's code set them to None or
        replaced them; the parameters whose gradient it wrote in place, whose optimizer state
        it changed, and that it wrote in place itself, which the update cannot be kept from."""
        written = [self.found.names.get(id(p), "?") for p, grad, state, _ in self.grads_held if _grad_state(grad) != state]
        for p, grad, *_ in self.grads_held:
            if p.grad is not grad:
                p.grad = grad
        params = [self.found.names.get(id(p), "?") for p, *_, version in self.grads_held if p._version != version]
        return written, [self.found.names.get(id(p), "?") for p in self.versions.state_changed()], params

    def _settled(self, index: int, flight: _InFlight, after_step: Hook) -> None:
        """The batch's actions waited for and its failure raised, if any (the update of the batch
        before it first, whose failure stops the batch); its timeline kept; the update of the
        batch before it waited for (and `after_step` run on it); then its statistics committed:
        `after_step` of the batch before sees that batch's, as a synchronous loop's does."""
        self._refuse_batches_written("while it ran (by the code after the loss before it, say)", only=index)
        _wait(flight.group)
        if index >= 1 and self.updates[index - 1].errors:
            self._updated(index - 1, after_step)
        flight.step.settle(flight.group)
        flight.step.backward_done = True
        # The loop's timeline: micro-batches by their index in the loop, updates by batch.
        self.records += [dataclasses.replace(r, micro_batch=index * self.m + r.micro_batch) for r in flight.step.timeline]
        self.pipe.__dict__["last_timeline"] = self.records
        if index >= 1:
            self._updated(index - 1, after_step)
        if flight.step.batch_stats is not None:
            flight.step.batch_stats.commit()

    def _agreed(self, index: int, flight: _InFlight, after_step: Hook) -> tuple[torch.Tensor, list[Optional[torch.Tensor]], TiedSums]:
        """Across processes: `_settled`, then every rank agrees that batch `index` is done (or
        every rank raises); the loss from the loss rank, the gradients, and every holder's part
        of each tied weight this rank holds."""
        assert self.ranks is not None
        program, params = flight.call.program, flight.call.params
        failure, loss, drawn = None, None, None
        grads: list[Optional[torch.Tensor]] = []
        try:
            self._settled(index, flight, after_step)
            if program.layout.ranks[program.layout.loss_stage] == self.ranks.me:
                before = torch.get_rng_state()
                with drawing_between_compiles(), default_generator_held():
                    loss = loss_and_outputs(flight.call, flight.step, self.loss_fn, flight.target, self.reduction, False)[0].detach()
                after = torch.get_rng_state()
                drawn = None if torch.equal(after, before) else after
            grads = parameter_grads(program, flight.step, params)
        except BaseException as error:  # noqa: BLE001 - raised here, after the other ranks hear of it
            failure = error
        tied = {} if failure is not None else tied_parts(program, params, grads, self.ranks.me)
        total, parts, drawn_there = self.ranks.finish(index, failure, loss, tied, drawn)
        if loss is None and drawn_there is not None:
            torch.set_rng_state(drawn_there)  # as loss_fn left it on the loss rank: the generators stay alike
        return total, grads, parts

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
            error.fxpipe_failed_update = index  # type: ignore[attr-defined]  # for the loop's own note
            raise error
        if after_step is not None:
            self._run_hook(after_step, f"in after_step of batch {index}")

    def _run_hook(self, hook: Callable[[], Any], where: str) -> None:
        self.found.run_hook(hook, where, self.versions, self.held)

    def last_update(self, after_step: Hook) -> None:
        if self.finished:
            self._updated(self.finished - 1, after_step)

    def _stop_in_flight(self) -> None:
        self.versions.abort()
        for flight in self.steps.values():
            flight.step.cancel()

    def _unread_dropped(self) -> None:
        """The caller's generator as if the batches whose losses were not given had not been read
        (the synchronous loop stopped there reads none of them), where nothing drew since the last
        read (a loss_fn or the caller's code that draws leaves it where it is: draws cannot be
        taken out of the middle of a stream)."""
        dropped = [index for index in self.generator if index >= self.finished]
        if dropped and torch.equal(torch.get_rng_state(), self.generator[max(dropped)][1]):
            torch.set_rng_state(self.generator[min(dropped)][0])
        self.generator.clear()

    def stop(self, after_step: Hook) -> None:
        """After a failure, or the caller's break: what is in flight stopped and waited for, and
        the update of the last batch whose loss was given completed on every stage."""
        self._stop_in_flight()
        if self.ranks is not None:  # the other ranks' stages may wait on values from this one's
            self._tell_the_others(Failure(self.ranks.global_rank, -1, -1, "train_steps (schedule='2bw')", "the loop stopped on this rank"))
        self.end()  # the rest of every list, which now returns at once: every group then finishes
        for group in [*(f.group for f in self.steps.values()), *self.updates.values()]:
            _wait(group)
        self.steps.clear()
        self._unread_dropped()
        pending = self.finished - 1
        if pending < 0 or pending not in self.updates:
            return
        if self.checked != pending:  # stopped in the caller's code after its loss (a break): its update runs now
            written, changed, params = self._held_for_the_update()
            if written or changed or params:
                what = [f"the gradients of {listed(written)} written in place"] if written else []
                what += [f"the optimizer's state of {listed(changed)} changed"] if changed else []
                what += [f"the parameters {listed(params)} written in place"] if params else []
                warnings.warn(
                    f"train_steps (schedule='2bw') was stopped after the loss of batch {pending}, and the code after that loss "
                    f"had {' and '.join(what)}. Under 2bw the update of a batch runs after the code that follows its loss: that "
                    "update ran on them as changed, where a synchronous loop had stepped before the change. Make such changes "
                    "in after_backward (gradients) or after_step (the optimizer's state), or after the loop.",
                    stacklevel=caller_stacklevel(),
                )
        for stage in self.local:
            if not self.versions.is_done(pending, stage):
                self.versions.apply(pending, stage)
        self.updates.pop(pending)
        if after_step is not None:
            after_step()


class _OutputsAlone(LeafGrads):
    """A step's losses under 2bw reach the outputs alone: a batch's loss is computed while the
    update of the batch before runs, so a tensor `loss_fn` reads besides the outputs (a model's
    weight in a penalty, a loss module's own parameter) would be read at no version the delayed
    update defines, and its gradient would reach no update."""

    def __init__(self, owner: torch.nn.Module, target: Any) -> None:
        super().__init__()
        self.owner = owner
        self.target = {id(t) for t in tree_flatten(target)[0] if isinstance(t, torch.Tensor)}

    def note(self, loss: torch.Tensor, own: Any) -> None:
        super().note(loss, own)
        if self.before:
            named = list(self.owner.named_parameters(remove_duplicate=False))
            names = {id(p): f"the model's parameter {n}" for n, p in named}
            targets = [*self.target, *(id(made) for _, made in self.through)]  # (one computed with grad is a leaf of its own)
            names.update((key, "the target (which requires grad: pass target.detach())") for key in targets)
            read = [names.get(key) or _by_shape(leaf, named) for key, (leaf, _) in self.before.items()]
            raise ValueError(
                f"train_steps (schedule='2bw'): loss_fn reads tensors that require grad besides the model's outputs: "
                f"{', '.join(read)}. Under 2bw a batch's loss is computed while the update of the batch before runs, "
                "so such a tensor has no version the delayed update defines, and its gradient would reach no "
                "update.\nHow to fix: compute that part of the loss in the model's forward (return it with the "
                "outputs), make a learned loss parameter part of the model, or use a synchronous schedule (1f1b)."
            )


_UPDATE_AFTER_THE_CALLERS_CODE = "Under 2bw the update of a batch runs after the code that follows its loss, so it would step"


def _tensors_read(call: Call, target: Any) -> Read:
    """A batch's input tensors (those the model writes itself aside) and its target's, with their
    versions now (but inference tensors, which have none, and which nothing writes outside inference mode)."""
    written = call.program.written_inputs
    named = [(name, value) for name, value in call.values.items() if name not in written] + [("the target", target)]
    return [(name, t, t._version) for name, value in named for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor) and not t.is_inference()]


def _by_shape(tensor: torch.Tensor, named: list[tuple[str, torch.nn.Parameter]]) -> str:
    """A tensor the loss read that is no parameter the model holds now: while a stage runs, its
    parameters' slots hold the step's tensors standing for them, which the loss may have read."""
    alike = [n for n, p in named if p.shape == tensor.shape and p.dtype == tensor.dtype]
    where = f" (the shape of the model's parameter{'s' if len(alike) > 1 else ''} {', '.join(alike)}, whose slot holds a tensor standing for it while its stage runs)" if alike else ""
    return f"a tensor of shape {tuple(tensor.shape)}{where}"


def _trained_now(program: Program, params: list[torch.nn.Parameter], grads: list[Optional[torch.Tensor]], index: int, owner: Any) -> list[Optional[torch.Tensor]]:
    """Batch `index`'s gradients of `params` (those that required grad when it started) for the
    parameters that still do. The plain loop runs batch t after the hooks of batch t - 1, where
    the batch started before them here: a parameter frozen there gets no gradient, as in the
    plain loop; one set to require grad there would get one the batch did not compute: refused."""
    started = {id(p) for p in params}
    late = [p for p in program.parameters if p.requires_grad and p.device.type != "meta" and id(p) not in started]
    if late:
        names = sorted({n for n, p in owner.named_parameters(remove_duplicate=False) if any(p is q for q in late)})
        raise RuntimeError(
            f"train_steps (schedule='2bw'): {', '.join(names)} began to require grad while batch {index} ran (in a "
            "hook, say): under 2bw a batch starts before the hooks of the batch before it, so it computed no gradient "
            "for them, where the plain loop would.\nHow to fix: set requires_grad before the loop (a loop of its own "
            "per setting), or use a synchronous schedule (1f1b), whose batches start after the hooks."
        )
    return [g if p.requires_grad else None for p, g in zip(params, grads)]


def _grad_state(grad: Optional[torch.Tensor]) -> tuple[int, int]:
    """A gradient's version and memory: either changes where it is written in place (a write
    through `.data` in place changes neither, and goes unseen)."""
    if grad is None:
        return (-1, 0)
    values = grad._values() if grad.layout == torch.sparse_coo else grad  # (a sparse gradient's memory is its values')
    return (grad._version, values.data_ptr())


def _wait(group: TaskGroup) -> None:
    group.wait(None if steps.WAIT_TIMEOUT is None else 2 * steps.WAIT_TIMEOUT)


def _gradient_hooked(params: Sequence[torch.nn.Parameter]) -> bool:
    """Whether a parameter runs hooks of the caller's as its gradient arrives (where one could
    write the parameter)."""
    return any(gradient_hooks(p) for p in params)


def _refuse_steps_in_backward(model: torch.nn.Module) -> None:
    """Hooks after a parameter's gradient is accumulated step an optimizer in backward: under 2bw
    a batch's gradients arrive while the next batch runs on the same weights."""
    stepped = [name for name, p in model.named_parameters() if steps_after_accumulating(p)]
    if stepped:
        raise RuntimeError(
            f"train_steps (schedule='2bw'): parameters have hooks that run once their gradient is accumulated "
            f"(register_post_accumulate_grad_hook): {listed(stepped)}. "
            "Such a hook steps an optimizer in backward; under 2bw a batch's gradients arrive while the next batch "
            "runs on the same weights, and a step there would write them under it.\nHow to fix: give that optimizer "
            "to train_steps (optimizer=...), whose step 2bw applies to the version each batch ran on, and remove the "
            "hooks; or keep them under a synchronous schedule (1f1b), where the hooks run as they do on the plain model."
        )


def refuse_where_steps_cannot_overlap(pipe: PipelineLike, optimizer: torch.optim.Optimizer) -> None:
    problems = []
    hooks = _step_hooks(optimizer)
    if hooks:
        problems.append(
            f"with hooks on the optimizer's step ({', '.join(hooks)}): each stage's share of the "
            "update runs on its own, as soon as its gradients are in, and a hook would run once per stage, on that "
            "stage's parameters alone. Do before the update what a pre-hook does (clipping) in after_backward=, "
            "where every stage's gradients for the batch are in; after every stage's update what a post-hook does "
            "(an average of the weights) in after_step="
        )
    placement = pipe._compiled.placement
    if placement is not None and placement.dp_group is not None:
        problems.append("with data-parallel replicas (a mesh with a 'dp' dimension): their gradients would be averaged "
                        "while the steps overlap, which this version does not do; use schedule='1f1b' there")
    tied = list(pipe._programs[True].tied_reads_in_backward(pipe._owner))
    if tied:
        problems.append(
            f"with a module that a stage's backward runs again (torch.utils.checkpoint(..., use_reentrant=True), or one "
            f"handed to an autograd Function) reading {', '.join(tied)}, tied to another stage: it reads the weight as "
            "the model holds it, whose version moves on while the batch runs; use use_reentrant=False, which the "
            "trace goes through"
        )
    if not pipe.training:
        problems.append("in eval mode: call pipe.train() first")
    if not torch.is_grad_enabled():
        problems.append("under torch.no_grad(): the loop computes gradients")
    if problems:
        raise RuntimeError("train_steps with schedule='2bw' cannot run " + "; and ".join(problems) + ".")


def _step_hooks(optimizer: torch.optim.Optimizer) -> list[str]:
    """The kinds of hooks that `optimizer.step()` runs: its own, and those of every optimizer."""
    found = [(optimizer._optimizer_step_pre_hooks, "register_step_pre_hook"), (optimizer._optimizer_step_post_hooks, "register_step_post_hook")]
    found += [(every_optimizer._global_optimizer_pre_hooks, "a global pre-hook"), (every_optimizer._global_optimizer_post_hooks, "a global post-hook")]
    return [name for hooks, name in found if hooks]


def _refuse_a_second_loop(pipe: PipelineLike) -> None:
    """One loop at a time: a second would take the weights the first has in flight (two loaders
    zipped, say), and its end would lift the first's guard."""
    if pipe.__dict__.get("_overlapping"):
        error = RuntimeError(
            "train_steps with schedule='2bw' while another train_steps loop of this pipeline runs: each loop's "
            "stages run ahead on the weights of its own batches and update them between its losses, so two "
            "loops at once would train each on the other's updates.\nHow to fix: one loop at a time (break out "
            "of the first, which completes the update of its last loss given, or close it); for batches of two "
            "loaders, one loop over them in turn (itertools.chain.from_iterable(zip(a, b)))."
        )
        error.fxpipe_loop_not_started = True  # type: ignore[attr-defined]
        raise error


def overlapped_steps(
    pipe: PipelineLike, batches: Iterator[Batch], loss_fn: Any, optimizer: torch.optim.Optimizer, reduction: str,
    after_backward: Hook, after_step: Hook,
) -> Generator[torch.Tensor, None, None]:
    """The loop: each batch's loss once its gradients are in `.grad`; the next batch is read
    (and started) before the caller's thread waits for a batch, so the workers never flush."""
    _refuse_a_second_loop(pipe)
    run = _Overlap(pipe, optimizer, loss_fn, reduction)
    pipe.__dict__["last_parameter_bytes"] = storage_bytes(run.program.parameters)
    done = stopped = finishing = False
    with pipe._one_call:  # after another thread's call in progress; calls after this are refused
        _refuse_a_second_loop(pipe)  # (one begun while this waited)
        pipe.__dict__["_overlapping"] = run.versions.gate  # refuses calls, holds the stages still for reads
    try:
        if run.ranks is not None:
            run.ranks.host.channel.begin()
        first = run.next_batch(batches)
        if first is None:
            done = True
            return
        run.start(first)
        ended = False
        while run.finished < run.read:
            if not ended and run.read == run.finished + 1:  # start the next batch before waiting on this one
                following = run.next_batch(batches)
                if following is None:
                    ended = True
                    run.end()
                else:
                    run.start(following)
            finishing = True  # a failure from here to its loss is batch run.finished's own
            loss = run.finish(run.finished, after_backward, after_step)
            finishing = False
            yield loss
            run.after_the_callers_code(run.finished - 1)
            run.versions.ready(run.finished - 1)  # its update runs after the caller's code that follows its loss
        run.last_update(after_step)
        if run.ranks is not None:
            run.ranks.host.channel.finish()  # every rank's loop ends together
        done = True
    except GeneratorExit:  # the caller's break or close(): what was read ahead is dropped, said below
        stopped = True
        if run.ranks is not None:
            run.say_stopped()
        raise
    except BaseException as error:  # what was read ahead is dropped: the loop's note says so (train_steps._noted)
        ahead = run.finished + finishing  # the first read ahead (not the batch that failed)
        error.fxpipe_dropped = (ahead, run.read - ahead)  # type: ignore[attr-defined]
        raise
    finally:
        pipe.__dict__["_overlapping"] = None
        try:
            if not done:
                dropped = run.read - run.finished
                run.stop(after_step)
                run.loss_state.put_back()  # (what batches in flight moved since a refusal put it back)
                if stopped and dropped:
                    _say_dropped(run.finished, dropped)
        finally:
            if run.workers is not pipe._workers:
                run.workers.close()


def _say_dropped(given: int, dropped: int) -> None:
    """A loop the caller stopped had read batches ahead of their losses, which it drops: an
    iterator the caller goes on with starts after them."""
    which = f"batch {given}" if dropped == 1 else f"batches {given} to {given + dropped - 1}"
    warnings.warn(
        f"train_steps (schedule='2bw') was stopped after {given} loss{'' if given == 1 else 'es'}: {which}, read from the "
        "batches ahead of their losses to keep the stages busy, went untrained (dropped); the parameters hold the updates "
        f"of the batches whose losses were given. A loop resumed on the same iterator starts after {'it' if dropped == 1 else 'them'}: "
        "to train on every batch, give the loop only the batches to train on (itertools.islice(batches, n)) and let it "
        "end, rather than stopping it.",
        stacklevel=caller_stacklevel(),  # the caller's break or close()
    )
