"""Plain attributes a trace reads (`self.temperature`, `self.drop_prob`): the graph holds their
values as constants, so a value changed after compiling must be seen, not silently ignored.

A module's instance attributes are read without going through any hook nn.Module offers, so for
the length of a trace each module's class is swapped for a subclass of it whose
`__getattribute__` notes the reads (by qualified name) of public attributes holding plain values.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator

from torch import nn

_local = threading.local()


def _plain(value: Any) -> bool:
    return value is None or type(value) in (bool, int, float, str) or (type(value) is tuple and all(map(_plain, value)))


@contextmanager
def attribute_reads_recorded(model: nn.Module) -> Iterator[set[str]]:
    """Within this block, the public plain attributes of `model`'s modules that are read are
    added, by qualified name, to the set the block gets (`training` aside: it is followed)."""
    paths: dict[int, str] = {}
    for path, module in model.named_modules():
        paths.setdefault(id(module), path)
    read: set[str] = set()
    swapped: list[tuple[nn.Module, type]] = []
    recording: dict[type, type] = {}
    previous = getattr(_local, "state", None)
    _local.state = (paths, read)
    try:
        for module in {id(m): m for m in model.modules()}.values():
            cls = type(module)
            try:
                module.__class__ = recording.setdefault(cls, _recording(cls))
            except TypeError:  # a class whose instances cannot change class: its reads go unnoted
                continue
            swapped.append((module, cls))
        yield read
    finally:
        for module, cls in swapped:
            module.__class__ = cls
        _local.state = previous


def _recording(cls: type) -> type:
    """A subclass of `cls`, alike in name and module, whose attribute reads are noted."""
    read_attribute: Any = cls.__getattribute__  # object's, or the class's own

    def __getattribute__(self: Any, name: str) -> Any:
        value = read_attribute(self, name)
        state = getattr(_local, "state", None)
        if state is not None and name[0] != "_" and name != "training" and _plain(value):
            if name in object.__getattribute__(self, "__dict__"):
                path = state[0].get(id(self))
                if path is not None:
                    state[1].add(f"{path}.{name}" if path else name)
        return value

    namespace = {"__getattribute__": __getattribute__, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
    return type(cls.__name__, (cls,), namespace)


def values_of(model: nn.Module, names: set[str]) -> dict[str, Any]:
    """What `model` holds now under each of the qualified `names` still in a module's `__dict__`."""
    modules = dict(model.named_modules())
    found = {}
    for qualified in sorted(names):
        path, _, name = qualified.rpartition(".")
        table = vars(modules[path]) if path in modules else {}
        if name in table and _plain(table[name]):
            found[qualified] = table[name]
    return found


def changed(held: list[tuple[str, dict[str, Any], str, Any]]) -> list[str]:
    """Of `held` (a qualified name, the module's `__dict__`, the name in it and the value it held
    when traced), each whose value changed since, as `name (then -> now)`."""
    missing = object()
    found = []
    for qualified, table, name, value in held:
        now = table.get(name, missing)
        kept = now is value or now == value or (now != now and value != value)  # a NaN that stays NaN too
        if now is missing or type(now) is not type(value) or not kept:
            found.append(f"{qualified} ({value!r} -> {'deleted' if now is missing else repr(now)})")
    return found
