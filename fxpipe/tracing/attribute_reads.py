"""Attributes a trace reads: plain values (`self.temperature`, `self.drop_prob`, a dict of
scales, `self.config.output_hidden_states`), which the graph holds as constants, so that a value
changed after compiling is seen, not silently ignored; and the `training` flags that decided its
`self.training` branches, by mode.

A module's instance attributes are read without going through any hook nn.Module offers, so for
the length of a trace `__getattribute__` of the model's module classes is wrapped (on the classes
themselves: no new class, so `type(self)` and registries are untouched) to note the reads the
model's own code makes (not torch's tracing machinery, nor fxpipe's, nor other threads'). The
settings objects the modules hold (a config, a dataclass of options) are wrapped alike when first
read (their `__getattr__` too, for configs that answer through it), so that their attributes are
watched under every path they were read by (`transformer.config.output_hidden_states`); a
`types.SimpleNamespace`, whose built-in class cannot be wrapped, is handed to the trace behind a
view that notes its reads. Of a
dict, the entries read are watched (fxpipe/tracing/dict_reads.py); of the code that read them, the
module-level constants (fxpipe/tracing/global_reads.py). A value forward itself changes while traced (a
counter) is no setting, and is not watched: the check of assignments calls its module whole, or
`counted_while_traced` refuses it where that check cannot see it.
"""
from __future__ import annotations

import ast
import copy
import functools
import os
import re
import sys
import threading
import types
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
from torch import nn

from fxpipe.core.own_code import is_ours
from fxpipe.core.scoped import scoped
from fxpipe.core.settings import settings
from fxpipe.tracing.dict_reads import MISSING, WHOLE, DictReads, Entries, KeysRead, entries
from fxpipe.tracing.global_reads import class_reads, constant, module_reads, nested, settings_code, simple_key

_local = threading.local()
_TORCH = os.path.dirname(torch.__file__) + os.sep
_TORCH_NN = os.path.join(_TORCH, "nn") + os.sep  # torch's modules are the model's code
_TORCH_FX = os.path.join(_TORCH, "fx") + os.sep  # the tracer's


def from_the_model(filename: str) -> bool:
    """Whether code in `filename` is the model's: not torch's (but for its modules), nor fxpipe's."""
    if filename.startswith(_TORCH_NN):
        return True
    return not filename.startswith(_TORCH) and not is_ours(filename)


# Above this many entries a dict read whole is not watched: comparing it would slow every call.
WATCHED_ENTRIES = 1000


def plain(value: Any) -> bool:
    """A value a graph holds as a constant: None, a number, a string, a tuple, list or dict of them."""
    if type(value) is dict:
        return len(value) <= WATCHED_ENTRIES and all(plain(key) and plain(entry) for key, entry in value.items())
    return value is None or type(value) in (bool, int, float, str) or (type(value) in (tuple, list) and all(map(plain, value)))





Wrapped = list[tuple[type, str, Optional[Any]]]  # a class, the lookup wrapped, its own (None: inherited)


@dataclass
class Reads:
    """What the traces read, by the mode each was traced in (`begin(mode)` before each)."""

    paths: dict[int, list[str]]  # of the modules (their first name), and of the settings objects read so far
    mode: bool = True
    wrapped: Wrapped = field(default_factory=list)
    held: list[Any] = field(default_factory=list)  # the settings objects in `paths`, alive so that no id is reused
    values: dict[bool, set[str]] = field(default_factory=lambda: {True: set(), False: set()})  # plain, qualified
    training: dict[bool, dict[str, bool]] = field(default_factory=lambda: {True: {}, False: {}})  # module path: flag
    keys: KeysRead = field(default_factory=KeysRead)  # of the dicts among `values`
    first: dict[str, Any] = field(default_factory=dict)  # each plain value as first read
    codes: dict[bool, set[types.CodeType]] = field(default_factory=lambda: {True: set(), False: set()})  # run, by mode
    assigned: set[str] = field(default_factory=set)  # module-level values that code assigns (`global n; n += 1`)
    iterated: set[str] = field(default_factory=set)  # the containers (ModuleList, ...) whose members were listed
    flags_read: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})  # `training` reads, by any code but the tracer's
    forwards: list[tuple[types.CodeType, dict[str, Any]]] = field(default_factory=list)  # of the model's classes
    # The tensors modules hold as plain attributes (no parameter, no buffer) that the trace read,
    # by identity, with their names; and of those, each whose value the trace turned into a Python
    # value (`if self.temperature > 1:`), which the graph keeps: a copy of it as traced, by name.
    tensors: dict[int, tuple[torch.Tensor, list[str]]] = field(default_factory=dict)
    decided: dict[str, torch.Tensor] = field(default_factory=dict)

    def decided_on(self, tensor: torch.Tensor) -> None:
        """The trace turned a value made from `tensor` (one of `tensors`) into a Python value."""
        held, names = self.tensors[id(tensor)]
        for qualified in names:
            self.values[self.mode].add(qualified)
            self.first.setdefault(qualified, held)
            self.decided.setdefault(qualified, held.detach().clone())

    def begin(self, mode: bool) -> None:
        self.mode = mode
        self.flags_read[mode] = 0
        # The module-level values the forwards read, as they are before any runs: a forward may
        # assign one (`global calls; calls += 1`) before the first attribute read that notes it.
        for code, module_globals in self.forwards:
            if from_the_model(code.co_filename) and settings_code(code.co_filename):
                for qualified, value in module_reads(code, module_globals).constants.items():
                    self.first.setdefault(qualified, value)

    def same_in_eval(self) -> None:
        """The training trace serves eval mode too (it read no `training` flag): eval reads what it read."""
        self.values[False] = set(self.values[True])
        self.training[False] = dict(self.training[True])
        self.codes[False] = set(self.codes[True])

    def ran(self, code: types.CodeType, module_globals: dict[str, Any]) -> None:
        """The model's `code` ran in the trace: the module-level constants it reads (`module:NAME`,
        fxpipe/tracing/global_reads.py), and those of the functions it names, are noted as plain
        attributes are."""
        todo = [(code, module_globals)]
        while todo:
            code, module_globals = todo.pop()
            if code in self.codes[self.mode] or not (from_the_model(code.co_filename) and settings_code(code.co_filename)):
                continue
            self.codes[self.mode].add(code)
            found = module_reads(code, module_globals)
            for qualified, value in found.constants.items():
                self.values[self.mode].add(qualified)
                self.first.setdefault(qualified, value)
            self.assigned.update(found.assigned)
            todo += [(function.__code__, function.__globals__) for function in found.functions]
            todo += [(inner, module_globals) for inner in nested(code)]

    def note(self, owner: Any, name: str, value: Any) -> Any:
        """Note that the model's code read `owner.name`; returns what the code gets (a dict as
        a `DictReads`)."""
        paths = self.paths.get(id(owner))
        frame = sys._getframe(2)
        if name == "training" and not (is_ours(frame.f_code.co_filename) or frame.f_code.co_filename.startswith(_TORCH_FX)):
            self.flags_read[self.mode] += 1
        if not paths or not from_the_model(frame.f_code.co_filename):
            return value
        if frame.f_code not in self.codes[self.mode]:
            self.ran(frame.f_code, frame.f_globals)
            self._class_reads(owner, paths, frame.f_code)
        if name == "training":
            self.training[self.mode].setdefault(paths[0], bool(value))
            return value
        names = [f"{path}.{name}" if path else name for path in paths]
        if (plain(value) or value is MISSING) and not (self.mode is False and isinstance(owner, nn.modules.dropout._DropoutNd)):
            self.values[self.mode].update(names)  # (torch's dropout is the identity in eval)
            if type(value) is dict:
                return DictReads(value, self.keys, names)
            for qualified in names:
                if qualified not in self.first:
                    self.first[qualified] = copy.deepcopy(value)
        elif isinstance(value, torch.Tensor) and not isinstance(owner, nn.Module):
            self.values[self.mode].update(names)  # a tensor a settings object holds: a constant of the graph
            self.tensors.setdefault(id(value), (value, names))
            for qualified in names:
                self.first.setdefault(qualified, value)
        elif isinstance(value, torch.Tensor) and vars(owner).get(name) is value:  # a module's plain tensor attribute
            self.tensors.setdefault(id(value), (value, names))
        elif isinstance(owner, nn.Module) and _an_object(value) and not settings(value) and vars(owner).get(name) is value:
            self._object(names, Held(value))  # one the trace may have called through
        elif settings(value):
            if isinstance(owner, nn.Module) and vars(owner).get(name) is value:
                self._object(names, Held(value, by_class=True))  # (its attributes read are watched by value)
            self._reached(value, names)
            if type(value) is types.SimpleNamespace:
                return NamespaceReads(value)
        elif type(value) in (list, tuple, dict):  # settings objects or tensors in it (a config per head), by place or key
            for key, element in value.items() if type(value) is dict else enumerate(value):
                if settings(element) and type(element) is not types.SimpleNamespace and simple_key(key):
                    self._reached(element, [f"{name}[{key!r}]" for name in names])
                elif isinstance(element, torch.Tensor) and not isinstance(element, nn.Parameter) and simple_key(key):
                    self.tensors.setdefault(id(element), (element, [f"{name}[{key!r}]" for name in names]))
        return value

    def _class_reads(self, owner: Any, paths: list[str], code: types.CodeType) -> None:
        """The plain values `code` reads of `owner`'s class (`type(self).SCALE`), watched as read
        through the instance, which no lookup of the instance's noted."""
        for name in class_reads(code):
            value = getattr(type(owner), name, MISSING)
            if plain(value) and not isinstance(getattr(type(owner), name, None), (property, types.FunctionType)):
                names = [f"{path}.{name}" if path else name for path in paths]
                self.values[self.mode].update(names)
                for qualified in names:
                    self.first.setdefault(qualified, copy.deepcopy(value))

    def _object(self, names: list[str], held: Held) -> None:
        """A module's object attribute read under `names`: watched as `held` says."""
        self.values[self.mode].update(names)
        for qualified in names:
            self.first.setdefault(qualified, held)

    def _reached(self, settings: Any, names: list[str]) -> None:
        """`settings` read under `names`: watched under each, what was read of it under another
        name too."""
        known = self.paths.setdefault(id(settings), [])
        if not known:
            self.held.append(settings)
            _wrap(type(settings), self.wrapped)
        for name in names:
            if name in known:
                continue
            if known:
                self._copy_reads(known[0], name)
            known.append(name)

    def _copy_reads(self, old: str, new: str) -> None:
        for values in self.values.values():
            values.update([new + name[len(old):] for name in values if name.startswith(old + ".")])
        for table in (self.first, self.keys.read, self.keys.written):
            table.update({new + name[len(old):]: v for name, v in list(table.items()) if name.startswith(old + ".")})  # type: ignore[attr-defined]


class NamespaceReads:
    """A `types.SimpleNamespace` as the model's code gets it while traced: its reads are noted as
    the wrapped lookup of other settings objects notes them (its class, built in, cannot be
    wrapped); writes go to it."""

    __slots__ = ("_namespace",)

    def __init__(self, namespace: types.SimpleNamespace) -> None:
        object.__setattr__(self, "_namespace", namespace)

    def __getattr__(self, name: str) -> Any:
        namespace = object.__getattribute__(self, "_namespace")
        value = getattr(namespace, name, MISSING)
        reads = getattr(_local, "reads", None)
        if reads is not None and name[0] != "_":
            value = reads.note(namespace, name, value)
        if value is MISSING:
            raise AttributeError(f"{type(namespace).__name__!r} object has no attribute {name!r}")
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_namespace"), name, value)

    def __delattr__(self, name: str) -> None:
        delattr(object.__getattribute__(self, "_namespace"), name)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance(..., types.SimpleNamespace) holds
        return types.SimpleNamespace

    def __repr__(self) -> str:
        return repr(object.__getattribute__(self, "_namespace"))


@contextmanager
def attribute_reads_recorded(model: nn.Module) -> Iterator[Reads]:
    """Within this block, the reads of public attributes of `model`'s modules, by this thread's
    model code, are noted in the `Reads` the block gets."""
    paths: dict[int, list[str]] = {}
    for path, module in model.named_modules():
        paths.setdefault(id(module), [path])
    reads = Reads(paths)
    for forward in dict.fromkeys(getattr(type(m), "forward", None) for m in model.modules()):
        if isinstance(getattr(forward, "__code__", None), types.CodeType):
            reads.forwards.append((forward.__code__, forward.__globals__))  # type: ignore[union-attr]
    try:
        with scoped(_local, "reads", reads):
            for cls in dict.fromkeys(type(m) for m in model.modules()):
                _wrap(cls, reads.wrapped)
            for cls in CONTAINERS:
                for listing in _LISTINGS:
                    if hasattr(cls, listing):
                        reads.wrapped.append((cls, listing, cls.__dict__.get(listing)))
                        setattr(cls, listing, _listed(getattr(cls, listing)))
            yield reads
    finally:
        for cls, lookup, own in reversed(reads.wrapped):
            if own is None:
                delattr(cls, lookup)
            else:
                setattr(cls, lookup, own)


# A forward that lists a container's members (`for block in self.blocks`, `len(self.heads)`,
# `self.heads.values()`) holds one pass over those it had: a member added later changes it.
CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential, nn.ParameterList, nn.ParameterDict)
_LISTINGS = ("__iter__", "__len__", "keys", "values", "items")


def _listed(listing: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(listing)
    def noting(self: Any, *args: Any, **kwargs: Any) -> Any:
        reads = getattr(_local, "reads", None)
        if reads is not None:
            reads.iterated.update(reads.paths.get(id(self), ()))
        return listing(self, *args, **kwargs)

    return noting


@contextmanager
def unnoted() -> Iterator[None]:
    """Within this block, no read is noted: the model's code that runs is not the trace's (its
    `train()` override reading `self.training`, as a mode is set for the next trace)."""
    with scoped(_local, "reads", None):
        yield


def _wrap(cls: type, wrapped: Wrapped) -> None:
    """Wrap `cls`'s attribute lookup to note reads, once, recording what to put back in
    `wrapped`: its `__getattribute__`, and its `__getattr__` if it has one (a module's, which
    finds its parameters and children; a config's that answers from a table)."""
    if any(done is cls for done, _, _ in wrapped):
        return
    lookups = ["__getattribute__", *(["__getattr__"] if hasattr(cls, "__getattr__") else [])]
    for lookup in lookups:
        own = cls.__dict__.get(lookup)
        try:
            setattr(cls, lookup, _noting(cls, lookup, own))
        except TypeError:  # a class that cannot be changed: its reads go unnoted
            return
        wrapped.append((cls, lookup, own))


def _noting(cls: Any, lookup: str, own: Optional[Any]) -> Callable[[Any, str], Any]:
    """`cls`'s attribute lookup `lookup` (its own, or what it inherits), noting public reads; and
    an attribute not found (`getattr(self, "gain", 1.0)`, `hasattr`) where the last lookup fails,
    so that one set after compiling is seen too."""
    last = lookup == "__getattr__" or not hasattr(cls, "__getattr__")

    def noted(self: Any, name: str) -> Any:
        # The inherited lookup is found on every read, not once: torch.fx patches nn.Module's
        # __getattr__ while it traces (parameters read become get_attr nodes), and a lookup
        # found before would go around the patch.
        try:
            value = own(self, name) if own is not None else getattr(super(cls, self), lookup)(name)
        except AttributeError:
            reads = getattr(_local, "reads", None)
            if last and reads is not None and name[0] != "_":
                reads.note(self, name, MISSING)
            raise
        reads = getattr(_local, "reads", None)
        if reads is not None and name[0] != "_":
            return reads.note(self, name, value)
        return value

    noted.__name__ = lookup
    return noted


def holder(modules: Mapping[str, Any], qualified: str) -> Optional[tuple[Any, str]]:
    """What holds `qualified`, and the attribute's path from it: one of `modules` by path
    (`config.output_hidden_states` through a settings object), or the Python module of a
    module-level value (`package.module:NAME`); None if none holds it."""
    module, colon, name = qualified.partition(":")
    if colon:
        found = sys.modules.get(module)
        return (found, name) if found is not None else None
    parts = qualified.split(".")
    for cut in range(len(parts) - 1, -1, -1):
        path = ".".join(parts[:cut])
        if path in modules:
            return modules[path], ".".join(parts[cut:])
    return None


_STEP = re.compile(r"([^.\[]+)|\[(\d+|'[^'\]]*')\]")


def read(owner: Any, attribute: str) -> Any:
    """`owner`'s attribute at the dotted path `attribute` (through lists and dicts too:
    `heads[0].scale`, `by_name['q'].scale`)."""
    if "[" not in attribute:
        return functools.reduce(getattr, attribute.split("."), owner) if "." in attribute else getattr(owner, attribute)
    for name, index in _STEP.findall(attribute):
        owner = getattr(owner, name) if name else owner[ast.literal_eval(index)]
    return owner


def values_of(model: nn.Module, reads: Reads) -> dict[str, Any]:
    """What `model` holds now under each qualified name `reads` noted that is a plain value (of a
    dict, its entries read), but for values forward itself changed while traced."""
    modules = dict(model.named_modules())
    found: dict[str, Any] = {}
    for qualified in sorted(reads.values[True] | reads.values[False]):
        held = holder(modules, qualified)
        if held is None:
            continue
        try:
            value = read(*held)
        except (AttributeError, KeyError):  # not there: watched as missing, if the trace found none either
            value = MISSING
        except Exception:  # noqa: BLE001 - a property that fails now: nothing to watch
            continue
        if isinstance(reads.first.get(qualified), GradHeld):  # `w.grad`: watched by whether it is None
            found[qualified] = GradHeld(value is not None)
            continue
        if isinstance(reads.first.get(qualified), Held):  # an object: watched as itself, unless forward replaced it
            if _kept(value, reads.first[qualified]):
                found[qualified] = reads.first[qualified]
            continue
        if isinstance(value, torch.Tensor):
            if qualified in reads.decided:  # its value decided a branch of the trace: watched by value
                found[qualified] = Decided(reads.decided[qualified])
            elif value is reads.first.get(qualified):  # held by a settings object: watched as that very tensor
                found[qualified] = value
            continue
        if not (plain(value) or value is MISSING) or not _kept(value, reads.first.get(qualified, value)):  # a counter forward keeps
            continue
        keys = reads.keys.watched(qualified) if type(value) is dict else WHOLE
        if keys is not WHOLE:
            if keys:
                found[qualified] = Entries(copy.deepcopy(entries(value, keys)))
        else:
            found[qualified] = copy.deepcopy(value)  # a list may be written in place
    return found


def assigned_while_traced(reads: Reads) -> list[str]:
    """The module-level values the traced code assigns that changed while it was traced (a
    counter, `global calls; calls += 1`), as `module:NAME (then -> now)`: a graph never assigns
    them, and holds the value of the trace."""
    found = []
    for qualified in sorted(reads.assigned & reads.first.keys()):
        place = holder({}, qualified)
        try:
            now = read(*place) if place is not None else MISSING
        except AttributeError:
            now = MISSING
        if constant(now) and not _kept(now, reads.first[qualified]):  # (not a kernel loaded on first use)
            found.append(f"{qualified} ({reads.first[qualified]!r} -> {now!r})")
    return found


def counted_while_traced(model: nn.Module, reads: Reads) -> list[str]:
    """The plain attributes the traced code read that changed while it was traced, as
    `name (then -> now)`: a counter that the check of assignments cannot follow (in a settings
    object with `__slots__`, or one that keeps its fields in a table of its own), which the graph
    holds as a constant. Each is put back as first read."""
    modules = dict(model.named_modules())
    found = []
    for qualified in sorted(reads.values[True] | reads.values[False]):
        place = holder(modules, qualified) if ":" not in qualified and qualified in reads.first else None
        if place is None:
            continue
        try:
            now = read(*place)
        except Exception:  # noqa: BLE001 - a property that fails now
            continue
        then, (owner, _, name) = reads.first[qualified], place[1].rpartition(".")
        target = read(place[0], owner) if owner else place[0]
        if name in getattr(target, "__dict__", {}):
            continue  # the check of assignments follows it (a plain value every call assigns alike is fine)
        if not _kept(now, then):
            found.append(f"{qualified} ({then!r} -> {now!r})")
            delattr(target, name) if then is MISSING else setattr(target, name, then)
    return found


def changed(held: list[tuple[str, Any, str, Any]]) -> list[str]:
    """Of `held` (a qualified name, what holds it, the attribute's path from there and the value
    it held when traced), each whose value changed since, as `name (then -> now)`."""
    found = []
    for qualified, module, name, value in held:
        try:
            now = read(module, name)
        except Exception:  # noqa: BLE001 - deleted, or a property that fails now
            now = MISSING
        if isinstance(value, Entries) and type(now) is dict:
            found += [f"{qualified}[{key!r}] ({then!r} -> {now_!r})" for key, then in value.items()
                      if not _kept(now_ := now.get(key, MISSING), then)]  # fmt: skip
        elif isinstance(value, Held) and not _kept(now, value):
            then = value.value
            replaced = f"another {type(then).__qualname__} object" if type(now) is type(then) else _an(now)
            found.append(f"{qualified} ({_an(then)} -> {'deleted' if now is MISSING else replaced})")
        elif isinstance(value, GradHeld) and not _kept(now, value):
            found.append(f"{qualified} ({_shown(value, '')} -> {_shown(GradHeld(not value.held), '')})")
        elif isinstance(value, Entries) or not _kept(now, value):
            decided = isinstance(value, Decided)
            found.append(f"{qualified} ({_shown(value, 'a tensor', decided)} -> {'deleted' if now is MISSING else _shown(now, 'another tensor', decided)})")
    return found


@dataclass(frozen=True)
class Held:
    """An object a module holds as a plain attribute, neither a value, a tensor nor a module (a
    callable the forward calls through: diffusers' attention processor), as traced: the graph
    holds what its code did, so it is watched as that very object; or, `by_class`, as an object
    of its class (a settings object of the model's classes, whose attributes read are watched by
    value: another of the same class computes alike where they are equal)."""

    value: Any
    by_class: bool = False


def _an(value: Any) -> str:
    """'a Doubled object' ('an AttnProcessor object'), or what a value is shown as."""
    if not _an_object(value):
        return _shown(value, "a tensor")
    kind = type(value).__qualname__
    return f"{'an' if kind[:1].lower() in 'aeiou' else 'a'} {kind} object"


def _an_object(value: Any) -> bool:
    """An object whose code a trace may run: not a value, tensor, module or container (each
    watched its own way), nor a class or a Python module."""
    return not (plain(value) or value is MISSING or isinstance(value, (torch.Tensor, nn.Module, type, types.ModuleType, list, tuple, dict, set)))


@dataclass(frozen=True)
class GradHeld:
    """Whether a parameter or buffer held a gradient (`w.grad is None` read: fxpipe/tracing/autograd_state_reads.py)."""

    held: bool


@dataclass(frozen=True)
class Decided:
    """A tensor attribute as traced, whose value the trace turned into a Python value: watched by value."""

    values: torch.Tensor


def _shown(value: Any, tensor: str, by_value: bool = False) -> str:
    """`value` as a change names it: a tensor watched as itself by `tensor`, one watched by value
    (`by_value`) by its values where they are few."""
    if isinstance(value, Decided):
        value = value.values
    if isinstance(value, GradHeld):
        return "a gradient" if value.held else "None"
    if by_value and isinstance(value, torch.Tensor) and value.numel() <= 4 and value.layout == torch.strided and value.device.type != "meta":
        return repr(value.detach().cpu().tolist())
    return tensor if isinstance(value, torch.Tensor) else repr(value)


def _kept(now: Any, then: Any) -> bool:
    """Whether `now` is `then` still: equal, of one type, or a NaN that stays NaN; a tensor, the
    same tensor (of a `Decided` one, the same values)."""
    if isinstance(then, Held):
        return now is then.value or (then.by_class and type(now) is type(then.value))
    if isinstance(then, GradHeld):
        return (now is not None and now is not MISSING) == then.held
    if isinstance(then, Decided):
        values = then.values
        return isinstance(now, torch.Tensor) and now.shape == values.shape and now.dtype == values.dtype and torch.equal(now.detach().to(values.device), values)
    if isinstance(then, torch.Tensor) or isinstance(now, torch.Tensor):
        return now is then
    return type(now) is type(then) and (now is then or now == then or (now != now and then != then))
