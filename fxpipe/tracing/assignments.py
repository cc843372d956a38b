"""Attributes a forward assigns (`self.hidden = h`, or `self.state.calls += 1` on a settings
object a module holds): refused at compile time, and put back; a plain value every call assigns
alike, kept; the contents of dicts, lists and sets it fills, put back.

A pipeline runs the forward as stages of generated code, which never runs those assignments of
the modules it traced through; after tracing such an attribute would hold a traced value (an fx
Proxy). A module the graph calls whole runs its own forward, assignments included.
"""
from __future__ import annotations

import copy
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from fxpipe.core.settings import holds_fields
from fxpipe.tracing.global_reads import constant

# Each attribute assigned (dotted), and the path of the module holding it; None for one of a
# settings object several modules share (which one's forward assigned it is not known).
Changes = dict[str, Optional[str]]


class AssignmentError(RuntimeError):
    """The forward assigns module attributes, which a pipeline cannot keep up to date;
    `modules` are the paths of the modules whose attributes (or whose settings objects'
    attributes) were assigned ('' for the root)."""

    def __init__(self, message: str, modules: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.modules = sorted(set(modules))


def _public(module: nn.Module) -> dict[str, Any]:
    return {name: value for name, value in vars(module).items() if name[0] != "_" and name != "training"}


# Each module by path, with its public attributes: read once for the several records of a run.
Walk = list[tuple[str, nn.Module, dict[str, Any]]]


def walk(model: nn.Module) -> Walk:
    """`model`'s modules by path, each with its public attributes as they are now."""
    return [(path, module, _public(module)) for path, module in model.named_modules()]


def _fields(holder: Any) -> dict[str, Any]:
    """The public attributes of a settings object."""
    return {name: value for name, value in vars(holder).items() if not name.startswith("_")}





def _settings_held(modules: Walk) -> tuple[dict[tuple[str, str], tuple[Any, dict[str, Any]]], set[tuple[str, str]]]:
    """Each settings object the modules hold, once (a config many modules share is named by
    the first), by module path and attribute, with its public attributes as they are now; and
    those several modules hold."""
    found: dict[tuple[str, str], tuple[Any, dict[str, Any]]] = {}
    first: dict[int, tuple[str, str]] = {}
    shared: set[tuple[str, str]] = set()
    for path, _, public in modules:
        for name, value in public.items():
            if id(value) in first:
                shared.add(first[id(value)])
            elif holds_fields(value):
                first[id(value)] = (path, name)
                found[path, name] = (value, _fields(value))
    return found, shared


class Contents:
    """The contents of the dicts, lists and sets `model`'s modules hold as public attributes (a
    cache a forward fills, such as LeViT's `attention_bias_cache`), to put back after a run: a
    trace then starts from what the model held, not from what an earlier run left there (a
    tensor it would bake into the graph as a constant)."""

    def __init__(self, model: nn.Module, modules: Optional[Walk] = None) -> None:
        self.saved = [
            (path, name, value, copy.copy(value))
            for path, _, public in (modules if modules is not None else walk(model))
            for name, value in public.items()
            if isinstance(value, (dict, list, set))
        ]  # fmt: skip

    def changed(self) -> dict[str, tuple[Any, Any]]:
        """By path, each container whose contents changed: it, and a copy of what it held."""
        return {
            f"{path}.{name}" if path else name: (value, before)
            for path, name, value, before in self.saved
            if not _same_contents(value, before)
        }  # fmt: skip

    def overwritten(self) -> Changes:
        """Each plain entry of a dict that forward replaced by another plain value (a counter,
        `self.d["calls"] += 1`: an assignment a graph loses, where a cache adds entries), by dotted
        name, with the path of the module holding the dict (None for one several modules hold)."""
        holders: dict[int, list[str]] = {}
        for path, _, value, _ in self.saved:
            holders.setdefault(id(value), []).append(path)
        found: Changes = {}
        for path, name, value, before in self.saved:
            if type(value) is not dict or not isinstance(before, dict):
                continue
            for key, then in before.items():
                now = value.get(key, then)
                if constant(then) and constant(now) and _changed(then, now):
                    found[f"{path}.{name}[{key!r}]" if path else f"{name}[{key!r}]"] = path if len(holders[id(value)]) == 1 else None
        return found

    def put_back(self) -> list[str]:
        """Put the contents back; the paths of the containers whose contents had changed."""
        changed = self.changed()
        for value, before in changed.values():
            value.clear()
            if isinstance(value, list):
                value.extend(before)
            else:
                value.update(before)
        return list(changed)


def cached(model: nn.Module, run: Callable[[], Any]) -> dict[str, dict[Any, Any]]:
    """What `run()` put into the dicts and lists of `model`'s modules and a second run keeps and
    reads (a cache filled on first use, not a store each run writes anew): by container path, its
    kept entries by key or index. The contents are put back."""
    contents = Contents(model)
    run()
    first = {path: _entries(value) for path, (value, _) in contents.changed().items()}
    run()
    now = {path: _entries(value) for path, (value, _) in contents.changed().items()}
    contents.put_back()
    return {
        path: {key: v for key, v in entries.items() if key in now.get(path, {}) and now[path][key] is v}
        for path, entries in first.items()
    }  # fmt: skip


def _entries(container: Any) -> dict[Any, Any]:
    if isinstance(container, dict):
        return dict(container)
    return dict(enumerate(container)) if isinstance(container, list) else {}


def differing_entries(first: dict[str, dict[Any, Any]], second: dict[str, dict[Any, Any]]) -> list[str]:
    """The caches whose entries hold other tensor values in `second` than in `first`."""
    differ = []
    for path, entries in first.items():
        for key, value in entries.items():
            a, b = tree_flatten(value)[0], tree_flatten(second.get(path, {}).get(key))[0]
            if len(a) != len(b) or any(
                isinstance(s, torch.Tensor) and (not isinstance(t, torch.Tensor) or s.shape != t.shape or not torch.equal(s, t))
                for s, t in zip(a, b)
            ):
                differ.append(path)
                break
    return differ


def _swapped_container(before: Any, after: Any) -> bool:
    """A dict, list or set replaced by another of its kind: a container the model refills, whose
    contents `Contents` looks after, not an assignment to carry."""
    return before is not after and type(before) is type(after) and isinstance(before, (dict, list, set))


def _same_contents(now: Any, before: Any) -> bool:
    if isinstance(now, dict):
        return now.keys() == before.keys() and all(now[k] is before[k] for k in now)
    if isinstance(now, list):
        return len(now) == len(before) and all(a is b for a, b in zip(now, before))
    return bool(now == before)


class Assigned:
    """The public attributes of `model`'s modules (and their buffers, with `buffers`) and of the
    settings objects they hold as they are when made: which have been assigned since, and
    putting them back. A settings object's attribute is named below the module holding it:
    `(path, "state.calls")`."""

    def __init__(self, model: nn.Module, buffers: bool = False, modules: Optional[Walk] = None) -> None:
        modules = modules if modules is not None else walk(model)
        self.before = {path: (module, public, dict(module._buffers) if buffers else {}) for path, module, public in modules}
        self.held, self.shared = _settings_held(modules)

    def holder(self, key: tuple[str, str]) -> Optional[str]:
        """The path of the module holding what `since()` names `key`; None for an attribute of a
        settings object several modules hold."""
        path, name = key
        held = name.rpartition(".")[0]
        return None if held and (path, held) in self.shared else path

    def _holders(self) -> Iterator[tuple[str, str, Any, dict[str, Any], dict[str, Any]]]:
        """Each module and settings object: its path, the prefix of its attributes' names, itself,
        its attributes when made and now."""
        for path, (module, values, _) in self.before.items():
            yield path, "", module, values, _public(module)
        for (path, name), (holder, values) in self.held.items():
            yield path, f"{name}.", holder, values, _fields(holder)

    def since(self) -> dict[tuple[str, str], Any]:
        """Each attribute or buffer assigned since, by module path and name, with its value now;
        a dict, list or set swapped for another of its kind is none (`Contents` looks after it)."""
        found = {}
        for path, prefix, _, values, now in self._holders():
            for name, value in now.items():
                if name not in values or (_changed(values[name], value) and not _swapped_container(values[name], value)):
                    found[path, prefix + name] = value
        for path, (module, _, buffers) in self.before.items():
            for name, buffer in buffers.items():
                if module._buffers.get(name) is not buffer:
                    found[path, name] = module._buffers.get(name)
        return found

    def assign(self, values: dict[tuple[str, str], Any]) -> None:
        """Assign again what `since()` found (attributes only)."""
        for (path, name), value in values.items():
            held, _, field = name.rpartition(".")
            setattr(self.held[path, held][0] if held else self.before[path][0], field, value)

    def put_back(self, keep: Iterable[tuple[str, str]] = ()) -> None:
        """Put every attribute and buffer back as it was (a swapped container too), but `keep`."""
        kept = set(keep)
        for path, prefix, holder, values, now in self._holders():
            for name, value in now.items():
                if (path, prefix + name) in kept:
                    continue
                if name not in values:
                    delattr(holder, name)
                elif _changed(values[name], value) or _swapped_container(values[name], value):
                    setattr(holder, name, values[name])
        for module, _, buffers in self.before.values():
            module._buffers.update(buffers)


def _dotted(key: tuple[str, str]) -> str:
    path, name = key
    return f"{path}.{name}" if path else name


@contextmanager
def assignments_recorded(model: nn.Module) -> Iterator[Changes]:
    """Within this block, public attributes and buffers assigned on `model`'s modules, and the
    attributes assigned on the settings objects they hold, are listed (once the block ends: by
    dotted name, with the path of the module holding each) and put back as they were. A buffer
    counts: `self.count += 1` assigns it the traced sum, which a graph does not write into the
    buffer."""
    modules = walk(model)
    assigned, contents = Assigned(model, buffers=True, modules=modules), Contents(model, modules)
    changed: Changes = {}
    try:
        yield changed
    finally:
        changed.update(contents.overwritten())
        contents.put_back()  # a cache a run filled: not an assignment, and not kept
        changed.update((_dotted(key), assigned.holder(key)) for key in assigned.since())
        assigned.put_back()


class StableAssignments:
    """Runs of the model in a `with` block, each followed by `ran()`: a public attribute that
    every run leaves with one plain value (Swin's `self.shift_size = 0`, set from the input's
    size) keeps it when the block ends, as a call of the plain model leaves it, and a trace then
    assigning it the same value changes nothing; every other assignment is put back, as is
    everything when the block raises. `undo()` puts back the kept ones too (compiling failed)."""

    def __init__(self, model: nn.Module) -> None:
        modules = walk(model)
        self.assigned = Assigned(model, modules=modules)
        self.ends: list[dict[tuple[str, str], Any]] = []
        self.kept: dict[tuple[str, str], Any] = {}
        self.contents = Contents(model, modules)
        self.filled: list[str] = []  # containers whose contents the runs changed (put back)
        # Tensors a run stored on a module (`self.hidden = h`) that require grad, by path and name.
        self.differentiable: frozenset[tuple[str, str]] = frozenset()
        # What each run assigned on a module, by path and name: a value one run assigns and the
        # next leaves as it found it (a count kept in training alone) is no setting of every call.
        self.paths = {id(module): path for path, module, _ in modules}
        self.set_now: set[tuple[str, str]] = set()
        self.set_by_run: list[set[tuple[str, str]]] = []
        self._watch = _assignments_watched(model, self.paths, self.set_now)

    def ran(self) -> None:
        self.ends.append(self.assigned.since())
        self.set_by_run.append(set(self.set_now))
        self.set_now.clear()

    def __enter__(self) -> "StableAssignments":
        self._watch.__enter__()
        return self

    def __exit__(self, kind: Any, *rest: Any) -> None:
        self._watch.__exit__(kind, *rest)
        first = self.ends[0] if self.ends and kind is None else {}
        self.kept = {
            key: v for key, v in first.items()
            if constant(v) and all(key in e and not _changed(e[key], v) for e in self.ends) and self._set_by_every_run(key)
        }  # fmt: skip
        self.assigned.put_back(keep=self.kept)
        self.filled = self.contents.put_back()
        self.differentiable = frozenset(
            key for end in self.ends for key, v in end.items() if isinstance(v, torch.Tensor) and v.requires_grad
        )

    def _set_by_every_run(self, key: tuple[str, str]) -> bool:
        """Whether every run assigned `key` (a module's attribute; a settings object's field counts as
        assigned by each run that left it so)."""
        return "." in key[1] or all(key in assigned for assigned in self.set_by_run)

    def undo(self) -> None:
        self.assigned.put_back()

    def left_as_found(self) -> bool:
        """The runs so far assigned no attribute and changed no container's contents."""
        return not self.assigned.since() and not self.contents.changed()


def _changed(before: Any, after: Any) -> bool:
    """A new object that is not an equal plain value (torch.export swaps some attributes, such
    as a LayerNorm's `normalized_shape`, for equal copies)."""
    if before is after:
        return False
    if isinstance(before, torch.Tensor) or isinstance(after, torch.Tensor):
        return True
    try:
        return bool(before != after)
    except Exception:  # noqa: BLE001 - a value that cannot say whether it is equal counts as changed
        return True


def outside(names: Iterable[str], modules: Iterable[str]) -> list[str]:
    """The dotted `names` that are not below any of `modules` (by path)."""
    prefixes = [f"{path}." for path in modules]
    return [name for name in names if not any(name.startswith(prefix) for prefix in prefixes)]


def refuse_assignments(changed: Mapping[str, Optional[str]], called_whole: Iterable[str] = (), exported: str = "") -> None:
    """Raise `AssignmentError` for the assignments of `changed` (see `assignments_recorded`)
    outside the modules (by path) that a graph calls whole. `exported`: why torch.fx could not
    trace the model, when torch.export captured it (which keeps no module whole)."""
    shared = [name for name, holder in changed.items() if holder is None]
    lost = [*outside([name for name in changed if name not in shared], called_whole), *shared]
    if lost:
        whole = _whole_advice(lost, exported)
        rooted = [name for name in lost if changed[name] == ""]
        if rooted:  # the model itself is cut into stages, never kept whole
            whole = (f"The model itself holds {', '.join(repr(name) for name in rooted)}, and is never kept whole: keep "
                     "such a value in a submodule that changes it, which is then called whole (leaf_modules=[...]).")
        if shared:  # no module to keep whole: which one's forward assigns it is not known
            whole = (f"{', '.join(repr(name) for name in shared)} belongs to a settings object several modules hold (a "
                     "shared config): keep such a value in the module that changes it (self.calls += 1), which is then "
                     "called whole.")  # fmt: skip
        raise AssignmentError(
            f"the model's forward assigns {', '.join(repr(name) for name in lost)}: a pipeline runs the "
            "forward as generated stages, which cannot keep such an attribute up to date.\n"
            f"How to fix: return the value from forward instead of storing it on the module. {whole}",
            [changed[name] or "" for name in lost],
        )


def _whole_advice(lost: list[str], exported: str) -> str:
    """Whether keeping the modules that assign `lost` whole helps, and what it takes: torch.fx,
    which failed (`exported`: why) or not."""
    if not exported:
        return "Or keep the module that stores it whole (leaf_modules=[...])."
    read = [name for name in lost if f"has no attribute '{name.rpartition('.')[2]}'" in exported]
    if read:
        return (f"torch.fx could not trace the model because a forward reads {', '.join(read)} outside the module that "
                f"stores it ({exported}), and a graph cannot read such a value as the call stores it: keeping the "
                "module whole does not help there.")  # fmt: skip
    if "computes otherwise" in exported:
        return (f"torch.fx's graph computed otherwise than the model ({exported}): if a forward reads what a module "
                "stores outside that module, the graph reads the value it held when traced; read it only inside the "
                "module, and keep the module whole (leaf_modules=[...]).")  # fmt: skip
    return (f"Keeping the module whole (leaf_modules=[...]) needs torch.fx, which could not trace the model ({exported}): "
            "make it traceable (name forward's arguments), then keep the module that stores it whole.")


@contextmanager
def _assignments_watched(model: nn.Module, paths: dict[int, str], seen: set[tuple[str, str]]) -> Iterator[None]:
    """Within this block, each attribute this thread assigns on one of `model`'s modules (by the
    path `paths` gives its id) is added to `seen`: `__setattr__` of their classes wrapped."""
    here = threading.get_ident()
    wrapped: list[tuple[type, Any]] = []
    for cls in dict.fromkeys(type(m) for m in model.modules()):
        own = cls.__dict__.get("__setattr__")
        inherited = cls.__setattr__

        def noting(self: Any, name: str, value: Any, _inherited: Any = inherited) -> None:
            path = paths.get(id(self))
            if path is not None and threading.get_ident() == here:
                seen.add((path, name))
            _inherited(self, name, value)

        wrapped.append((cls, own))
        cls.__setattr__ = noting  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        for cls, own in reversed(wrapped):
            if own is None:
                delattr(cls, "__setattr__")
            else:
                cls.__setattr__ = own  # type: ignore[method-assign]


@contextmanager
def assignments_refused(model: nn.Module) -> Iterator[None]:
    """Trace `model` within this block: an attribute the trace assigned is put back and refused."""
    with assignments_recorded(model) as changed:
        yield
    refuse_assignments(changed)


@contextmanager
def started_alike(model: nn.Module) -> Iterator[Callable[[], None]]:
    """For runs that must start from the same attributes (the model's, then its graph's): the
    block gets a function that puts back what the first run assigned, and at the end of the
    block the first run's assignments are made again, so that a record around it sees them."""
    modules = walk(model)
    assigned, contents = Assigned(model, modules=modules), Contents(model, modules)
    made: dict[tuple[str, str], Any] = {}

    def put_back() -> None:
        made.update(assigned.since())
        contents.put_back()
        assigned.put_back()

    try:
        yield put_back
    finally:
        assigned.put_back()
        assigned.assign(made)
