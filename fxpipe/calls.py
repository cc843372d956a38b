"""Making a call of the Pipeline ready to run: the program it runs, its inputs split into micro-batches, and its step."""
from __future__ import annotations

import collections
import contextlib
import inspect
import threading
import time
import warnings
import weakref
from typing import Any, Callable, ContextManager, Optional, TypeVar

import torch
from torch import nn

from fxpipe.compiled.plan import Plan
from fxpipe.compiled.program import Compiled, OtherCall, Program
from fxpipe.core.microbatch import Dims, batch_dim_of, batch_size_of, fewer_dims, is_one_sample, kept_whole, map_tensors, spec_dims, takes_gradients
from fxpipe.core.own_code import caller_stacklevel
from fxpipe.core.own_forward import in_the_models_own_call, traced_forward_put_back
from fxpipe.distributed.channel import Channel, RankMailbox
from fxpipe.distributed.ranks import routes
from fxpipe.guards import (
    refuse_capture, refuse_modes_the_stages_would_miss, refuse_moved_stages, refuse_other_autocast, refuse_own_hooks, refuse_parametrization_cache,
    traced_mode,
)
from fxpipe.runtime.batch_loss import MicroBatchLoss, own_loss_reduction, own_mean_weights
from fxpipe.runtime.batchnorm import BatchStatistics
from fxpipe.runtime.call import Call, devices_of, sliced_call, split_call
from fxpipe.runtime.devices import Mailbox
from fxpipe.runtime.gather import output_batch_dims, output_batch_dims_by_path
from fxpipe.runtime.losses import (
    LeafGrads, check_loss_arguments, refuse_outputs_of_the_whole_batch, split_target, target_note, with_own_loss_whole,
)
from fxpipe.runtime.memory import ActivationMeter
from fxpipe.runtime.step import Step
from fxpipe.runtime.versions import Versions
from fxpipe.runtime.worker import Workers
from fxpipe.schedules.actions import checkpoint_stop
from fxpipe.schedules.check import make_schedule
from fxpipe.schedules.slices import SliceSpec
from fxpipe.schedules.timeline import Record

# Kinds of call (arguments given or left out) a pipeline keeps compiled stages for.
VARIANTS = 8

P = TypeVar("P", bound="PipelineCalls")


class PipelineCalls(nn.Module):
    """What the Pipeline does before a call runs: check that the model is still what was traced
    and pick the program of its mode, bind and split the inputs, build the step under the
    schedule; and keep the pipelines compiled for other kinds of call. The Pipeline's state is
    declared here, where it is read."""

    # Held outside the module tree (in __dict__), so that state_dict() keys stay the model's own
    # and no name of the model's can clash with the pipeline's own attributes.
    _owner: nn.Module
    _compiled: Compiled
    _programs: dict[bool, Program]
    _workers: Workers
    _channel: Optional[Channel]  # across processes: this rank's messages to the others
    _signature: Optional[inspect.Signature]
    _closed: bool
    _one_call: threading.RLock  # held by a call (its forward, its backward, a train step): one at a time on the model
    _own_loss_warned: bool  # train_step has said it cannot check a model's own loss
    _target_dims: dict[str, int]  # the dim each target leaf (by path) was split along where it alone held the batch
    # Compiles a pipeline for another kind of call (model, args, kwargs); None across processes.
    _recompile: Optional[Callable[[nn.Module, tuple[Any, ...], dict[str, Any], list[str]], Any]]
    _variants: "collections.OrderedDict[Any, Any]"  # pipelines by kind of call, the most recent last
    _variants_warned: bool  # it has said that more kinds of call came than it keeps
    _numbers_warned: bool  # it has said that another value of a number compiled its stages again
    last_timeline: list[Record]  # what the last call ran (see `timeline()`)
    last_most_alive: list[int]  # per stage, the most micro-batches it held at once in the last call
    last_peak_bytes: list[int]  # per stage, the most activation bytes it held (with measure_memory)
    last_meter: Optional[ActivationMeter]  # what measured them (it holds no tensors)
    measure_memory: bool  # count the bytes autograd saves per stage (costs a hook per saved tensor)
    _plan: Plan  # `pipe.plan` and `pipe.devices` to the caller (fxpipe/pipeline.py), read here by these names
    _devices: list[torch.device]
    _chunks: int  # `pipe.chunks` and `pipe.checkpoint` to the caller
    _checkpoint: str

    def _build(self) -> None:
        """(Re)build the stages of every mode's cut (the Pipeline's)."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop the stage workers (the Pipeline's)."""
        raise NotImplementedError

    def _held_program(self) -> Program:
        """The program for this call, against what the model holds now: built again when it holds
        other tensors than its stages were built on (the model itself cast, a parameter assigned);
        refused (fxpipe/guards.py) where the model is no longer what was traced."""
        # model.train()/eval() called on the model itself counts as on the pipeline: pipe.train()
        # sets the model's flag too, so the model's is the latest.
        self.__dict__["training"] = self._owner.training
        mode = traced_mode(self._owner, self._programs, self._compiled)
        held = self._programs[mode].held
        if held.tensors_replaced():
            added = [*held.tensors_added(), *held.replaced_across()] if self._compiled.placement is not None else []
            if added:
                raise RuntimeError(
                    f"parameters or buffers were added to the model since compiling, or replaced: {', '.join(added)}. "
                    "Across processes each rank holds the state of its own stages "
                    "alone, placed when compiling: another rank's copy would stay, untrained, in its state_dict() (and "
                    "a checkpoint could save it).\nHow to fix: compile the model again after adding or replacing them, "
                    "on every rank."
                )
            self._build()
        refuse_moved_stages(self._programs[mode], across=self._compiled.placement is not None)
        return self._programs[mode]

    def _check_micro_batches(self, values: dict[str, Any], dims: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Program:
        """The first call of two samples or more (not all alike), where the example had one
        (or samples all alike): compiling's check that micro-batches compute what the whole batch does,
        on this call's inputs (raising as compiling would have); the stages are built again on
        what it found."""
        assert self._compiled.unchecked is not None
        detached = {name: map_tensors(torch.Tensor.detach, value) for name, value in values.items()}
        if not self._compiled.unchecked(detached, dims, (args, kwargs)):  # its samples alike: for a later call
            return self._held_program()
        self._compiled.unchecked = None
        self._build()
        return self._held_program()

    def _refuse_calls_from_its_stages(self) -> None:
        """A call from a stage of this pipeline or of one for another kind of call (from a hook on
        a module it runs) would wait on itself: for its own thread, and for the call in progress."""
        here = threading.current_thread()
        if any(here in pipe._workers.threads for pipe in (self, *self._variants.values())):
            raise RuntimeError(
                "the pipeline was called from inside one of its own stages (from a hook on a module it runs, say): "
                "its stage threads would wait on themselves.\nHow to fix: call it outside its own forward and "
                "backward, or call the module itself inside the hook."
            )

    def _prepare(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], held: Optional[Program] = None, overlapping: bool = False,
        still: Callable[[], ContextManager[Any]] = contextlib.nullcontext, slicing: Optional[SliceSpec] = None,
    ) -> Call:
        """The call split into micro-batches, on the program that runs it (its sequences cut as
        `slicing` says, the pipeline's own way where None). `held`: that program,
        checked against the model already (a loop of overlapping steps checks it once, before
        its first step: later, its stages hold the model's parameter slots while they run).
        `overlapping`: a step of such a loop, whose stages run on the workers, even one alone;
        `still`: what holds the model still meanwhile (its stages out of the model, no update),
        for a proof that runs on the model's tensors."""
        refuse_capture()
        if self._closed:
            raise RuntimeError("this Pipeline was closed (pipe.close()); compile the model again to run it")
        self._refuse_calls_from_its_stages()
        refuse_modes_the_stages_would_miss(overlapping or (self._channel is None and len(self._workers.threads) > 1))
        program = self._held_program() if held is None else held
        refuse_other_autocast(self._compiled)
        values = self._compiled.bind(args, kwargs)
        for name in self._compiled.marked_for_grad:  # as the plain model's forward marks the caller's tensor
            value = values.get(name)
            if isinstance(value, torch.Tensor) and value.is_leaf and not value.requires_grad and takes_gradients(value):
                value.requires_grad_()
        dims = kept_whole(values, self._compiled.example_leaves, self._dims(args, kwargs))
        batch = batch_size_of(list(values.values()), dims)
        if batch == 0:
            raise ValueError(
                f"the input batch is empty (size 0 along dim {batch_dim_of(list(values.values()), dims)}): a pipeline has no "
                "micro-batch to run, where the plain model returns an empty output.\nHow to fix: skip empty batches "
                "(`if x.shape[0]:`), or give at least one sample."
            )
        unbatched = fewer_dims(values, self._compiled.example_leaves) if self._chunks > 1 else []
        if unbatched:
            raise ValueError(
                f"inputs have fewer dims than the example's, whose batch they split: {', '.join(unbatched)}: "
                "a sample without its batch dim? Its features would be split as samples.\n"
                "How to fix: pass a batch (x.unsqueeze(0) for one sample)."
            )
        if self._compiled.unchecked is not None and batch is not None and batch > 1:
            if overlapping:  # (the check builds the stages again, which the loop holds: not between its steps)
                raise ValueError(
                    "train_steps with schedule='2bw' runs on micro-batches that this pipeline has not checked yet: it was "
                    "compiled on an example of one sample, or of samples all alike (zeros), which shows nothing of whether "
                    "micro-batches compute what the whole batch does.\nHow to fix: call it once on a batch of samples that "
                    "differ first (pipe(x), or pipe.train_step(...), which run the check), or compile it on such an example."
                )
            program = self._check_micro_batches(values, dims, args, kwargs)
        compiled = self._compiled
        # Not checked yet (this call's samples all alike, as the example's): one micro-batch, as the plain model.
        chunks = 1 if compiled.unchecked is not None else self._chunks
        call = split_call(program, values, batch, dims, chunks, compiled.example_leaves, compiled.check_micro_batch, self._channel is not None)
        if compiled.check_length is not None:
            compiled.check_length(call.micro_batches, self.training, slicing or compiled.slicing, still)
        return call

    def _dims(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Dims:
        """How to split each input tensor that `chunk_spec` names, keyed by the tensor's id."""
        return spec_dims(self._signature, self._compiled.chunk_spec, args, kwargs)

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
        refuse_parametrization_cache()  # each batch of a loop too: its caller may enter the block between two
        refuse_own_hooks(self, "train_steps" if versions is not None else "train_step")  # (across processes, on every rank at once)
        still = versions.still if versions is not None else contextlib.nullcontext
        call = self._prepare(args, kwargs, held, overlapping=versions is not None, still=still, slicing=slicing)
        schedule = self._plan.schedule if call.grad else "gpipe"
        if loss_fn is not None or return_outputs:  # the outputs are put together from the micro-batches
            own_whole = loss_fn is None and (slicing or self._compiled.slicing) is None  # (slices' outputs are joined per row)
            template = with_own_loss_whole(call.program.template, call.program.own_loss_leaf) if own_whole else call.program.template
            refuse_outputs_of_the_whole_batch(template, len(call.sizes), asked=return_outputs)
        along = batch_dim_of(list(call.values.values()), call.dims)
        made = call.program.template
        targets = split_target(
            kept.leaf_target(target), call.sizes, call.batch, along, output_batch_dims(made), self._target_dims, output_batch_dims_by_path(made),
        )  # fmt: skip
        if loss_fn is None:
            reduction = own_loss_reduction(call, reduction, sliced=(slicing or self._compiled.slicing) is not None)
        weights = [size / sum(call.sizes) if reduction == "mean" else 1.0 for size in call.sizes]
        call = sliced_call(call, slicing or self._compiled.slicing)
        counted = own_mean_weights(call) if loss_fn is None and reduction == "mean" and call.slices is None else None
        if call.slices is not None:  # each row's slices run as micro-batches, each with its positions of the target
            targets, weights = call.slices.targets(targets), call.slices.weights(weights, reduction)
        elif counted is not None:  # the model's own mean over the targets it counts: weighted by their counts
            weights = counted
        micro_batch_loss = MicroBatchLoss(
            call, loss_fn, targets, weights, kept, target_note(target, call.batch, len(call.sizes)), across=self._channel is not None,
            overlapped=versions is not None,
        )  # fmt: skip

        if loss_fn is None and len(call.sizes) > 1 and counted is None and call.program.own_loss_combines == "neither":
            raise ValueError(
                f"train_step would combine the model's own loss over micro-batches as a {reduction} over samples, and on "
                "the example it is neither the sum nor the mean of its parts' losses (a term of the whole batch, a "
                "penalty added once): the result would differ from the plain model's.\nHow to fix: return the "
                "outputs the loss needs and pass loss_fn (checked on every step), adding a term of the whole batch "
                "outside the pipeline; or use chunks=1."
            )
        if loss_fn is None and len(call.sizes) > 1 and counted is None and call.program.own_loss_combines != "sum" and not self._own_loss_warned:
            self.__dict__["_own_loss_warned"] = True
            found = call.program.own_loss_combines
            said = (
                f"train_step combines the model's own loss over micro-batches as a {reduction} over samples"
                + (" (as it is on two parts of the example)" if found == "mean" else "")
                + ", and cannot check that it is one on every batch: a mean over a count that varies between "
                "micro-batches (tokens not ignored, say) is not. Pass loss_fn (checked on every step) or use "
                "chunks=1 for such a loss"
                + ("." if found == "mean" else "; pass reduction='sum' for a loss summed over samples, or divided by "
                   "a count given to the model for the whole batch (num_items_in_batch, as Hugging Face's Trainer gives).")
            )
            warnings.warn(said, stacklevel=caller_stacklevel())
        step = self._step(call, schedule, loss=micro_batch_loss, versions=versions, batch=batch)
        # A loss refused after the step: its writes too. Held weakly: the step's loss holds `kept`,
        # and a cycle would keep the step (its outputs) until the garbage collector runs.
        kept.undo.append(weakref.WeakMethod(step.put_back_buffers))
        return call, step

    def _step(self, call: Call, schedule: str, loss: Any, versions: Optional[Versions] = None, batch: int = 0) -> Step:
        program = call.program
        stop = checkpoint_stop(self._checkpoint, len(call.sizes)) if self.training and call.grad else 0
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
            output_device=self._devices[-1],
            input_devices=devices_of(call.values),
            context=call.context,
            schedule=make_schedule(schedule, program.layout, len(call.sizes), stop, loss is not None, call.slices.per_row if call.slices else 1),
            layout=program.layout,
            batch_stats=BatchStatistics() if self._compiled.deferred_batch_norm and self.training else None,
            loss=loss,
            meter=ActivationMeter(len(program.stages), program.parameters, self._devices) if self.measure_memory else None,
            mailbox=mailbox,
            rank=rank,
            global_rank=None if self._channel is None else self._channel.ranks[self._channel.me],
            weights=versions,
            batch=batch,
            slices=call.slices,
            sizes=call.sizes if call.slices is None else None,
        )
        self.__dict__["last_timeline"], self.__dict__["last_most_alive"] = step.timeline, step.most_alive
        self.__dict__["last_peak_bytes"] = step.meter.peak if step.meter is not None else []
        self.__dict__["last_meter"] = step.meter
        return step

    def _shared(self, program: Program, grad: bool) -> list[list[torch.Tensor]]:
        """Each stage's own copy, for this step, of the tensors several stages read."""
        shared = []
        for index, (tensors, device) in enumerate(zip(program.shared, self._devices)):
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

    def _kept_whole_in(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
        """The arguments of a call of another kind that the example kept whole (a table, a mask),
        each a tensor of as many dims here: its pipeline keeps them whole too, whatever the batch
        size of the call it is compiled from."""
        if self._signature is None:
            return []
        try:
            bound = self._signature.bind(*args, **kwargs).arguments
        except TypeError:
            return []
        # Under torch.export the example's leaves are named by the graph's inputs: by argument here.
        placeholders = [n for n in self._compiled.cuts[True].graph.graph.nodes if n.op == "placeholder"]
        named = {n.name: str(n.meta.get("argument", n.name)) for n in placeholders}
        example = {named.get(name, name): leaves for name, leaves in self._compiled.example_leaves.items()}
        return [
            name for name, value in bound.items()
            if isinstance(value, torch.Tensor) and [leaf[:2] if leaf else None for leaf in example.get(name, ())] == [(value.dim(), True)]
        ]  # fmt: skip

    def _variant(self: P, other: OtherCall, args: tuple[Any, ...], kwargs: dict[str, Any]) -> P:
        """The pipeline for calls of another kind than the example (an optional argument left
        out, or given where the example left it None): compiled on the first such call, from the
        model as it is then and this call's arguments, and kept. Refused across processes, where
        every rank would have to compile it at the same call."""
        variants: collections.OrderedDict[Any, P] = self._variants
        found = variants.get(other.key)
        if found is not None and found.__dict__.get("_for_one_sample") and not is_one_sample(args, kwargs):
            variants.pop(other.key).close()  # compiled from a call of one sample, as one micro-batch: compiled again
            found = None
        if found is not None:
            variants.move_to_end(other.key)
        elif self._recompile is None:
            raise other
        else:
            try:
                started = time.perf_counter()
                with self._traced_forward():
                    found = self._recompile(self._owner, args, kwargs, self._kept_whole_in(args, kwargs))
                self._say_numbers_held(other, time.perf_counter() - started)
            except Exception as error:  # the model itself may refuse this call, or this call as an example
                first, *rest = [line.strip(" -") for line in str(other).partition("\nHow to fix")[0].splitlines()]
                differs = " ".join([first, "; ".join(rest)]).strip().rstrip(".")
                error.add_note(
                    f"This call is of another kind than the example ({differs}): stages are compiled "
                    "for each kind of call on its first call, with that call as their example, and compiling them from "
                    "this one failed as above."
                )
                raise
            if len(variants) >= VARIANTS:
                variants.popitem(last=False)[1].close()
                if not self._variants_warned:
                    self.__dict__["_variants_warned"] = True
                    warnings.warn(
                        f"this pipeline has compiled stages for more than {VARIANTS} kinds of call (arguments given or "
                        "left out, left None): it keeps the last ones, and compiles again for the others. Call it with "
                        "fewer kinds of arguments, or compile a pipeline for each.",
                        stacklevel=caller_stacklevel(),
                    )
            variants[other.key] = found
        # One call at a time on the model, whichever of its pipelines runs it; the targets' split
        # dims as any of them found them. The model's own hooks run around the call that asks for it.
        found.__dict__.update(_checkpoint=self._checkpoint, measure_memory=self.measure_memory, _one_call=self._one_call,
                              _target_dims=self._target_dims, _runs_model_hooks=False)  # fmt: skip
        return found

    def _say_numbers_held(self, other: OtherCall, seconds: float) -> None:
        """Once: stages compiled again for another value of a number (a diffusion sampler's int
        timestep), which each new value would cost again, and how to compile once for all."""
        if not other.numbers or self._numbers_warned:
            return
        self.__dict__["_numbers_warned"] = True
        warnings.warn(
            f"stages were compiled again ({seconds:.1f} s) for another value of {', '.join(other.numbers)}, a number the "
            "exported graph holds: each new value compiles again. Pass it as a tensor (torch.tensor(value), or one "
            "per sample) to compile once for every value.",
            stacklevel=caller_stacklevel(),
        )

    def _traced_forward(self) -> ContextManager[None]:
        """Stages for another kind of call, compiled inside the model's own call by its forward
        replaced since compiling (which calls the pipeline): from the forward traced before."""
        program, code = self._programs[True], self._programs[True].model_code()
        if code is None or not program.model_code_replaced() or not in_the_models_own_call(self._owner):
            return contextlib.nullcontext()
        return traced_forward_put_back(self._owner, code[0], code[1])

    def _ran(self, variant: "PipelineCalls", result: Any) -> Any:
        """What `variant` ran, as this pipeline's last call (for `timeline()`)."""
        for name in ("last_timeline", "last_most_alive", "last_peak_bytes", "last_meter"):
            self.__dict__[name] = variant.__dict__[name]
        return result
