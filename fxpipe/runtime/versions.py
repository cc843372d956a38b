"""Two versions of the weights, for steps that overlap (2BW): what a batch's micro-batches run on, and the newest.

Batch t runs on W(t - 1); each stage's update of batch t turns its part of W(t) into W(t + 1)
while batch t + 1, started on W(t), is still in flight:

    a step's leaves      share the parameter's memory, with a version counter of their own
    an update U(t)@s     moves each of stage s's parameters (and the tied weights it reads first)
                         to a copy of itself, then steps the optimizer on them: the in-flight
                         step keeps the old memory, unchanged
    a copy of a tied     made at the reader's first forward of the batch from the version the
    weight               owner kept for that batch (W(batch - 1), kept by its update of two
                         batches before): the same version on both stages, however far the owner
                         has run ahead (its next update may already be done)

A stage's update waits for the batch's gradients to be in `.grad` (and the caller's
`after_backward` run). A stage runs with its leaves in the model's parameter slots: while the
caller's hooks run (which read `model.parameters()`), the gate keeps every stage out of them.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import nn

from fxpipe.compiled.program import HeldState, Program
from fxpipe.runtime.devices import Aborted


def own_alias(p: torch.Tensor) -> torch.Tensor:
    """A leaf on `p`'s memory whose version counter is its own: `p` written in place (an
    update) does not count as a write to what a step saved of it."""
    with torch.no_grad():
        alias = torch.empty(0, dtype=p.dtype, device=p.device).set_(p.untyped_storage(), p.storage_offset(), p.size(), p.stride())
    return alias.requires_grad_(p.requires_grad)


class Gate:
    """Stages enter while they hold the model's parameter slots or set its modules' flags (a
    recompute's); the caller's thread shuts it to read the model (its hooks), waiting for those
    inside to leave."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.inside = 0
        self.shut_by = 0  # nested shuts (a hook that calls pipe.parameters()): open when all end
        self.mine = threading.local()  # `depth`: how deep this thread is inside

    def entered_here(self) -> bool:
        return getattr(self.mine, "depth", 0) > 0

    @contextmanager
    def entered(self) -> Iterator[None]:
        depth = getattr(self.mine, "depth", 0)
        if depth:  # (a recompute's stage call, inside its recompute: waiting here would wait on itself)
            self.mine.depth = depth + 1
            try:
                yield
            finally:
                self.mine.depth = depth
            return
        with self.changed:
            while self.shut_by:
                self.changed.wait()
            self.inside += 1
        self.mine.depth = 1
        try:
            yield
        finally:
            self.mine.depth = 0
            with self.changed:
                self.inside -= 1
                self.changed.notify_all()

    @contextmanager
    def shut(self) -> Iterator[None]:
        with self.changed:
            self.shut_by += 1
            while self.inside:
                self.changed.wait()
        try:
            yield
        finally:
            with self.changed:
                self.shut_by -= 1
                self.changed.notify_all()


class SlotWatch:
    """Which of the model's parameter and buffer slots the stages hold now, and which one a
    stage found holding, or left holding, a tensor other than the model's: the caller's code
    assigned it while the stages ran (`module.weight = nn.Parameter(...)` between two losses).

    Between two losses the caller's thread reads each slot, while the stages put their own
    tensors (V) in and take them out; W is the model's tensor, N the one the caller assigned:

        the caller assigns N    a stage                        the caller's check reads
        while no stage holds    enters, finds N: noted         V, the stage's (N noted)
        while a stage holds V   leaves, finds N: keeps it      N: neither W nor V, noted
    """

    def __init__(self, held: HeldState) -> None:
        self.tensors = held.tensors
        self.model = {(id(table), key): tensor for table, key, tensor in held.tensors}
        self.names = {
            (id(table), key): f"{path}.{key}" if path else key
            for path, module in held.named.items() for table in (module._parameters, module._buffers, vars(module))
            for key in table if (id(table), key) in self.model
        }  # fmt: skip
        self.put: dict[tuple[int, str], torch.Tensor] = {}  # what a stage holds in each slot now
        self.noticed: list[str] = []  # slots a stage found or left assigned

    def enter(self, table: dict[str, Any], key: str, tensor: torch.Tensor) -> tuple[Any, Optional[torch.Tensor]]:
        """A stage puts `tensor` in the slot: what the slot held, and its entry here (an outer hold's)."""
        slot, found = (id(table), key), table[key]
        if slot in self.model and found is not self.model[slot] and found is not self.put.get(slot):
            self._notice(slot)
        before = self.put.get(slot)
        self.put[slot] = tensor  # before the slot itself: the caller reads the slot first
        table[key] = tensor
        return found, before

    def leave(self, table: dict[str, Any], key: str, tensor: torch.Tensor, found: Any, before: Optional[torch.Tensor]) -> None:
        """The stage is done with the slot: what it found put back, unless the caller assigned it
        meanwhile (that assignment stands, and is noticed); then its entry here as it was."""
        slot = (id(table), key)
        if table.get(key) is tensor:
            table[key] = found  # before the entry: the caller reads the slot first
        else:
            self._notice(slot)
        if before is None:
            self.put.pop(slot, None)
        else:
            self.put[slot] = before

    def _notice(self, slot: tuple[int, str]) -> None:
        name = self.names.get(slot, slot[1])
        if name not in self.noticed:
            self.noticed.append(name)

    def assigned(self) -> list[str]:
        """The slots that hold, or held while the loop ran, a tensor other than the model's."""
        for table, key, tensor in self.tensors:
            for _ in range(2):  # read again once: a stage may have gone in or out in between
                now = table.get(key)
                if now is tensor or now is self.put.get((id(table), key)):
                    break
            else:
                self._notice((id(table), key))
        return list(self.noticed)


class Versions:
    """The updates of a loop of overlapping steps, by batch and stage, and the events they wait on."""

    def __init__(
        self, program: Program, optimizer: torch.optim.Optimizer, timeout: Optional[float] = None, here: Optional[Sequence[int]] = None,
    ) -> None:
        self.program, self.optimizer, self.timeout = program, optimizer, timeout
        # Who updates each parameter: the stage that holds it, or for one several stages read
        # (a tied weight), the first of them: its first forward of a batch comes first. Across
        # processes, among the stages `here` only: each rank updates its own copy of a tied
        # weight, with the gradient every rank's copies summed to.
        stages = [s for s in range(len(program.stages)) if here is None or s in here]
        self.owner = {id(p): s for s in stages for p in program.stages[s].params}
        for s in stages:
            for t in program.shared[s]:
                if isinstance(t, nn.Parameter):
                    self.owner.setdefault(id(t), s)
        self.read = {id(p) for p in program.parameters}  # (by any stage, on any rank)
        self.updates: list[list[nn.Parameter]] = [[] for _ in program.stages]
        seen: set[int] = set()
        for p in program.parameters:
            if id(p) in self.owner and id(p) not in seen:
                seen.add(id(p))
                self.updates[self.owner[id(p)]].append(p)
        self.updated = [p for stage in self.updates for p in stage]  # every stage's, in turn
        # Of each tied weight, the version each batch in reach runs on (W(batch - 1)), by batch:
        # the initial one for batches 0 and 1, then what the owner's update of batch t - 2 made.
        self.kept: dict[int, dict[int, torch.Tensor]] = {
            id(t): {0: t.detach(), 1: t.detach()} for s in stages for t in program.shared[s] if isinstance(t, nn.Parameter)
        }
        self.lock = threading.Lock()  # one optimizer step at a time: each swaps the optimizer's groups
        # Each batch's optimizer settings (lr, momentum, ...) as they were when its gradients were
        # in, which its update runs with: a synchronous loop steps there, before the caller's
        # code after the loss (a scheduler stepped on it) changes them for the next update.
        self.settings: dict[int, list[dict[str, Any]]] = {}
        self.members: dict[int, list[list[torch.Tensor]]] = {}  # each group's parameters then, likewise
        # The optimizer's state as the last batch's update will find it, which nothing may change
        # before: a synchronous loop has stepped there already.
        self.state_held: StateMarks = (0, {})
        self._ready: dict[int, threading.Event] = {}
        self._done: dict[tuple[int, int], threading.Event] = {}
        self._events = threading.Lock()
        self.aborted = False
        self.gate = Gate()
        self.slots = SlotWatch(program.held)

    # -- events ---------------------------------------------------------------------------
    def _event(self, table: dict, key: object) -> threading.Event:  # type: ignore[type-arg]
        with self._events:
            return table.setdefault(key, threading.Event())

    def hold_settings(self, batch: int) -> None:
        """The optimizer's settings and groups now, which batch `batch`'s update will run with;
        its parameters no stage holds stepped, as a synchronous loop steps them here; a mark of
        its state, which the update will read."""
        self.settings[batch] = group_settings(self.optimizer)
        self.members[batch] = [list(group["params"]) for group in self.optimizer.param_groups]
        for old in [b for b in self.settings if b < batch - 2]:
            del self.settings[old], self.members[old]
        self._step_outside(batch)
        self.state_held = state_marks(self.optimizer, self.updated)

    def _step_outside(self, batch: int) -> None:
        """The step of the optimizer's parameters that no stage reads (one whose gradient
        `after_backward` gives, an unused module's): no batch runs on them, so their version is
        the newest, stepped where a synchronous loop steps it."""
        outside = [p for group in self.optimizer.param_groups for p in group["params"] if id(p) not in self.read and p.grad is not None]
        with self.lock:
            step_over(self.optimizer, outside, self.settings[batch], self.members[batch])

    def state_changed(self) -> list[torch.Tensor]:
        """The parameters whose optimizer state changed since the last batch's settings were
        held (the caller's code after its loss cleared, loaded or wrote it)."""
        now = state_marks(self.optimizer, self.updated)
        if now[0] != self.state_held[0]:
            return [p for p in self.updated if id(p) in now[1] or id(p) in self.state_held[1]]
        return [p for p in self.updated if not _same_marks(now[1].get(id(p)), self.state_held[1].get(id(p)))]

    def ready(self, batch: int) -> None:
        """Batch `batch`'s gradients are in `.grad` and the caller's code after its loss ran: its
        updates may run."""
        self._event(self._ready, batch).set()

    def is_ready(self, batch: int) -> bool:
        return self._event(self._ready, batch).is_set()

    def is_done(self, batch: int, stage: int) -> bool:
        return self._event(self._done, (batch, stage)).is_set()

    def abort(self) -> None:
        """Every wait stops (raising Aborted): the loop failed or was stopped."""
        self.aborted = True

    def _wait(self, event: threading.Event, what: str) -> None:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while not event.wait(0.05):
            if self.aborted:
                raise Aborted()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"waited {self.timeout} s for {what}: the loop is stuck")

    @contextmanager
    def still(self) -> Iterator[None]:
        """The model held still: no stage in its parameter slots, no update running."""
        with self.gate.shut(), self.lock:
            yield

    # -- work -----------------------------------------------------------------------------
    def update(self, batch: int, stage: int) -> None:
        """U(batch)@stage: once the batch's gradients are in, the optimizer's step on the
        stage's own parameters, each moved to a copy of its memory first."""
        if self.aborted:
            raise Aborted()
        self._wait(self._event(self._ready, batch), f"the gradients of batch {batch}")
        self.apply(batch, stage)

    def apply(self, batch: int, stage: int) -> None:
        params = [p for p in self.updates[stage] if p.grad is not None]
        with self.lock:
            with torch.no_grad():
                for p in params:
                    p.data = p.detach().clone()  # the in-flight step keeps the old memory
            step_over(self.optimizer, params, self.settings.get(batch), self.members.get(batch))
        for p in self.updates[stage]:  # (one without a gradient too: unchanged, it is that version)
            versions = self.kept.get(id(p))
            if versions is not None:  # batch + 2 runs on what this update made; batch's readers all ran
                versions[batch + 2] = p.detach()
                for done in [b for b in versions if b <= batch]:
                    del versions[done]
        self._event(self._done, (batch, stage)).set()

    def copies(self, stage: int, batch: int, device: torch.device, grad: bool) -> list[torch.Tensor]:
        """The stage's copies, for batch `batch`, of the tensors other stages hold too: of a tied
        weight, the version its owner kept for the batch (W(batch - 1)), once its update of
        batch - 2 is done."""
        copies = []
        for tensor in self.program.shared[stage]:
            if not isinstance(tensor, nn.Parameter):
                copies.append(tensor.to(device))
                continue
            owner = self.owner.get(id(tensor))
            if owner is not None and batch >= 2:
                self._wait(self._event(self._done, (batch - 2, owner)), f"stage {owner}'s update of batch {batch - 2}")
            # Not the parameter as it is now: the owner may have run its next update already.
            version = self.kept.get(id(tensor), {}).get(batch, tensor)
            copy_ = own_alias(version) if version.device == device else version.detach().to(device)
            copies.append(copy_.requires_grad_(grad and tensor.requires_grad))
        return copies


def group_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each group's settings but its parameters (a tensor copied: a scheduler fills one in place)."""
    return [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def step_over(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], settings: Optional[list[dict[str, Any]]] = None,
    members: Optional[list[list[torch.Tensor]]] = None,
) -> None:
    """`optimizer.step()` on `params` alone: its groups hold only those for the call (each
    parameter's state is its own, so the others are untouched), of `members` where given (each
    group's parameters when the settings were held), and `settings` where given, each put back
    after the step unless the step itself set it."""
    if not params:
        return
    if settings is not None and len(settings) != len(optimizer.param_groups):
        raise RuntimeError(
            f"under '2bw' a batch's update runs after the caller's code that follows its loss, with the optimizer's "
            f"settings of before it, and that code changed its groups ({len(settings)} then, {len(optimizer.param_groups)} "
            "now: optimizer.add_param_group, say): the update would step groups its batch did not have.\nHow to fix: "
            "change the optimizer's groups in after_step (train_steps(..., after_step=...)), where the next batch's "
            "update sees them, or use a synchronous schedule ('1f1b')."
        )
    chosen = {id(p) for p in params}
    groups = [dict(group) for group in optimizer.param_groups]
    try:
        for group, held, given, then in zip(optimizer.param_groups, groups, settings or [{}] * len(groups), members or [held["params"] for held in groups]):
            group.update(given)
            group["params"] = [p for p in then if id(p) in chosen]
        before = group_settings(optimizer) if settings is not None else []
        optimizer.step()
        if settings is not None:
            _refuse_settings_the_step_changes(optimizer, before)
    finally:
        for group, held, given in zip(optimizer.param_groups, groups, settings or [{}] * len(groups)):
            for key, value in given.items():
                if group.get(key) is value and key in held:
                    group[key] = held[key]
                elif group.get(key) is value:
                    del group[key]
            group["params"] = held["params"]


def _refuse_settings_the_step_changes(optimizer: torch.optim.Optimizer, before: list[dict[str, Any]]) -> None:
    """A step over one stage's parameters that changes its groups' settings (a step count kept
    per group, as timm's Lamb keeps) would count once per stage, each from the settings of its
    batch: refused, naming them. torch's optimizers keep their counts per parameter."""
    changed = sorted({
        key for group, held in zip(optimizer.param_groups, before) for key in {*group, *held} - {"params"}
        if key not in held or key not in group or not _same_setting(group[key], held[key])
    })  # fmt: skip
    if changed:
        raise RuntimeError(
            f"under '2bw' each stage steps the optimizer over its own parameters, and {type(optimizer).__name__}'s step "
            f"changes its groups' settings ({', '.join(map(repr, changed))}: a count kept per group, say): it would count "
            "each stage's step, and a batch's update would not run with the settings of its batch.\nHow to fix: use a "
            "synchronous schedule ('1f1b') with train_steps, or an optimizer that keeps such state per parameter "
            "(optimizer.state[p]), as torch.optim's do."
        )


def _same_setting(now: Any, before: Any) -> bool:
    if isinstance(now, torch.Tensor) or isinstance(before, torch.Tensor):
        return isinstance(now, torch.Tensor) and isinstance(before, torch.Tensor) and torch.equal(now, before)
    try:
        return bool(now == before)
    except Exception:  # noqa: BLE001 - a value that does not compare: taken as unchanged
        return True


# The optimizer's state (the object holding it, by id) and each parameter's: the object holding
# it, and each value (a tensor by its id and version, written in place or replaced).
StateMarks = tuple[int, dict[int, tuple[int, list[tuple[str, Any]]]]]


def state_marks(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> StateMarks:
    """A mark of `params`' optimizer state, that differs once it is written, replaced or cleared."""
    state = optimizer.state
    return id(state), {
        id(p): (id(state[p]), [(k, (id(v), v._version) if isinstance(v, torch.Tensor) else v) for k, v in state[p].items()])
        for p in params if p in state
    }  # fmt: skip


def _same_marks(now: Optional[tuple[int, list[tuple[str, Any]]]], before: Optional[tuple[int, list[tuple[str, Any]]]]) -> bool:
    if now is None or before is None:
        return now is before
    return now[0] == before[0] and len(now[1]) == len(before[1]) and all(
        a[0] == b[0] and _same_setting(a[1], b[1]) for a, b in zip(now[1], before[1])
    )


def storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct memory `tensors` lie on (aliases counted once; a tensor on the meta
    device, another rank's parameter, holds none)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
