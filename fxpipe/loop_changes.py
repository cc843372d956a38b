"""The model as a 2bw loop found it: what the caller's code between batches may not change, and the check around each of its hooks."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from fxpipe.compiled.program import Hooks, Program, hooks_that_count
from fxpipe.core.hooks import gradient_hooks, hook_tables
from fxpipe.core.unseen_changes import Unseen, attributes_changed, whole_attributes
from fxpipe.core.wording import listed
from fxpipe.guards import traced_mode
from fxpipe.passes.state import ASSIGNS
from fxpipe.runtime.checkpoint import dropout_rate_of
from fxpipe.runtime.versions import SlotWatch, Versions

# The Pipeline the loop runs (fxpipe/pipeline.py, which imports this module: not imported here).
PipelineLike = Any


class ModelAsFound:
    """What the loop's batches ran on, as its first batch found it: the modules' modes, dropout
    rates and hooks, the hooks on the parameters' gradients, and the plain attributes of the
    modules called whole. Under 2bw the next batch starts before the caller's code after a loss
    runs, so a change there could be followed by no batch: it is refused, saying where."""

    def __init__(self, pipe: PipelineLike, program: Program) -> None:
        self.pipe, self.program = pipe, program
        # The modules called whole whose attributes a hook may not set: those whose forward
        # assigns its own (a call counter) change them as they run, recomputes too.
        whole = {str(n.target) for n in program.cut.graph.graph.nodes if n.op == "call_module"}
        self.whole = whole - {name for name in whole if any(name == a or name.startswith(a + ".") for a in _assigning(program))}
        self.modes: dict[str, bool] = {}
        self.rates: dict[str, Optional[float]] = {}
        self.hooks: dict[str, Hooks] = {}  # each module's hooks, by their handles' ids
        self.gradient_hooks: dict[str, tuple[int, ...]] = {}  # each parameter's hooks on its gradient
        self.names: dict[int, str] = {}  # each parameter's name, by id

    def take(self, program: Program) -> None:
        """The model as it is now, before the loop's first batch runs, on `program`'s stages."""
        owner = self.pipe._owner
        self.program = program
        self.modes = {name: m.training for name, m in owner.named_modules()}
        self.hooks = _hooks_of(owner)
        # Read from the parameters themselves: a stage in flight holds its own tensors in the slots.
        self.names = {id(p): name for name, p in owner.named_parameters()}
        self.gradient_hooks = self._gradient_hooks()
        self.rates = {name: dropout_rate_of(m) for name, m in owner.named_modules()}

    def run_hook(self, hook: Callable[[], Any], where: str, versions: Versions, held: Optional[Program]) -> None:
        """The caller's hook, run while no stage holds the model's parameter slots; then the
        model as the loop found it, its tensors' values too (a weight clamped in place), or refused."""
        with versions.gate.shut():
            # Read once the stages are out of the model's slots: a stage in flight holds its own
            # tensors there, whose counts would not see the hook write the model's.
            owner = self.pipe._owner
            tensors = [*owner.named_parameters(remove_duplicate=False), *owner.named_buffers(remove_duplicate=False)]
            before = [t._version for _, t in tensors]
            # What no version counts: writes through .data, and the attributes of the modules
            # called whole, which read them as they run (a forward's own changes run in no hook).
            unseen, attributes = Unseen.of(owner), whole_attributes(owner, self.whole)
            self.pipe.__dict__["_in_hook"] = True  # the model is whole: its state dict may be read
            try:
                hook()
            finally:
                self.pipe.__dict__["_in_hook"] = False
            written = list(dict.fromkeys(name for (name, t), version in zip(tensors, before) if t._version != version))
            set_ = [f"{name} (an attribute of a module called whole)" for name in attributes_changed(attributes, whole_attributes(owner, self.whole))]
            self.refuse_changes(where, held, slots=True, written=written or unseen.written(Unseen.of(owner)) + set_)

    def refuse_changes(
        self, where: str, held: Optional[Program], slots: bool, written: Sequence[str] = (), watch: Optional[SlotWatch] = None,
    ) -> None:  # fmt: skip
        """The model as the loop's first batch found it, or refused: the batches after `where`
        started before it, on the model as it was. `held`: the program the loop's batches run.
        `slots`: no stage holds the model's parameter slots (the gate is shut), so that a tensor
        replaced there shows; else `watch` tells a slot assigned from one a stage holds.
        `written`: the model's tensors written in place there."""
        found = self._changed(held, slots, watch) or (f"{listed(written)} written in place or set" if written else "")
        if found:
            raise RuntimeError(
                f"train_steps (schedule='2bw'): the model changed {where}: {found}. Under 2bw the next batch started "
                "before that, on the model as it was, so the loop can neither follow the change from the next batch, "
                "as a synchronous loop does, nor undo it.\nHow to fix: change the model between loops (break out of "
                "this one, which completes the update of the last loss it gave; change it; start another), or use a "
                "synchronous schedule (1f1b), which follows such a change from the next batch or says why it cannot."
            )

    def _changed(self, held: Optional[Program], slots: bool, watch: Optional[SlotWatch] = None) -> str:
        pipe = self.pipe
        flipped = [f"{name or 'the model'} ({'train' if was else 'eval'} -> {'eval' if was else 'train'})"
                   for name, m in pipe._owner.named_modules() if (was := self.modes.get(name, m.training)) != m.training]  # fmt: skip
        if flipped:
            return f"the mode (train() or eval()) of {', '.join(flipped)}"
        # The stages read a dropout's rate as they run: the batch in flight would take a new one
        # at some micro-batch, as the threads' timing decides.
        rated = [f"{name} ({was} -> {now})" for name, m in pipe._owner.named_modules()
                 if (was := self.rates.get(name)) != (now := dropout_rate_of(m)) and name in self.rates]  # fmt: skip
        if rated:
            return f"the dropout rate of {', '.join(rated)}"
        try:
            traced_mode(pipe._owner, pipe._programs, pipe._compiled)
        except RuntimeError as error:
            return str(error).partition("\nHow to fix")[0].rstrip(".")
        if any(hook_tables(pipe)):  # hooks on the pipeline itself, which no step of the loop calls
            return "hooks were registered on the Pipeline itself, which train_steps runs no call of"
        # A module called whole runs its hooks as it runs: the batch in flight would take a new one
        # at some micro-batch, as the threads' timing decides.
        hooks = _hooks_of(pipe._owner)
        hooked = [name or "the model" for name in sorted({*hooks, *self.hooks}) if hooks.get(name) != self.hooks.get(name)]
        if hooked:
            return f"the hooks of {listed(hooked)} (added or removed)"
        gradient_hooks = self._gradient_hooks()
        hooked = sorted(name for name in {*gradient_hooks, *self.gradient_hooks} if gradient_hooks.get(name) != self.gradient_hooks.get(name))
        if hooked:
            return f"the hooks on the gradients of {listed(hooked)} (added or removed)"
        # Added tensors show whatever the stages hold in the slots: they add no key to a table.
        added = held.held.tensors_added() if held is not None else []
        if added:
            return f"parameters or buffers were added ({listed(added)})"
        if slots and held is not None and held.held.tensors_replaced():
            return "tensors the stages read were replaced (a parameter or buffer assigned, or the model moved or cast)"
        assigned = watch.assigned() if watch is not None and not slots else []
        if assigned:  # (the stages run on their own tensors: they would go on training the ones replaced)
            return f"{listed(assigned)} assigned (a parameter or buffer set on its module, or the model moved or cast)"
        return ""

    def _gradient_hooks(self) -> dict[str, tuple[int, ...]]:
        """The hooks on each parameter's gradient (register_hook, register_post_accumulate_grad_hook),
        by the parameter's name: the ids of their handles."""
        found = {}
        for p in self.program.parameters:
            ids = gradient_hooks(p)
            if ids:
                found[self.names.get(id(p), "?")] = ids
        return found


def _assigning(program: Program) -> set[str]:
    """The modules called whole whose forward assigns what it holds."""
    return {str(n.target) for n in program.cut.graph.graph.nodes if n.op == "call_module" and n.meta.get(ASSIGNS)}


def _hooks_of(model: torch.nn.Module) -> dict[str, Hooks]:
    """The hooks of each module that has any (`hooks_that_count`), by module name."""
    return {name: found for name, m in model.named_modules() if any(found := hooks_that_count(m))}
