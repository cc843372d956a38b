"""The forward bodies of a step's actions: a stage's forward and the loss, on one micro-batch.

The backward bodies are in fxpipe/runtime/backward_tasks.py. `Step` (fxpipe/runtime/step.py)
holds the state they read and drives them; its docstring draws each action.
"""
from __future__ import annotations

import time
import weakref
from contextlib import ExitStack, nullcontext
from functools import partial
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch

from fxpipe.compiled.program import StageRuntime
from fxpipe.core.carry import SliceState, in_slice
from fxpipe.core.edges import CALLER
from fxpipe.core.microbatch import clone_tree, leaves_of, map_tensors, takes_gradients
from fxpipe.core.randomness import TaskRandomness, TaskStream, Unseen, default_generator_held, task_stream
from fxpipe.runtime.batchnorm import BatchStatistics, collecting
from fxpipe.runtime.checkpoint import (
    Flags, attributes_of, checkpointing, refuse_gradients_through, swapped_slots, swapped_state,
)
from fxpipe.runtime.context import CallerContext
from fxpipe.runtime.devices import Parcel, send
from fxpipe.runtime.losses import value_grads
from fxpipe.runtime.memory import ActivationMeter
from fxpipe.runtime.raw_grads import raw_grads
from fxpipe.runtime.rollback import Rollback
from fxpipe.runtime.saved import Saved, refuse_written_leaves
from fxpipe.runtime.slices import SliceGrid
from fxpipe.runtime.stage_error import LossError
from fxpipe.runtime.versions import Versions, own_alias
from fxpipe.runtime.weight_grad import Weights
from fxpipe.schedules.actions import Schedule


# The loss of one micro-batch, weighted for the batch, given its index and its output values
# (fresh leaves, or the loss stage's own values: see `StageTasks._fuses`).
LossFn = Callable[[int, dict[str, Any]], torch.Tensor]


class StageTasks:
    """The forward action bodies of a step, on one stage and one micro-batch each, and the state
    every action body reads, which `Step` sets in its `__init__`."""

    stages: Sequence[StageRuntime]
    micro_batches: Sequence[dict[str, Any]]
    grad: bool
    checkpoint_stop: int
    shared: Sequence[list[torch.Tensor]]
    output_device: torch.device
    input_devices: dict[str, torch.device]
    context: CallerContext
    bare_forward: bool
    schedule: Schedule
    batch_stats: Optional[BatchStatistics]
    loss: Optional[LossFn]
    loss_stage: int
    losses: dict[int, torch.Tensor]
    outputs: dict[int, dict[str, Any]]
    meter: Optional[ActivationMeter]
    mailbox: Any
    caller_grads: bool
    sink: int
    output_names: list[str]
    saved: dict[tuple[int, int], Saved]
    fused: dict[int, Optional[torch.Tensor]]
    _fusable: bool
    alive: list[int]
    most_alive: list[int]
    flags: list[Optional[Flags]]
    randomness: list[bool]
    hidden_randomness: list[Unseen]
    seed: int
    _peeked: bool
    _streams: list[TaskStream]
    rollback: Rollback
    param_leaves: list[Optional[list[torch.Tensor]]]
    view_swaps: list[Optional[list[tuple[dict[str, Any], str, torch.Tensor]]]]
    shared_views: list[Optional[list[torch.Tensor]]]
    weights: list[Optional[Weights]]
    grad_patterns: list[Optional[tuple[bool, ...]]]
    versions: Optional[Versions]
    batch: int
    copies_made: list[bool]
    # Slices of a sequence (fxpipe/runtime/slices.py): by (stage, micro-batch), the carries each
    # forward reads (leaves), those it made (for its backward), and their gradients (from the
    # next slice's backward).
    slices: Optional[SliceGrid]
    carry_in: dict[tuple[int, int], dict[int, torch.Tensor]]
    carry_made: dict[tuple[int, int], dict[int, torch.Tensor]]
    carry_grads: dict[tuple[int, int], dict[int, Optional[torch.Tensor]]]

    def _post_output_grads(self, i: int, grads: dict[str, Any]) -> None:
        for stage in self.stages:
            for name, dsts in stage.consumers.items():
                if self.sink in dsts:
                    self.mailbox.put(("bwd", stage.index, i, name, self.sink), send(grads.get(name), stage.device))

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
                if self.versions is not None:
                    leaves = [own_alias(p) if p.requires_grad else p for p in stage.params]
                else:  # once per parameter per step: no call per parameter
                    leaves = [p.detach().requires_grad_() if p.requires_grad else p for p in stage.params]
                views = [self._as_read(leaf) for leaf in leaves] if self.context.autocast else leaves
            if stage.compiled is not None and stage.compiled.static_outputs:
                _own_grads([leaf for leaf in leaves if leaf.requires_grad])
            swaps = [(table, attr, view) for view, slots in zip(views, stage.param_slots) for table, attr in slots]
            self.param_leaves[stage.index], self.view_swaps[stage.index] = leaves, swaps
        return swaps

    def _slots_held(self, stage: StageRuntime) -> ContextManager[Any]:
        """The step's leaves in the stage's parameter slots, for a backward that runs the model's
        modules again (`StageRuntime.reenters`): a reentrant checkpoint's recompute reads what the
        forward read, and its gradients go where the stage's others go."""
        swaps = self.view_swaps[stage.index]
        if not stage.reenters or not swaps:
            return nullcontext()
        stack = ExitStack()
        if self.versions is not None:  # overlapping steps: the caller's hooks may be reading the model
            stack.enter_context(self.versions.gate.entered())
        stack.enter_context(swapped_slots(swaps, self.versions.slots if self.versions is not None else None))
        return stack

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
        passes its gradient on as it is: a sparse one (an embedding's) too. Not in a forward run
        without gradients (a checkpointed one), which accumulates none: there an alias would be a
        view made under no_grad, which a module differentiating its input under enable_grad (a
        gradient penalty kept whole) could not differentiate."""
        return torch.ops.aten.alias.default(leaf) if leaf.requires_grad and self.context.autocast and torch.is_grad_enabled() else leaf

    def _values_as_read(self, values: Any) -> Any:
        """Values another stage or slice sent (leaves that take a gradient), as a stage or the
        loss reads them: under the caller's autocast, through an alias, as the parameters are. Autocast
        caches its casts of such leaves in one table that every thread shares and that any
        thread's region empties as it closes: whether two uses of a value shared one cast (and
        their gradients added up in bfloat16 before the cast back) would turn on the timing of
        other stages. The plain model's activations are no leaves: it casts them at every use."""
        if not self.context.autocast:
            return values
        return map_tensors(lambda t: self._as_read(t) if t.is_leaf else t, values)

    def _call(self, stage: StageRuntime, i: int, inputs: list[Any], buffers: Optional[dict[str, torch.Tensor]] = None) -> tuple[Any, ...]:
        if self.slices is None:
            return self._call_stage(stage, i, inputs, buffers)
        # A slice of a sequence: it reads where it starts and what its row's earlier slice carried.
        state = SliceState(self.slices.offset(i), self._values_as_read(self.carry_in.get((stage.index, i), {})))
        with in_slice(state):
            results = self._call_stage(stage, i, inputs, buffers)
        self.carry_made[(stage.index, i)] = state.made
        return results

    def _hand_on_carries(self, i: int, j: int, checkpointed: bool) -> None:
        """After slice `i`'s forward on stage `j`: what it carried, as leaves for the next slice
        of its row. Kept for the backward where it has one (a recompute makes them again)."""
        assert self.slices is not None
        made = self.carry_made.get((j, i), {})
        if not self.slices.last(i):
            self.carry_in[(j, i + 1)] = {c: t.detach().requires_grad_(self.grad and takes_gradients(t)) for c, t in made.items()}
        if not self.grad or checkpointed:
            self.carry_made.pop((j, i), None)
        if not self.grad:
            self.carry_in.pop((j, i), None)

    def _call_stage(self, stage: StageRuntime, i: int, inputs: list[Any], buffers: Optional[dict[str, torch.Tensor]] = None) -> tuple[Any, ...]:
        args = [*self._values_as_read(inputs), *self._shared_views(stage)]
        views = self._param_views(stage)
        # Under the caller's saved-tensor hooks a compiled stage runs as the model does: its
        # compiled backward saves tensors the model never saves (a ReLU's bool mask), which a
        # hook that casts what it packs would hand back in another dtype, unchecked.
        if not self._runs_compiled(stage):
            forward = stage.module.forward  # type: ignore[attr-defined]
        else:
            assert stage.compiled is not None
            hidden = self.hidden_randomness[stage.index] is not Unseen.NOWHERE
            forward = stage.compiled.runner(self.randomness[stage.index], hidden, bool(views))
        if self.context.plain and not self.randomness[stage.index] and buffers is None and self.versions is None:
            if not views:
                return forward(*args)
            with swapped_slots(views):
                return forward(*args)
        with ExitStack() as stack:
            self.context.enter(stack)
            if self.randomness[stage.index]:
                unseen = self.hidden_randomness[stage.index]
                stream = TaskStream(self.seed, i, stage.index, per_node=unseen is Unseen.MARKED)
                if self._peeked:
                    self._streams.append(stream)
                stack.enter_context(task_stream(stream))
                if unseen is Unseen.ANYWHERE:
                    stack.enter_context(TaskRandomness(stream))
            watch = None
            if self.versions is not None:  # overlapping steps: the caller's hooks may be reading the model (its buffers too)
                stack.enter_context(self.versions.gate.entered())
                watch = self.versions.slots  # and the caller's code between two losses assigning it
            if views:
                stack.enter_context(swapped_slots(views, watch))
            if buffers is not None:
                stack.enter_context(swapped_state(stage.module, buffers, watch))  # type: ignore[arg-type]
            return forward(*args)

    def _runs_compiled(self, stage: StageRuntime) -> bool:
        """Whether the stage runs its compiled forward: not under the caller's saved-tensor hooks."""
        return stage.compiled is not None and self.context.saved_hooks is None

    def _versions_read(self, stage: StageRuntime, kept: list[Any]) -> list[tuple[str, torch.Tensor, int]]:
        """The caller's tensors a forward read (not copies), with their versions (but inference
        tensors, which have none, and which nothing writes outside inference mode)."""
        return [
            (name, t, t._version) for name, value in zip(stage.inputs, kept)
            if stage.sources[name] == CALLER and name not in stage.written for t in leaves_of(value) if isinstance(t, torch.Tensor) and not t.is_inference()
        ]  # fmt: skip

    def _params_requiring_grad(self, stage: int) -> tuple[bool, ...]:
        """Which of the stage's parameters and shared copies require grad (once per step)."""
        found = self.grad_patterns[stage]
        if found is None:
            found = self.grad_patterns[stage] = tuple(p.requires_grad for p in [*self.stages[stage].params, *self.shared[stage]])
        return found

    def _params_read(self, stage: int) -> list[torch.Tensor]:
        """The stage's parameters, and its copies of shared ones (a copy on the parameter's
        device is the parameter's memory: a write to one is seen by the other). Of overlapping
        steps, the step's own leaves, which an update of the parameters leaves as they were."""
        own = self.param_leaves[stage] if self.versions is not None else None
        return [*(own if own is not None else self.stages[stage].params), *(t for t in self.shared[stage] if t.requires_grad)]

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
        if not self.copies_made[j]:  # overlapping steps: this batch's version of the tied weights
            assert self.versions is not None
            self.shared[j] = self.versions.copies(j, self.batch, stage.device, self.grad)  # type: ignore[index]
            self.copies_made[j] = True
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
            # A compiled stage runs its training graph, the one its recompute runs: inductor
            # rounds its no_grad graph apart from it under autocast (what a kernel keeps in
            # float32), a bfloat16 step that would set the checkpoint modes apart. What that
            # graph saves is dropped with the outputs' graph as the task ends.
            under_grad = known is None or self._runs_compiled(stage)
            with torch.enable_grad() if under_grad else torch.no_grad(), checkpointing(), collecting(self.batch_stats):  # (2)
                results = self._call(stage, i, inputs)
            # The caller's tensors are about to be written: the recompute needs them as they were.
            kept = [clone_tree(v) if n in stage.written else v for n, v in zip(stage.inputs, inputs)]
            versions = [p._version for p in self._params_read(j)]
            read = [b._version for b in stage.read_buffers.values()]
            self._keep(i, j, Saved(kept, None, buffers, attributes=attributes, versions=versions, buffer_versions=read, input_versions=self._versions_read(stage, kept)))
            if self.meter is not None:
                self.meter.add(i, j, [t for v in kept for t in leaves_of(v)])
            outputs = self._write_back(stage, i, results)
            if known is None:
                known = stage.output_grads[pattern] = [t.requires_grad for v in outputs for t in leaves_of(v) if isinstance(t, torch.Tensor)]
            wants = _differentiable_outputs(outputs, known)
        else:
            results = self._run_forward(stage, i, j, inputs)
            outputs = self._write_back(stage, i, results)
            if self.grad:
                self._keep(i, j, Saved(inputs, outputs, input_versions=self._versions_read(stage, inputs)))
            wants = requires_grad
        if self.grad and stage.stored:
            refuse_gradients_through(stage.stored, self._upstream(j))
        if self.slices is not None:
            self._hand_on_carries(i, j, checkpointed)
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

    def _run_forward(self, stage: StageRuntime, i: int, j: int, inputs: list[Any]) -> tuple[Any, ...]:
        """(2) for a forward that keeps its graph (or, without grad, makes none): under the step's
        grad mode, collecting the batch's BatchNorm statistics, metering what autograd saves;
        without entering any of them where none changes anything (the common case), as they cost
        as much as a small stage's own work."""
        if self.bare_forward and torch.is_grad_enabled() == self.grad:
            return self._call(stage, i, inputs)
        with torch.set_grad_enabled(self.grad), collecting(self.batch_stats), self._metered(i, j):
            return self._call(stage, i, inputs)

    def _keep(self, i: int, j: int, saved: Saved) -> None:
        self.saved[(i, j)] = saved
        self.alive[j] += 1
        self.most_alive[j] = max(self.most_alive[j], self.alive[j])

    def _release(self, i: int, j: int) -> Saved:
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
                with default_generator_held():  # a loss that draws (label noise) draws the caller's numbers
                    loss = self.loss(i, self._values_as_read(values))
                grads = value_grads(loss, values) if self.grad and not fused else {}
        except Exception as e:
            raise LossError() from e
        except BaseException as e:  # an interrupt goes as it is: marked as struck in the loss
            e.fxpipe_phase = "loss"  # type: ignore[attr-defined]
            raise
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
                pairs = [(t, final) for t, final in zip(leaves_of(self.micro_batches[i][name]), leaves_of(value))
                         if isinstance(t, torch.Tensor) and t is not final and _changed(t, final, stage.compiled is not None)]  # fmt: skip
                if self.grad:
                    refuse_written_leaves(name, [t for t, _ in pairs])
                for target, final in pairs:
                    self.rollback.write_input(target, final)  # a failed step puts it back
        return outputs

def _changed(given: torch.Tensor, final: torch.Tensor, compiled: bool) -> bool:
    """Whether a stage wrote its copy of an input leaf (cloned on entry, `_version` 0): its
    version is above 0. A compiled stage returns a new tensor for what it wrote (its graph is
    made functional), and an inference tensor keeps no version: their values tell."""
    if compiled or final.is_inference():
        return final.shape != given.shape or not torch.equal(final, given.to(final.device))
    return final._version > 0


def _own_grads(leaves: Sequence[torch.Tensor]) -> None:
    """For leaves a CUDA graph's backward reaches: the first gradient each receives is copied
    before autograd keeps it as `.grad` (later ones are added into that), where autograd would
    keep it as it came, in the graph's static memory, which the next replay writes."""
    for leaf in leaves:
        leaf.register_hook(partial(_copied_if_first, weakref.ref(leaf)))


def _copied_if_first(leaf: "weakref.ref[torch.Tensor]", grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    held = leaf()
    return grad.clone() if grad is not None and held is not None and held.grad is None else grad


def requires_grad(t: torch.Tensor) -> bool:
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


def differentiable(outputs: Sequence[Any], grads: Sequence[Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The (output, gradient) pairs that autograd can take: outputs that require grad and got one."""
    tensors, grad_tensors = [], []
    for output, grad in zip(outputs, grads):
        if grad is None:
            continue
        if isinstance(output, torch.Tensor):  # the common case, without a pytree walk
            if output.requires_grad:
                tensors.append(output)
                grad_tensors.append(grad)
            continue
        for t, g in zip(leaves_of(output), leaves_of(grad)):
            if isinstance(t, torch.Tensor) and t.requires_grad and g is not None:
                tensors.append(t)
                grad_tensors.append(g)
    return tensors, grad_tensors
