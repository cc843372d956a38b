"""The Pipeline module: the model's own parameters, run stage by stage over micro-batches."""
from __future__ import annotations

import collections
import contextlib
import copy
import inspect
import threading
import warnings
from typing import Any, Callable, ContextManager, Iterable, Iterator, NoReturn, Optional

import torch
import torch.fx as fx
from torch import nn

from fxpipe.compiled.materialize import materialize
from fxpipe.compiled.plan import Plan
from fxpipe.compiled.program import ChunkSpec, Compiled, OtherCall, Program
from fxpipe.compiled.stage_compile import StageCompiles
from fxpipe.compiler.held_state import check_state_placement
from fxpipe.core.microbatch import Dims, batch_size_of, fewer_dims, forward_signature, kept_whole, map_tensors, spec_dims
from fxpipe.core.randomness import generator_put_back_on_error
from fxpipe.distributed.channel import Channel, RankMailbox
from fxpipe.distributed.clipping import clip_across
from fxpipe.distributed.rank_call import Host, forward_across, train_across
from fxpipe.distributed.ranks import holders, keep_local_state, refuse_written_inputs, routes, unread
from fxpipe.distributed.replicas import Replicas
from fxpipe.guards import NOT_CAPTURED, refuse_capture, refuse_other_autocast, refuse_own_hooks, refuse_parametrization_cache, traced_mode
from fxpipe.runtime.autograd import Run, run_with_autograd
from fxpipe.runtime.batch_loss import loss_and_outputs, micro_batch_losses
from fxpipe.runtime.batchnorm import BatchStatistics
from fxpipe.runtime.call import Call, devices_of, differentiable, sliced_call, split_call
from fxpipe.runtime.devices import Mailbox
from fxpipe.runtime.gather import Gathered
from fxpipe.runtime.grads import accumulate, parameter_grads
from fxpipe.runtime.losses import (
    LeafGrads, check_loss_arguments, refuse_outputs_of_the_whole_batch, refuse_whole_batch_outputs_of_a_call, split_target,
)
from fxpipe.runtime.memory import ActivationMeter
from fxpipe.runtime.step import Step
from fxpipe.runtime.versions import Versions
from fxpipe.runtime.worker import Workers
from fxpipe.schedules.actions import Schedule, checkpoint_stop
from fxpipe.schedules.check import make_schedule
from fxpipe.schedules.slices import SliceSpec
from fxpipe.schedules.timeline import Record, Timeline
from fxpipe.train_steps import train_steps

__all__ = ["ChunkSpec", "PlacementError", "Pipeline"]


class PlacementError(RuntimeError):
    """Devices of a Pipeline are chosen at compile time."""


# Kinds of call (arguments given or left out) a pipeline keeps compiled stages for.
VARIANTS = 8

class Pipeline(nn.Module):
    """A model cut into stages, run as a pipeline over micro-batches.

    Made by `compile_pipeline`. `pipe(*args)` takes what the model takes and returns what it
    returns, on the last stage's device, and `loss.backward()` runs GPipe's backward;
    `pipe.train_step(*args, target=, loss_fn=)` runs forward, loss and backward under the
    compiled schedule. Its parameters are the model's own, moved to the device of the first
    stage that uses them, under the model's own names.
    """

    # Held outside the module tree (in __dict__), so that state_dict() keys stay the model's own
    # and no name of the model's can clash with the pipeline's own attributes.
    _owner: nn.Module
    _compiled: Compiled
    _programs: dict[bool, Program]
    _workers: Workers
    _channel: Optional[Channel]  # across processes: this rank's messages to the others
    _replicas: Optional[Replicas]  # with a "dp" mesh dimension: DDP over this rank's parameters
    _signature: Optional[inspect.Signature]
    _closed: bool
    _own_loss_warned: bool  # train_step has said it cannot check a model's own loss
    # Compiles a pipeline for another kind of call (model, args, kwargs); None across processes.
    _recompile: Optional[Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], "Pipeline"]]
    _variants: "collections.OrderedDict[Any, Pipeline]"  # by kind of call, the most recent last
    _variants_warned: bool  # it has said that more kinds of call came than it keeps
    last_timeline: list[Record]  # what the last call ran (see `timeline()`)
    last_most_alive: list[int]  # per stage, the most micro-batches it held at once in the last call
    last_peak_bytes: list[int]  # per stage, the most activation bytes it held (with measure_memory)
    last_meter: Optional[ActivationMeter]  # what measured them (it holds no tensors)
    last_parameter_bytes: int  # the most parameter memory a train_steps loop under 2bw held, its versions included
    measure_memory: bool  # count the bytes autograd saves per stage (costs a hook per saved tensor)
    plan: Plan
    stages: list[fx.GraphModule]
    devices: list[torch.device]
    chunks: int
    checkpoint: str

    def __init__(self, model: nn.Module, compiled: Compiled) -> None:
        super().__init__()
        # The model's own tables, shared: a child called `stages` or `plan` is the model's, an
        # alias (`self.p1 = self.p0`) keeps its name, as in the model's state dict, and what is
        # set on the pipeline's top level (by functional_call, load_state_dict(assign=True)) is
        # set on the model's, whose tensors the stages read.
        for table in ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set"):
            self.__dict__[table] = model.__dict__[table]
        self.training = model.training
        plan = compiled.plan
        own = dict(
            _owner=model, _compiled=compiled, plan=plan, devices=list(compiled.devices),
            chunks=plan.chunks, checkpoint=plan.checkpoint, measure_memory=False, _closed=False,
            last_timeline=[], last_most_alive=[], last_peak_bytes=[], last_parameter_bytes=0, last_meter=None, _own_loss_warned=False, _signature=forward_signature(model),
            _recompile=None, _variants=collections.OrderedDict(), _variants_warned=False, _overlapping=None,
        )  # fmt: skip
        self.__dict__.update(own)
        ranks = plan.layout().ranks
        where = compiled.placement
        # Across processes each rank runs its own list on the caller's thread: no workers.
        devices = [self.devices[ranks.index(r)] for r in range(max(ranks) + 1)] if where is None else []
        self.__dict__["_workers"] = Workers(devices)
        self._workers.bind(self)
        channel = None if where is None else Channel(where.group, where.ranks, where.me, where.device, where.timeout, where.directions)
        self.__dict__["_channel"] = channel
        self._build()
        programs = list(self._programs.values())
        also = []
        if where is not None:
            refuse_written_inputs(self._programs)
            check_state_placement(model, self._programs)
            keep_local_state(model, programs, where)
            also = [(t, where.device) for t in unread(model, programs)] if where.me == 0 else []
        materialize(model, programs, self._runs_here, also)
        self.__dict__["_replicas"] = None
        if where is not None and next(self.parameters(), None) is None and next(model.parameters(), None) is not None:
            warnings.warn(
                f"this rank ({where.ranks[where.me]}) holds none of the model's parameters: its stages have none, so an "
                "optimizer over pipe.parameters() raises here (\"optimizer got an empty parameter list\"). Make one "
                "only on the ranks that hold some (if any(True for _ in pipe.parameters())), or cut elsewhere."
            )

    def _join_replicas(self) -> None:
        """With a "dp" mesh dimension: wrap this rank's parameters in DDP, which copies replica 0's
        to the others (compile_pipeline calls this once it has put the model back as it was)."""
        where = self._compiled.placement
        if where is not None and where.dp_group is not None:
            self.__dict__["_replicas"] = Replicas(where, self._held_here(self._programs[True]))

    # -- stages ----------------------------------------------------------------------------
    def _build(self) -> None:
        """(Re)build the stages of every mode's cut; after a dtype cast they must see the new buffers."""
        cuts = self._compiled.cuts
        unique = {id(cut): cut for cut in cuts.values()}  # both modes share one cut where their graphs agree
        built = {key: self._compiled.build(self._owner, cut) for key, cut in unique.items()}
        self.__dict__["_programs"] = {mode: built[id(cut)] for mode, cut in cuts.items()}
        self.__dict__["stages"] = self._programs[True].modules

    def _check_micro_batches(self, values: dict[str, Any], dims: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Program:
        """The first call of two samples or more, where the example had one: compiling's check
        that micro-batches compute what the whole batch does, on this call's inputs (raising as
        compiling would have); the stages are built again on what it found."""
        assert self._compiled.unchecked is not None
        detached = {name: map_tensors(torch.Tensor.detach, value) for name, value in values.items()}
        self._compiled.unchecked(detached, dims, (args, kwargs))
        self._compiled.unchecked = None
        self._build()
        return self._held_program()

    def compile_stats(self) -> list[StageCompiles]:
        """Per stage, under `compile_stages`: graphs compiled, seconds in the compiler, and the
        recompiles with the guard that failed, over both modes' stages ([] for eager stages)."""
        programs = list({id(p): p for p in self._programs.values()}.values())
        totals: list[StageCompiles] = []
        for index in range(len(self.devices)):
            found = [s.compiled.stats for p in programs if (s := p.stages[index]).compiled is not None]
            if found:
                totals.append(StageCompiles(
                    index, sum(f.graphs for f in found), sum(f.seconds for f in found), [r for f in found for r in f.recompiles],
                ))  # fmt: skip
        return totals

    def program(self, training: bool = True) -> Program:
        """The graph, its cut and the generated stages that run in training (or eval) mode."""
        return self._programs[training]

    def _held_program(self) -> Program:
        """The program for this call, against what the model holds now: built again when it holds
        other tensors than its stages were built on (the model itself cast, a parameter assigned);
        refused (fxpipe/guards.py) where the model is no longer what was traced."""
        # model.train()/eval() called on the model itself counts as on the pipeline: pipe.train()
        # sets the model's flag too, so the model's is the latest.
        self.__dict__["training"] = self._owner.training
        mode = traced_mode(self._owner, self._programs, self._compiled)
        if self._programs[mode].held.tensors_replaced():
            self._build()
        return self._programs[mode]

    def _shared(self, program: Program, grad: bool) -> list[list[torch.Tensor]]:
        """Each stage's own copy, for this step, of the tensors several stages read."""
        shared = []
        for index, (tensors, device) in enumerate(zip(program.shared, self.devices)):
            copies = []
            if not self._runs_here(program, index):
                tensors = []  # another rank's stage
            for tensor in tensors:
                if isinstance(tensor, nn.Parameter):
                    copy_ = tensor.detach().to(device)  # on the owner's device: a new leaf, same memory
                    copies.append(copy_.requires_grad_() if grad and tensor.requires_grad else copy_)
                else:
                    copies.append(tensor.to(device))  # a buffer on its own device is the buffer itself
            shared.append(copies)
        return shared

    def _runs_here(self, program: Program, stage: int) -> bool:
        where = self._compiled.placement
        return where is None or program.layout.ranks[stage] == where.me

    def _across(self) -> Host:
        """What a call across processes needs of this pipeline, and nothing else."""
        assert self._channel is not None
        return Host(
            owner=self._owner, channel=self._channel, replicas=self._replicas,
            training=lambda: self.training, program=lambda: self._programs[self.training],
            prepare=self._prepare, make_step=self._step, train_call=self._train_call, held_here=self._held_here,
            slicing=self._compiled.slicing,
        )  # fmt: skip

    def _held_here(self, program: Program) -> list[nn.Parameter]:
        """The parameters this rank's stages read."""
        where = self._compiled.placement
        assert where is not None
        return [p for p in program.parameters if where.me in program.readers.get(id(p), ())]

    # -- running ---------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        refuse_capture()
        refuse_parametrization_cache()
        self._refuse_while_steps_overlap("pipe(x)")
        if self._channel is not None:
            return forward_across(self._across(), args, kwargs)
        try:
            with generator_put_back_on_error():
                return self._forward(args, kwargs)
        except OtherCall as other:  # raised by the binding, before anything ran
            variant = self._variant(other, args, kwargs)
        return self._ran(variant, variant.forward(*args, **kwargs))

    def _variant(self, other: OtherCall, args: tuple[Any, ...], kwargs: dict[str, Any]) -> "Pipeline":
        """The pipeline for calls of another kind than the example (an optional argument left
        out, or given where the example left it None): compiled on the first such call, from the
        model as it is then and this call's arguments, and kept. Refused across processes, where
        every rank would have to compile it at the same call."""
        variants: collections.OrderedDict[Any, Pipeline] = self._variants
        found = variants.get(other.key)
        if found is not None:
            variants.move_to_end(other.key)
        elif self._recompile is None:
            raise other
        else:
            try:
                found = self._recompile(self._owner, args, kwargs)
            except Exception as error:  # the model itself may refuse this call: say both
                other.add_note(f"Compiling stages for this call failed too: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
                raise other from error
            if len(variants) >= VARIANTS:
                variants.popitem(last=False)[1].close()
                if not self._variants_warned:
                    self.__dict__["_variants_warned"] = True
                    warnings.warn(
                        f"this pipeline has compiled stages for more than {VARIANTS} kinds of call (arguments given or "
                        "left out, left None): it keeps the last ones, and compiles again for the others. Call it with "
                        "fewer kinds of arguments, or compile a pipeline for each.",
                        stacklevel=3,
                    )
            variants[other.key] = found
        found.__dict__.update(checkpoint=self.checkpoint, measure_memory=self.measure_memory)
        return found

    def _ran(self, variant: "Pipeline", result: Any) -> Any:
        """What `variant` ran, as this pipeline's last call (for `timeline()`)."""
        for name in ("last_timeline", "last_most_alive", "last_peak_bytes", "last_meter"):
            self.__dict__[name] = variant.__dict__[name]
        return result

    def _forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        call = self._prepare(args, kwargs)
        refuse_whole_batch_outputs_of_a_call(call.program.template, len(call.sizes))
        call = sliced_call(call, self._compiled.slicing)
        step = self._step(call, "gpipe", loss=None)

        def gather(outputs: list[dict[str, Any]]) -> Gathered:
            try:
                return call.gather(outputs)
            except BaseException:  # outputs that cannot be put together: the call changes nothing
                step.put_back_buffers()
                raise

        if not call.grad:
            gathered = gather(step.forward())
            return gathered.rebuild(gathered.tensors)
        program, params = call.program, call.params
        run = Run(step, call.input_slots, call.caller_micro_batches, params, gather, lambda: parameter_grads(program, step, params))
        run.differentiable = lambda name: differentiable(program, call.values, name)
        return run_with_autograd(run)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` over the model's parameters, by the norm of all of
        their gradients; returns that norm. In one process it is that function on
        `pipe.parameters()`. Across processes, where each rank holds its own stages' parameters,
        the norm is every rank's gradients together (a tied weight counted once), the same on
        every rank, and each rank scales its own: call it on every rank."""
        where = self._compiled.placement
        if where is None:
            return torch.nn.utils.clip_grad_norm_(list(self.parameters()), max_norm, norm_type, error_if_nonfinite)
        params = list(self.parameters())
        counted = [min(ranks, default=where.me) == where.me for ranks in holders(self._programs[True], params)]
        return clip_across(params, counted, max_norm, float(norm_type), error_if_nonfinite, where.group, where.device, where.timeout)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Across processes with a "dp" mesh dimension: `train_step`s inside accumulate each
        replica's own gradients into `.grad`, and the first one after syncs everything accumulated
        (DistributedDataParallel's `no_sync`, for gradient accumulation). Elsewhere it changes
        nothing, so one script runs in one process or many."""
        replicas = self._replicas
        if replicas is None:
            yield
            return
        before, replicas.syncing = replicas.syncing, False
        try:
            yield
        finally:
            replicas.syncing = before

    def __prepare_scriptable__(self) -> NoReturn:
        """torch.jit.script calls this first: the pipeline refuses, saying why and what to script."""
        raise RuntimeError(NOT_CAPTURED)

    def train_step(
        self,
        *args: Any,
        target: Any = None,
        loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
        reduction: str = "mean",
        return_outputs: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Forward, loss and backward of one batch under the compiled schedule; the parameters'
        (and inputs') gradients accumulate into `.grad` as `loss_fn(model(*args), target)
        .backward()` would put them there.

        Each micro-batch's loss is `loss_fn(output, target piece)`; they are combined as the loss
        of the whole batch: weighted by micro-batch size for a mean-reduced loss (`reduction=
        "mean"`), summed for a sum-reduced one (`"sum"`). Every step with a loss function checks
        the combination against the loss of the whole batch. Without `loss_fn` the model's output
        is its loss (a 0-dim tensor, or an output with a `loss` field), which cannot be checked.

        Returns the batch's loss, detached, on the last stage's device; with `return_outputs`,
        `(loss, outputs)`. Under `torch.no_grad()` it computes the loss alone.
        """
        refuse_capture()
        refuse_parametrization_cache()
        refuse_own_hooks(self)
        self._refuse_while_steps_overlap("train_step")
        if self._channel is not None:
            return train_across(self._across(), args, kwargs, target, loss_fn, reduction, return_outputs)
        kept = LeafGrads()
        try:
            with generator_put_back_on_error():
                call, step = self._train_call(args, kwargs, target, loss_fn, reduction, kept, return_outputs)
        except OtherCall as other:  # raised by the binding, before anything ran
            variant = self._variant(other, args, kwargs)
            return self._ran(variant, variant.train_step(*args, target=target, loss_fn=loss_fn, reduction=reduction, return_outputs=return_outputs, **kwargs))
        with generator_put_back_on_error():
            with kept.put_back_on_error():
                input_grads = step.train()
                total, outputs = loss_and_outputs(call, step, loss_fn, target, reduction, return_outputs)
        if call.grad:
            accumulate(call, input_grads, parameter_grads(call.program, step, call.params))
        return (total, outputs) if return_outputs else total

    def train_steps(
        self,
        batches: Iterable[Any],
        *,
        loss_fn: Optional[Callable[[Any, Any], torch.Tensor]],
        optimizer: torch.optim.Optimizer,
        reduction: str = "mean",
        after_backward: Optional[Callable[[], Any]] = None,
        after_step: Optional[Callable[[], Any]] = None,
    ) -> Iterator[torch.Tensor]:
        """Train on each `(inputs, target)` of `batches` (inputs a tensor, a tuple of positional
        inputs or a dict of keyword inputs), yielding each batch's loss, detached, once its update
        is made: per batch, `optimizer.zero_grad()`, `train_step`, `after_backward()` (clip the
        gradients there: `lambda: pipe.clip_grad_norm_(1.0)`), `optimizer.step()`, `after_step()`
        (a learning-rate scheduler's `step`). Between two losses the parameters hold the last
        update whole (`state_dict()` is consistent there); a failure, in a stage or in `batches`,
        says which batch it struck and leaves the parameters after the last update. Across
        processes every rank gives the same batches; one whose batches end or fail early makes
        every rank raise.

            for loss in pipe.train_steps(loader, loss_fn=F.cross_entropy, optimizer=opt):
                print(float(loss))
        """
        return train_steps(
            self, batches, loss_fn=loss_fn, optimizer=optimizer, reduction=reduction, after_backward=after_backward,
            after_step=after_step,
        )

    def _refuse_while_steps_overlap(self, what: str) -> None:
        if self.__dict__.get("_overlapping"):
            raise RuntimeError(
                f"{what} during a train_steps loop with schedule='2bw': its stages run and update their weights "
                "between the losses it gives, so no version of the model is whole until the loop ends.\nHow to "
                "fix: call it after the loop; to stop early, break out of the loop (it completes the update of the "
                "last batch whose loss it gave, and drops the rest), or close it (steps.close())."
            )

    def _train_call(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any, loss_fn: Any, reduction: str, kept: LeafGrads,
        return_outputs: bool = False, versions: Optional[Versions] = None, batch: int = 0, held: Optional[Program] = None,
        slicing: Optional[SliceSpec] = None,
    ) -> tuple[Call, Step]:
        """A train step's call, split into micro-batches, and its step, with each micro-batch's
        loss weighted to combine into the batch's (`kept` notes what else its backward reaches);
        with `versions`, batch `batch` of a loop whose steps overlap, its sequences cut into
        slices as `slicing` says (the pipeline's own way where None)."""
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', not {reduction!r}")
        check_loss_arguments(target, loss_fn)
        call = self._prepare(args, kwargs, held)
        schedule = self.plan.schedule if call.grad else "gpipe"
        if loss_fn is not None or return_outputs:  # the outputs are put together from the micro-batches
            refuse_outputs_of_the_whole_batch(call.program.template, len(call.sizes), asked=return_outputs)
        targets = split_target(target, call.sizes, call.batch)
        weights = [size / sum(call.sizes) if reduction == "mean" else 1.0 for size in call.sizes]
        call = sliced_call(call, slicing or self._compiled.slicing)
        if call.slices is not None:  # each row's slices run as micro-batches, each with its positions of the target
            targets, weights = call.slices.targets(targets), call.slices.weights(weights, reduction)
        micro_batch_loss = micro_batch_losses(call, loss_fn, targets, weights, kept)

        if loss_fn is None and len(call.sizes) > 1 and not self._own_loss_warned:
            self.__dict__["_own_loss_warned"] = True
            warnings.warn(
                f"train_step combines the model's own loss over micro-batches as a {reduction} over samples, "
                "and cannot check that it is one: a mean over a count that varies between micro-batches "
                "(tokens not ignored, say) is not. Pass loss_fn (checked on every step) or use chunks=1 "
                "for such a loss.",
                stacklevel=2,
            )
        step = self._step(call, schedule, loss=micro_batch_loss, versions=versions, batch=batch)
        kept.undo.append(step.put_back_buffers)  # a loss refused after the step: its writes too
        return call, step

    def bind(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The graph's input values, by name, for a call with these arguments."""
        return self._compiled.bind(args, kwargs)

    def schedule(self, micro_batches: Optional[int] = None) -> Schedule:
        """The checked action lists `train_step` runs in training mode on `micro_batches`
        (by default `chunks`); print it to see each worker's order."""
        m = micro_batches or self.chunks
        return make_schedule(self.plan.schedule, self._programs[True].layout, m, checkpoint_stop(self.checkpoint, m))

    def timeline(self) -> Timeline:
        """What the last call ran: per action its stage, micro-batch, kind, worker, start and end.
        With `measure_memory`, the activation bytes each stage held at most, and per CUDA device
        the allocator's peak since the call began (read now: ask right after the step)."""
        peaks = self.last_meter.device_peaks() if self.last_meter is not None else {}
        layout = self._programs[True].layout
        return Timeline(list(self.last_timeline), layout.workers, dict(enumerate(self.last_peak_bytes)), peaks, layout.levels)

    def _prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any], held: Optional[Program] = None) -> Call:
        """The call split into micro-batches, on the program that runs it. `held`: that program,
        checked against the model already (a loop of overlapping steps checks it once, before
        its first step: later, its stages hold the model's parameter slots while they run)."""
        refuse_capture()
        if self._closed:
            raise RuntimeError("this Pipeline was closed (pipe.close()); compile the model again to run it")
        if threading.current_thread() in self._workers.threads:
            raise RuntimeError(
                "the pipeline was called from inside one of its own stages (from a hook on a module it runs, say): "
                "its stage threads would wait on themselves.\nHow to fix: call it outside its own forward and "
                "backward, or call the module itself inside the hook."
            )
        program = self._held_program() if held is None else held
        refuse_other_autocast(self._compiled)
        values = self._compiled.bind(args, kwargs)
        dims = kept_whole(values, self._compiled.example_leaves, self._dims(args, kwargs))
        batch = batch_size_of(list(values.values()), dims)
        if batch == 0:
            raise ValueError("the input batch is empty (size 0 along dim 0); give at least one sample")
        unbatched = fewer_dims(values, self._compiled.example_leaves) if self.chunks > 1 else []
        if unbatched:
            raise ValueError(
                f"inputs have fewer dims than the example's, whose batch they split: {', '.join(unbatched)}: "
                "a sample without its batch dim? Its features would be split as samples.\n"
                "How to fix: pass a batch (x.unsqueeze(0) for one sample)."
            )
        if self._compiled.unchecked is not None and batch is not None and batch > 1 and held is None:
            program = self._check_micro_batches(values, dims, args, kwargs)
        compiled = self._compiled
        return split_call(program, values, batch, dims, self.chunks, compiled.example_leaves, compiled.check_micro_batch, self._channel is not None)

    def _step(self, call: Call, schedule: str, loss: Any, versions: Optional[Versions] = None, batch: int = 0) -> Step:
        program = call.program
        stop = checkpoint_stop(self.checkpoint, len(call.sizes)) if self.training and call.grad else 0
        mailbox, rank = None, None
        if self._channel is not None:
            rank, layout = self._channel.me, program.layout
            home, source = routes(program.stages, layout.ranks, layout.loss_stage, rank)
            mailbox = RankMailbox(self._channel, Mailbox(self._channel.timeout), home, source, batch if versions is not None else None)
        step = Step(
            program.stages,
            self._workers,
            call.micro_batches,
            grad=call.grad,
            checkpoint_stop=stop,
            shared=self._shared(program, call.grad) if versions is None else [[] for _ in program.stages],
            output_device=self.devices[-1],
            input_devices=devices_of(call.values),
            context=call.context,
            schedule=make_schedule(schedule, program.layout, len(call.sizes), stop, loss is not None, call.slices.per_row if call.slices else 1),
            layout=program.layout,
            batch_stats=BatchStatistics() if self._compiled.deferred_batch_norm and self.training else None,
            loss=loss,
            meter=ActivationMeter(len(program.stages), program.parameters, self.devices) if self.measure_memory else None,
            mailbox=mailbox,
            rank=rank,
            global_rank=None if self._channel is None else self._channel.ranks[self._channel.me],
            weights=versions,
            batch=batch,
            slices=call.slices,
        )
        self.__dict__["last_timeline"], self.__dict__["last_most_alive"] = step.timeline, step.most_alive
        self.__dict__["last_peak_bytes"] = step.meter.peak if step.meter is not None else []
        self.__dict__["last_meter"] = step.meter
        return step

    def _dims(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Dims:
        """How to split each input tensor that `chunk_spec` names, keyed by the tensor's id."""
        return spec_dims(self._signature, self._compiled.chunk_spec, args, kwargs)

    # -- across processes: this rank's own parameters and buffers ---------------------------------
    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The model's parameters; across processes, those of this rank's stages only."""
        with self._slots_held_still():
            found = list(super().named_parameters(prefix, recurse, remove_duplicate))
        yield from ((name, p) for name, p in found if not self._elsewhere(p))

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        with self._slots_held_still():
            found = list(super().named_buffers(prefix, recurse, remove_duplicate))
        yield from ((name, b) for name, b in found if not self._elsewhere(b))

    def _slots_held_still(self) -> ContextManager[None]:
        """During a loop whose steps overlap, its stages hold the model's parameter slots as they
        run: the modules are read with every stage kept out of them (fxpipe/runtime/versions.py)."""
        gate = self.__dict__.get("_overlapping")
        return gate.shut() if gate else contextlib.nullcontext()

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The model's state under the model's own keys; across processes, this rank's part."""
        self._refuse_while_steps_overlap("state_dict()")
        state = super().state_dict(*args, **kwargs)
        for key in [k for k, v in state.items() if isinstance(v, torch.Tensor) and self._elsewhere(v)]:
            del state[key]
        return state

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """The model's state under its own keys; across processes, this rank takes its part of a
        whole model's state dict (keys of other ranks' stages are not unexpected). With `assign`,
        the stages are built again on the tensors put in place."""
        self._refuse_while_steps_overlap("load_state_dict()")
        if self.__dict__.get("_channel") is None:
            result = super().load_state_dict(state_dict, strict, assign)
            if assign:
                self._build()
            return result
        own, every = set(self.state_dict()), set(super().state_dict())
        missing = sorted(own - set(state_dict))
        unexpected = sorted(set(state_dict) - every)
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"this rank's part of the state dict does not match: missing keys {missing}, unexpected keys "
                f"{unexpected}.\nHow to fix: load a state dict of the same model (or pass strict=False)."
            )
        super().load_state_dict({k: v for k, v in state_dict.items() if k in own}, strict=False, assign=assign)
        if assign:
            self._build()
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def _elsewhere(self, tensor: torch.Tensor) -> bool:
        """Held by another rank (this one keeps its shape only, on the meta device)."""
        return self.__dict__.get("_channel") is not None and tensor.device.type == "meta"

    # -- modes, copies, lifetime -------------------------------------------------------------
    def train(self, mode: bool = True) -> "Pipeline":
        # The model's own train(), overrides and all (a norm it keeps frozen, dropout it keeps on):
        # the pipeline's children are the model's, and its forward reads the flags they set.
        self._owner.train(mode)
        self.training = mode
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> "Pipeline":
        """A pipeline on a deep copy of the model, with its own stage workers."""
        owner = copy.deepcopy(self._owner, memo)
        copied = Pipeline(owner, self._compiled.copy(memo)).train(self.training)
        copied.__dict__["_recompile"] = self._recompile  # its kinds of call compile again on it
        return copied

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a Pipeline cannot be pickled: it holds stage threads and generated code.\n"
            "How to fix: save pipe.state_dict() (its keys are the model's own), and load it into the "
            "plain model, or into a pipeline compiled again."
        )

    def close(self) -> None:
        """Stop the stage workers now (they stop anyway when the pipeline is garbage-collected);
        the pipeline cannot run afterwards."""
        self.__dict__["_closed"] = True
        self._workers.close()
        for variant in self._variants.values():
            variant.close()

    # -- placement is managed ----------------------------------------------------------------
    def to(self, *args: Any, **kwargs: Any) -> "Pipeline":  # type: ignore[override]
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None:
            raise PlacementError(_PLACEMENT_MESSAGE)
        return super().to(*args, **kwargs)

    def cuda(self, device: Any = None) -> "Pipeline":
        raise PlacementError(_PLACEMENT_MESSAGE)

    def cpu(self) -> "Pipeline":
        raise PlacementError(_PLACEMENT_MESSAGE)

    def xpu(self, device: Any = None) -> "Pipeline":
        raise PlacementError(_PLACEMENT_MESSAGE)

    def ipu(self, device: Any = None) -> "Pipeline":
        raise PlacementError(_PLACEMENT_MESSAGE)

    def mtia(self, device: Any = None) -> "Pipeline":
        raise PlacementError(_PLACEMENT_MESSAGE)

    def to_empty(self, *, device: Any, recurse: bool = True) -> "Pipeline":  # type: ignore[override]
        raise PlacementError(_PLACEMENT_MESSAGE)

    def _apply(self, fn: Any, recurse: bool = True) -> "Pipeline":  # type: ignore[override]
        super()._apply(fn, recurse)
        if "_programs" in self.__dict__:
            self._owner._buffers.update(self._buffers)  # the model's own, cast: its new objects
            self._build()
        return self

    # -- pictures ----------------------------------------------------------------------------
    def to_svg(self, path: Optional[str] = None) -> str:
        """The stage graph as SVG text; also written to `path` when given."""
        from fxpipe.compiled.viz import plan_to_svg

        svg = plan_to_svg(self.plan)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(svg)
        return svg

    def _repr_svg_(self) -> str:
        return self.to_svg()

    def extra_repr(self) -> str:
        devices = ", ".join(str(d) for d in self.devices)
        return f"stages={len(self.devices)}, devices=[{devices}], chunks={self.chunks}, checkpoint={self.checkpoint!r}"


_PLACEMENT_MESSAGE = (
    "a Pipeline's placement is managed: each stage's parameters live on that stage's device.\n"
    "How to fix: choose devices when compiling (compile_pipeline(model, example, devices=[...])); "
    "dtype casts such as pipe.to(torch.float64) or pipe.double() are allowed."
)
