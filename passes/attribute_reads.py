"""Attributes a trace reads: plain values (`self.temperature`, `self.drop_prob`, a dict of
scales, `self.config.output_hidden_states`), which the graph holds as constants, so that a value
changed after compiling is seen, not silently ignored; and the `training` flags that decided its
`self.training` branches, by mode.

A module's instance attributes are read without going through any hook nn.Module offers, so for
the length of a trace `__getattribute__` of the model's module classes is wrapped (on the classes
themselves: no new class, so `type(self)` and registries are untouched) to note the reads the
model's own code makes (not torch's tracing machinery, nor fxpipe's, nor other threads'). The
settings objects the modules hold (a config, a dataclass of options) are wrapped alike when first
read, so that their attributes are watched under the path they were read by
(`transformer.config.output_hidden_states`).
"""
from __future__ import annotations

import copy
import enum
import functools
import os
import sys
import threading
import types
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
from torch import nn

from fxpipe.passes.scoped import scoped

_local = threading.local()
_TORCH = os.path.dirname(torch.__file__) + os.sep
_TORCH_NN = os.path.join(_TORCH, "nn") + os.sep  # torch's modules are the model's code
_PASSES = os.path.dirname(os.path.abspath(__file__)) + os.sep


def from_the_model(filename: str) -> bool:
    """Whether code in `filename` is the model's: not torch's (but for its modules), nor fxpipe's."""
    if filename.startswith(_TORCH_NN):
        return True
    package = sys.modules.get("fxpipe")
    ours = os.path.dirname(os.path.abspath(package.__file__ or "")) + os.sep if package is not None else _PASSES
    return not filename.startswith((_TORCH, _PASSES, ours))


def plain(value: Any) -> bool:
    """A value a graph holds as a constant: None, a number, a string, a tuple, list or dict of them."""
    if type(value) is dict:
        return all(plain(key) and plain(entry) for key, entry in value.items())
    return value is None or type(value) in (bool, int, float, str) or (type(value) in (tuple, list) and all(map(plain, value)))


_NOT_SETTINGS = (nn.Module, torch.Tensor, type, enum.Enum, types.ModuleType, types.FunctionType, types.MethodType,
                 types.BuiltinFunctionType, functools.partial)


def settings(value: Any) -> bool:
    """An object whose attributes a forward may read as settings (a config, a dataclass of options):
    an instance of a class of the model's libraries (not torch's, nor Python's: a logger's level
    is no setting of the model), neither a module, tensor, function nor class."""
    home = (getattr(type(value), "__module__", None) or "builtins").partition(".")[0]
    return hasattr(value, "__dict__") and not isinstance(value, _NOT_SETTINGS) and home != "torch" and home not in sys.stdlib_module_names


@dataclass
class Reads:
    """What the traces read, by the mode each was traced in (`begin(mode)` before each)."""

    paths: dict[int, str]  # the modules', and the settings objects' read so far
    mode: bool = True
    wrapped: list[tuple[type, Optional[Any]]] = field(default_factory=list)  # classes and their own lookup
    held: list[Any] = field(default_factory=list)  # the settings objects in `paths`, alive so that no id is reused
    values: dict[bool, set[str]] = field(default_factory=lambda: {True: set(), False: set()})  # plain, qualified
    training: dict[bool, dict[str, bool]] = field(default_factory=lambda: {True: {}, False: {}})  # module path: flag

    def begin(self, mode: bool) -> None:
        self.mode = mode

    def note(self, module: Any, name: str, value: Any) -> None:
        path = self.paths.get(id(module))
        if path is None or not from_the_model(sys._getframe(2).f_code.co_filename):
            return
        if name == "training":
            self.training[self.mode].setdefault(path, bool(value))
        elif plain(value) and not (self.mode is False and isinstance(module, nn.modules.dropout._DropoutNd)):
            self.values[self.mode].add(f"{path}.{name}" if path else name)  # (torch's dropout is the identity in eval)
        elif settings(value) and id(value) not in self.paths:
            self.paths[id(value)] = f"{path}.{name}" if path else name
            self.held.append(value)
            _wrap(type(value), self.wrapped)


@contextmanager
def attribute_reads_recorded(model: nn.Module) -> Iterator[Reads]:
    """Within this block, the reads of public attributes of `model`'s modules, by this thread's
    model code, are noted in the `Reads` the block gets."""
    paths: dict[int, str] = {}
    for path, module in model.named_modules():
        paths.setdefault(id(module), path)
    reads = Reads(paths)
    previous = getattr(_local, "reads", None)
    _local.reads = reads
    try:
        for cls in dict.fromkeys(type(m) for m in model.modules()):
            _wrap(cls, reads.wrapped)
        yield reads
    finally:
        for cls, own in reversed(reads.wrapped):
            if own is None:
                delattr(cls, "__getattribute__")
            else:
                setattr(cls, "__getattribute__", own)
        _local.reads = previous


@contextmanager
def unnoted() -> Iterator[None]:
    """Within this block, no read is noted: the model's code that runs is not the trace's (its
    `train()` override reading `self.training`, as a mode is set for the next trace)."""
    with scoped(_local, "reads", None):
        yield


def _wrap(cls: type, wrapped: list[tuple[type, Optional[Any]]]) -> None:
    """Wrap `cls`'s attribute lookup to note reads, once, recording what to put back in `wrapped`."""
    if any(done is cls for done, _ in wrapped):
        return
    own = cls.__dict__.get("__getattribute__")
    try:
        setattr(cls, "__getattribute__", _noting(cls, own))
    except TypeError:  # a class that cannot be changed: its reads go unnoted
        return
    wrapped.append((cls, own))


def _noting(cls: Any, own: Optional[Any]) -> Callable[[Any, str], Any]:
    """`cls`'s attribute lookup (its own, or what it inherits), noting public reads."""

    def __getattribute__(self: Any, name: str) -> Any:
        value = own(self, name) if own is not None else super(cls, self).__getattribute__(name)
        reads = getattr(_local, "reads", None)
        if reads is not None and name[0] != "_":
            reads.note(self, name, value)
        return value

    return __getattribute__


def holder(modules: Mapping[str, Any], qualified: str) -> Optional[tuple[str, str]]:
    """`qualified` split into the path of the module that holds it and the attribute's path from
    there (`config.output_hidden_states` through a settings object); None if no module holds it."""
    parts = qualified.split(".")
    for cut in range(len(parts) - 1, -1, -1):
        path = ".".join(parts[:cut])
        if path in modules:
            return path, ".".join(parts[cut:])
    return None


def read(owner: Any, attribute: str) -> Any:
    """`owner`'s attribute at the dotted path `attribute`."""
    return functools.reduce(getattr, attribute.split("."), owner) if "." in attribute else getattr(owner, attribute)


def values_of(model: nn.Module, names: set[str]) -> dict[str, Any]:
    """What `model` holds now under each of the qualified `names` that is a plain value."""
    modules = dict(model.named_modules())
    found = {}
    for qualified in sorted(names):
        held = holder(modules, qualified)
        if held is None:
            continue
        try:
            value = read(modules[held[0]], held[1])
        except Exception:  # noqa: BLE001 - gone since, or a property that fails now: nothing to watch
            continue
        if plain(value):
            found[qualified] = copy.deepcopy(value)  # a list may be written in place
    return found


_MISSING = object()


def changed(held: list[tuple[str, nn.Module, str, Any]]) -> list[str]:
    """Of `held` (a qualified name, the module, the attribute's path from it and the value it held
    when traced), each whose value changed since, as `name (then -> now)`."""
    found = []
    for qualified, module, name, value in held:
        try:
            now = read(module, name)
        except Exception:  # noqa: BLE001 - deleted, or a property that fails now
            now = _MISSING
        kept = now is value or now == value or (now != now and value != value)  # a NaN that stays NaN too
        if now is _MISSING or type(now) is not type(value) or not kept:
            found.append(f"{qualified} ({value!r} -> {'deleted' if now is _MISSING else repr(now)})")
    return found
