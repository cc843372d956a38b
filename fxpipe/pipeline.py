"""The Pipeline module: the model's own parameters, run stage by stage over micro-batches."""
from __future__ import annotations

import collections
import contextlib
import contextvars
import copy
import threading
import warnings
from typing import Any, Callable, Iterable, Iterator, NoReturn, Optional

import torch
import torch.fx as fx
from torch import nn

from fxpipe.compiled.materialize import materialize
from fxpipe.compiled.plan import Plan
from fxpipe.compiled.program import ChunkSpec, Compiled, OtherCall, Program
from fxpipe.compiled.stage_compile import StageCompiles
from fxpipe.compiler.held_state import check_state_placement
from fxpipe.core.microbatch import forward_signature
from fxpipe.core.model_hooks import call_with_hooks
from fxpipe.core.own_forward import in_the_models_own_call, pipeline_called
from fxpipe.core.randomness import generator_put_back_on_error
from fxpipe.distributed.channel import Channel
from fxpipe.distributed.clipping import clip_across
from fxpipe.distributed.rank_call import Host, forward_across, train_across
from fxpipe.distributed.ranks import holders, keep_local_state, refuse_written_inputs, refused_on_every_rank, unread
from fxpipe.distributed.replicas import Replicas
from fxpipe.guards import (
    NOT_CAPTURED, refuse_capture, refuse_outer_checkpoint, refuse_parametrization_cache, refuse_partial_backward_hooks,
    stops_torch_compile, warn_compiled_whole,
)
from fxpipe.own_names import OwnUnlessAChild
from fxpipe.pipeline_state import PipelineState
from fxpipe.runtime.autograd import Run, run_with_autograd
from fxpipe.runtime.batch_loss import add_returned_grads, loss_and_outputs, write_targets_back
from fxpipe.runtime.call import Call, differentiable, sliced_call
from fxpipe.runtime.gather import Gathered
from fxpipe.runtime.grads import accumulate, parameter_grads
from fxpipe.runtime.loss_state import LossStateKept, calls_of_loss_fn
from fxpipe.runtime.losses import LeafGrads, refuse_whole_batch_outputs_of_a_call, replay_once
from fxpipe.runtime.worker import Workers
from fxpipe.schedules.actions import Schedule, checkpoint_stop
from fxpipe.schedules.check import make_schedule
from fxpipe.schedules.timeline import Timeline
from fxpipe.train_steps import Losses, train_steps

__all__ = ["ChunkSpec", "PlacementError", "Pipeline"]


class PlacementError(RuntimeError):
    """Devices of a Pipeline are chosen at compile time."""


# Why torch.compile breaks its graph at a pipeline's call (fullgraph=True raises with it).
_NOT_ONE_GRAPH = (
    "a Pipeline runs its stages on worker threads under its schedule, which no one graph holds: torch.compile "
    "breaks its graph around the call (fullgraph=True cannot). To compile the stages themselves, compile with "
    "compile_pipeline(..., compile_stages=True); or drop fullgraph=True."
)


# Set while the pipeline is called as a module (`pipe(x)`), not by `pipe.forward(x)`.
_CALLED: contextvars.ContextVar[bool] = contextvars.ContextVar("fxpipe_called_as_a_module", default=False)

# The model's own tables, which a pipeline shares (`Pipeline.__init__`).
_SHARED_TABLES = ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set")


class Pipeline(PipelineState):
    """A model cut into stages, run as a pipeline over micro-batches.

    Made by `compile_pipeline`. `pipe(*args)` takes what the model takes and returns what it
    returns, on the last stage's device, and `loss.backward()` runs GPipe's backward;
    `pipe.train_step(*args, target=, loss_fn=)` runs forward, loss and backward under the
    compiled schedule. Its parameters are the model's own, moved to the device of the first
    stage that uses them, under the model's own names.
    """

    # Besides the state PipelineCalls declares (fxpipe/calls.py, under fxpipe/pipeline_state.py), held outside the module tree
    # like it:
    _replicas: Optional[Replicas]  # with a "dp" mesh dimension: DDP over this rank's parameters
    last_parameter_bytes: int  # the most parameter memory a train_steps loop under 2bw held, its versions included
    # The pipeline's own, unless the model has a child so named (fxpipe/own_names.py).
    stages: OwnUnlessAChild[list[fx.GraphModule]] = OwnUnlessAChild()
    plan: OwnUnlessAChild[Plan] = OwnUnlessAChild()
    devices: OwnUnlessAChild[list[torch.device]] = OwnUnlessAChild()
    chunks: OwnUnlessAChild[int] = OwnUnlessAChild()
    checkpoint: OwnUnlessAChild[str] = OwnUnlessAChild()

    def __init__(self, model: nn.Module, compiled: Compiled) -> None:
        super().__init__()
        # The model's own tables, shared: a child called `stages` or `plan` is the model's, an
        # alias (`self.p1 = self.p0`) keeps its name, as in the model's state dict, and what is
        # set on the pipeline's top level (by functional_call, load_state_dict(assign=True)) is
        # set on the model's, whose tensors the stages read.
        for table in _SHARED_TABLES:
            self.__dict__[table] = model.__dict__[table]
        self.training = model.training
        plan = compiled.plan
        own = dict(
            _owner=model, _compiled=compiled, _plan=plan, _devices=list(compiled.devices),
            _chunks=plan.chunks, _checkpoint=plan.checkpoint, measure_memory=False, _closed=False,
            last_timeline=[], last_most_alive=[], last_peak_bytes=[], last_parameter_bytes=0, last_meter=None, _own_loss_warned=False, _target_dims={}, _signature=forward_signature(model),
            _recompile=None, _variants=collections.OrderedDict(), _variants_warned=False, _numbers_warned=False, _overlapping=None,
            _one_call=threading.RLock(), _runs_model_hooks=True,
        )  # fmt: skip
        self.__dict__.update(own)
        ranks = plan.layout().ranks
        where = compiled.placement
        # Across processes each rank runs its own list on the caller's thread: no workers.
        devices = [self._devices[ranks.index(r)] for r in range(max(ranks) + 1)] if where is None else []
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
        self.__dict__["_stages"] = self._programs[True].modules
        if self._compiled.placement is not None:
            _refuse_tied_reads_in_backward_across_ranks(self._programs[True], self._owner)

    def compile_stats(self) -> list[StageCompiles]:
        """Per stage, under `compile_stages`: graphs compiled, seconds in the compiler, and the
        recompiles with the guard that failed, over both modes' stages and those compiled for
        other kinds of call (an optional argument given) ([] for eager stages)."""
        pipes = [self, *self._variants.values()]
        programs = list({id(p): p for pipe in pipes for p in pipe._programs.values()}.values())
        totals: list[StageCompiles] = []
        for index in range(len(self._devices)):
            found = [s.compiled.stats for p in programs if index < len(p.stages) and (s := p.stages[index]).compiled is not None]
            if found:
                totals.append(StageCompiles(
                    index, sum(f.graphs for f in found), sum(f.seconds for f in found), [r for f in found for r in f.recompiles],
                ))  # fmt: skip
        return totals

    def program(self, training: bool = True) -> Program:
        """The graph, its cut and the generated stages that run in training (or eval) mode."""
        return self._programs[training]

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
    def _call_impl(self, *args: Any, **kwargs: Any) -> Any:
        """`pipe(x)`, as a module's call: and the model's own hooks around the stages, which
        `pipe.forward(x)`, as `model.forward(x)`, does not run. (Under torch.compile, which cannot
        trace a ContextVar, `forward` runs eagerly and counts as such a call.)"""
        if torch.compiler.is_compiling():
            return super()._call_impl(*args, **kwargs)
        called = _CALLED.set(True)
        try:
            return super()._call_impl(*args, **kwargs)
        finally:
            _CALLED.reset(called)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if pipeline_called(self._owner, self):  # by the model's replaced forward, while the model compiles
            raise RuntimeError("the model's forward calls a Pipeline of the model, which a compile of the model cannot trace")
        refuse_capture(args, kwargs)
        if torch.compiler.is_compiling():
            # torch.compile(pipe) would trace the runtime's Python (threads, locks, the schedule)
            # in pieces between graph breaks: slow to compile, and none of it a stage's kernel.
            # Disabled here, not by a decorator, which would import torch._dynamo (seconds) with fxpipe.
            return _around_compiled(lambda: self._eager_call(args, kwargs, under_compile=True))
        return self._eager_call(args, kwargs, under_compile=False)

    def _eager_call(self, args: tuple[Any, ...], kwargs: dict[str, Any], under_compile: bool) -> Any:
        if under_compile and not self.compile_stats():
            warn_compiled_whole()
        with refused_on_every_rank(self._channel):
            refuse_outer_checkpoint()
            refuse_parametrization_cache()
            refuse_partial_backward_hooks(self)
            refuse_partial_backward_hooks(self._owner, "the model")
            self._refuse_while_steps_overlap("pipe(x)")
            self._refuse_calls_from_its_stages()  # before waiting for the call in progress, which waits on this one
        as_a_call = (_CALLED.get() or under_compile) and self._runs_model_hooks and self._channel is None  # (across processes, forward_across refuses them)
        # A call the model's own forward (replaced since compiling) makes: its call runs its hooks.
        as_a_call = as_a_call and not (self._programs[True].model_code_replaced() and in_the_models_own_call(self._owner))
        inside = _CALLED.set(False)  # (a call the model's code makes of the pipeline is its own)
        try:
            with self._one_call:  # another thread's call waits: its stages would swap the same slots
                with refused_on_every_rank(self._channel):
                    self._refuse_while_steps_overlap("pipe(x)")  # (a loop begun while this call waited)
                if as_a_call:
                    return call_with_hooks(self._owner, lambda *a, **k: self._call_now(a, k), args, kwargs)
                return self._call_now(args, kwargs)
        finally:
            _CALLED.reset(inside)

    def _call_now(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._channel is not None:
            return forward_across(self._across(), args, kwargs)
        try:
            with generator_put_back_on_error():
                return self._forward(args, kwargs)
        except OtherCall as other:  # raised by the binding, before anything ran
            variant = self._variant(other, args, kwargs)
        return self._ran(variant, variant.forward(*args, **kwargs))

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
        run.owner = self  # the outputs' graph keeps the pipeline, whose workers its backward needs, alive
        run.alone = self._one_call
        return run_with_autograd(run)

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach: Optional[bool] = None,
    ) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` over the model's parameters, by the norm of all of
        their gradients; returns that norm. In one process it is that function on
        `pipe.parameters()`. Across processes, where each rank holds its own stages' parameters,
        the norm is every rank's gradients together (a tied weight counted once), the same on
        every rank, and each rank scales its own: call it on every rank (there `foreach`, which
        changes only how fast, is not used)."""
        where = self._compiled.placement
        if where is None:
            return torch.nn.utils.clip_grad_norm_(list(self.parameters()), max_norm, norm_type, error_if_nonfinite, foreach)
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
        if torch.compiler.is_compiling():  # as pipe(x): run as it is, the caller's graph broken around it
            return _around_compiled(lambda: self.train_step(*args, target=target, loss_fn=loss_fn, reduction=reduction, return_outputs=return_outputs, **kwargs))
        with refused_on_every_rank(self._channel):
            refuse_capture()
            refuse_outer_checkpoint()
            refuse_parametrization_cache()
            self._refuse_while_steps_overlap("train_step")
            self._refuse_calls_from_its_stages()
        with self._one_call:
            with refused_on_every_rank(self._channel):
                self._refuse_while_steps_overlap("train_step")
            return self._train_step_now(args, kwargs, target, loss_fn, reduction, return_outputs)

    def _train_step_now(self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any, loss_fn: Any, reduction: str, return_outputs: bool) -> Any:
        if self._channel is not None:
            with _target_asked_by_keyword(target, loss_fn):
                return train_across(self._across(), args, kwargs, target, loss_fn, reduction, return_outputs)
        kept = LeafGrads()
        try:
            with generator_put_back_on_error(), _target_asked_by_keyword(target, loss_fn):
                call, step = self._train_call(args, kwargs, target, loss_fn, reduction, kept, return_outputs)
                _refuse_nothing_to_train(call)
        except OtherCall as other:  # raised by the binding, before anything ran
            variant = self._variant(other, args, kwargs)
            return self._ran(variant, variant.train_step(*args, target=target, loss_fn=loss_fn, reduction=reduction, return_outputs=return_outputs, **kwargs))
        with generator_put_back_on_error(), kept.put_back_on_error():
            with LossStateKept(loss_fn, calls=calls_of_loss_fn(len(call.sizes))) as loss_state:
                input_grads = step.train()
                total, outputs = loss_and_outputs(call, step, loss_fn, target, reduction, return_outputs)
                add_returned_grads(step, input_grads)
                loss_state.replay = replay_once(loss_fn, outputs, target, total.device) if loss_fn is not None else None
            write_targets_back(step)  # (once the loss's own state is found unchanged; a refusal here puts back the rest)
        if call.grad:
            accumulate(call, input_grads, parameter_grads(call.program, step, call.params))
            kept.backward_targets()
        return (total, outputs) if return_outputs else total

    def train_steps(
        self,
        batches: Iterable[Any],
        *,
        optimizer: torch.optim.Optimizer,
        loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
        reduction: str = "mean",
        after_backward: Optional[Callable[[], Any]] = None,
        after_step: Optional[Callable[[], Any]] = None,
    ) -> Losses:
        """Train on each `(inputs, target)` of `batches` (inputs a tensor, a tuple of positional
        inputs or a dict of keyword inputs), yielding each batch's loss, detached, once its update
        is made (under '2bw', once its gradients are: its update follows the caller's code after
        the loss, with the optimizer's settings of before it): per batch, `optimizer.zero_grad()`,
        `train_step`, `after_backward()` (clip the gradients there: `lambda:
        pipe.clip_grad_norm_(1.0)`), `optimizer.step()`, `after_step()` (a learning-rate
        scheduler's `step`). Between two losses the parameters hold the last update whole
        (`state_dict()` is consistent there; under '2bw' it is refused until the loop ends, as the
        stages run on); a failure, in a stage or in `batches`, says which batch it struck and
        leaves the parameters after the last update. Across processes every rank gives the same
        batches; one whose batches end or fail early makes every rank raise. A model that returns
        its own loss needs no `loss_fn`: its batches are `(inputs, None)`.

            for loss in pipe.train_steps(loader, loss_fn=F.cross_entropy, optimizer=opt):
                print(float(loss))
        """
        return train_steps(
            self, batches, loss_fn=loss_fn, optimizer=optimizer, reduction=reduction, after_backward=after_backward,
            after_step=after_step,
        )

    def bind(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The graph's input values, by name, for a call with these arguments."""
        return self._compiled.bind(args, kwargs)

    def schedule(self, micro_batches: Optional[int] = None) -> Schedule:
        """The checked action lists `train_step` runs in training mode on `micro_batches`
        (by default `chunks`); print it to see each worker's order."""
        m = micro_batches or self._chunks
        return make_schedule(self._plan.schedule, self._programs[True].layout, m, checkpoint_stop(self._checkpoint, m))

    def timeline(self) -> Timeline:
        """What the last call ran: per action its stage, micro-batch, kind, worker, start and end.
        With `measure_memory`, the activation bytes each stage held at most, and per CUDA device
        the allocator's peak since the call began (read now: ask right after the step)."""
        peaks = self.last_meter.device_peaks() if self.last_meter is not None else {}
        layout = self._programs[True].layout
        return Timeline(list(self.last_timeline), layout.workers, dict(enumerate(self.last_peak_bytes)), peaks, layout.levels)

    # -- modes, copies, lifetime -------------------------------------------------------------
    def train(self, mode: bool = True) -> "Pipeline":
        # The model's own train(), overrides and all (a norm it keeps frozen, dropout it keeps on):
        # the pipeline's children are the model's, and its forward reads the flags they set.
        self._owner.train(mode)
        self.training = mode
        return self

    def apply(self, fn: Callable[[nn.Module], None]) -> "Pipeline":
        """`model.apply(fn)`: `fn` on each of the model's modules, and on the model itself last (an
        initialisation that picks the model by its class reaches its own parameters)."""
        self._owner.apply(fn)
        return self

    def __getitem__(self, index: Any) -> Any:
        """`model[index]`, for a model that is indexed (an nn.Sequential: `pipe[0]` is its first layer,
        and iterating the pipeline gives its layers, as the model's own iteration does)."""
        if not hasattr(type(self._owner), "__getitem__"):
            raise TypeError(
                f"'{type(self._owner).__name__}' object is not subscriptable, and a Pipeline is indexed as its model is.\n"
                "How to fix: reach a submodule by name (pipe.get_submodule('encoder.layers.0'), the model's own names); "
                "the stages are pipe.stages, their plan pipe.plan.stages."
            )
        owner: Any = self._owner
        return owner[index]

    def __deepcopy__(self, memo: dict[int, Any]) -> "Pipeline":
        """A pipeline on a deep copy of the model, with its own stage workers; made between calls
        (after another thread's call in progress), and in a 2bw loop with its stages out of the
        model's parameter slots, where they hold the version each runs on."""
        with self._one_call, self._slots_held_still():
            owner = copy.deepcopy(self._owner, memo)
        copied = Pipeline(owner, self._compiled.copy(memo)).train(self.training)
        memo[id(self)] = copied  # what refers to the pipeline (a hook that holds it) refers to the copy
        copied.__dict__["_recompile"] = self._recompile  # its kinds of call compile again on it
        # What the caller set on the pipeline itself, as a module's copy keeps it: its hooks (the
        # tables nn.Module makes) and its own attributes.
        fresh = nn.Module().__dict__
        for key, value in self.__dict__.items():
            if (key in fresh and key not in _SHARED_TABLES) or key not in copied.__dict__:
                copied.__dict__[key] = copy.deepcopy(value, memo)
        return copied

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a Pipeline cannot be pickled or shallow-copied (copy.copy): it holds stage threads and generated code.\n"
            "How to fix: copy.deepcopy(pipe) gives an independent pipeline; to save it, save pipe.state_dict() (its "
            "keys are the model's own), and load it into the plain model, or into a pipeline compiled again."
        )

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc: object) -> None:
        """`with compile_pipeline(...) as pipe:` closes the pipeline at the end of the block."""
        self.close()

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
        def cast_in_place(t: torch.Tensor) -> torch.Tensor:
            # A module holding the pipeline moved (`wrapper.to("cuda")` reaches it here, not through
            # `to`): a cast keeps each tensor's device, a move would gather the stages on one.
            made = fn(t)
            if isinstance(made, torch.Tensor) and made.device != t.device:
                raise PlacementError(_PLACEMENT_MESSAGE + _MOVED_BY_A_HOLDER)
            return made

        super()._apply(cast_in_place, recurse)
        if "_programs" in self.__dict__:
            self._owner._buffers.update(self._buffers)  # the model's own, cast: its new objects
            self._build()
        return self

    # -- pictures ----------------------------------------------------------------------------
    def to_svg(self, path: Optional[str] = None) -> str:
        """The stage graph as SVG text; also written to `path` when given."""
        from fxpipe.compiled.viz import plan_to_svg

        svg = plan_to_svg(self._plan)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(svg)
        return svg

    def _repr_svg_(self) -> str:
        return self.to_svg()

    def extra_repr(self) -> str:
        devices = ", ".join(str(d) for d in self._devices)
        return f"stages={len(self._devices)}, devices=[{devices}], chunks={self._chunks}, checkpoint={self._checkpoint!r}"


_MOVED_BY_A_HOLDER = (
    " A module that holds the pipeline moves it with itself (wrapper.to(...), wrapper.cuda()): move that "
    "module's own parts alone, or place them on the stages' devices when building it."
)

_PLACEMENT_MESSAGE = (
    "a Pipeline's placement is managed: each stage's parameters live on that stage's device.\n"
    "How to fix: choose devices when compiling (compile_pipeline(model, example, devices=[...])); "
    "dtype casts such as pipe.to(torch.float64) or pipe.double() are allowed."
)


def _refuse_nothing_to_train(call: Call) -> None:
    """A step in grad mode where no parameter and no input requires grad: the plain model's
    `loss.backward()` raises there (or trains a loss_fn's own parameters alone), and a step that
    trains nothing must not pass for one."""
    if torch.is_grad_enabled() and not call.context.inference and not call.grad:
        raise RuntimeError(
            "train_step: no parameter the model's stages read requires grad, and no input does, so its backward "
            "would reach nothing: the plain model's loss.backward() raises here ('element 0 of tensors does not "
            "require grad'), or, where loss_fn holds parameters of its own (a probe on a frozen model), trains "
            "those alone.\nHow to fix: unfreeze what should train (p.requires_grad_(True)); for a loss_fn with "
            "parameters, loss_fn(pipe(x), target).backward() trains them; for the loss alone, run under torch.no_grad()."
        )


@contextlib.contextmanager
def _target_asked_by_keyword(target: Any, loss_fn: Any) -> Iterator[None]:
    """`pipe.train_step(x, y, loss_fn=...)`: the target given as one more input of the model."""
    try:
        yield
    except OtherCall:
        raise
    except TypeError as error:
        if target is None and loss_fn is not None and "too many positional arguments" in str(error):
            raise TypeError(f"{error}\nHow to fix: give the target by keyword, pipe.train_step(x, target=y, loss_fn=...).") from None
        raise


def _refuse_tied_reads_in_backward_across_ranks(program: Program, owner: nn.Module) -> None:
    """A module a stage's backward runs again reads a weight tied across stages as the model
    holds it, and puts its gradient in that rank's `.grad` itself: the ranks that hold the other
    copies would never get that part."""
    read = program.tied_reads_in_backward(owner)
    across = [name for name, p in read.items() if len(program.readers.get(id(p), ())) > 1]
    if across:
        raise ValueError(
            f"a module that a stage's backward runs again (torch.utils.checkpoint(..., use_reentrant=True), or one "
            f"handed to an autograd Function) reads {', '.join(across)}, tied to a stage on another rank: its gradient "
            "there would reach this rank's copy alone.\nHow to fix: torch.utils.checkpoint(..., use_reentrant=False), "
            "which the trace goes through, or split_points that put every reader of the tied weight on one rank."
        )



@stops_torch_compile(_NOT_ONE_GRAPH)
def _around_compiled(run: Callable[[], Any]) -> Any:
    """A call of the pipeline under torch.compile, run as it is (its graph broken here)."""
    return torch.compiler.disable(run)()
