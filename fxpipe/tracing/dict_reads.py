"""A dict the model's code reads while traced: which of its entries the graph holds as constants.

A dict attribute read in forward (`self.scales["a"]`) is handed to the trace as a copy that notes
the keys read, and passes every write on to the model's own dict (a cache forward fills). Only
the entries read are then watched: a counter kept in the same dict, or a cache that a call of the
plain model fills, changes nothing the graph holds.
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, Iterable, Optional

WHOLE = None  # the keys of a dict read whole (iterated, measured, copied)


class KeysRead:
    """Per dict (by qualified name): the keys the traces read, or WHOLE; and the keys they wrote."""

    def __init__(self) -> None:
        self.read: dict[str, Optional[set[Hashable]]] = {}
        self.written: dict[str, set[Hashable]] = {}

    def note(self, names: Iterable[str], key: Hashable) -> None:
        for name in names:
            keys = self.read.setdefault(name, set())
            if keys is not WHOLE:
                if key is WHOLE:
                    self.read[name] = WHOLE
                else:
                    keys.add(key)

    def wrote(self, names: Iterable[str], key: Hashable) -> None:
        for name in names:
            self.written.setdefault(name, set()).add(key)

    def watched(self, name: str) -> Optional[set[Hashable]]:
        """The keys of `name` to watch (those read and not written by forward), or WHOLE."""
        keys = self.read.get(name, WHOLE)
        return WHOLE if keys is WHOLE else keys - self.written.get(name, set())


class DictReads(dict):  # type: ignore[type-arg]
    """A copy of `original` whose reads note their keys in `keys` (under each of `names`), and
    whose writes go to `original` too."""

    def __init__(self, original: dict[Any, Any], keys: KeysRead, names: list[str]) -> None:
        super().__init__(original)
        self._original, self._keys, self._names = original, keys, names

    def _read(self, key: Hashable) -> None:
        self._keys.note(self._names, key)

    def __getitem__(self, key: Hashable) -> Any:
        self._read(key)
        return super().__getitem__(key)

    def get(self, key: Hashable, default: Any = None) -> Any:
        self._read(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self._read(key)  # type: ignore[arg-type]
        return super().__contains__(key)

    def __setitem__(self, key: Hashable, value: Any) -> None:
        self._keys.wrote(self._names, key)
        self._original[key] = value
        super().__setitem__(key, value)

    def __delitem__(self, key: Hashable) -> None:
        self._keys.wrote(self._names, key)
        del self._original[key]
        super().__delitem__(key)

    def __reduce_ex__(self, protocol: Any) -> Any:  # a copy (copy.deepcopy in forward) is a plain dict
        self._read(WHOLE)
        return (dict, (dict.copy(self),))

    def setdefault(self, key: Hashable, default: Any = None) -> Any:
        if not super().__contains__(key):
            self[key] = default
        return self[key]


def _whole(method: str) -> Callable[..., Any]:
    def read_whole(self: DictReads, *args: Any, **kwargs: Any) -> Any:
        self._read(WHOLE)
        return getattr(dict, method)(self, *args, **kwargs)

    read_whole.__name__ = method
    return read_whole


def _written_whole(method: str) -> Callable[..., Any]:
    def write_whole(self: DictReads, *args: Any, **kwargs: Any) -> Any:
        self._read(WHOLE)  # which entries it writes is not worth telling apart
        getattr(self._original, method)(*args, **kwargs)
        return getattr(dict, method)(self, *args, **kwargs)

    write_whole.__name__ = method
    return write_whole


for _name in ("__iter__", "__len__", "__eq__", "__ne__", "__repr__", "__reversed__", "keys", "values", "items", "copy", "__or__", "__ror__"):
    setattr(DictReads, _name, _whole(_name))
for _name in ("update", "pop", "popitem", "clear", "__ior__"):
    setattr(DictReads, _name, _written_whole(_name))


def entries(value: dict[Any, Any], keys: set[Hashable]) -> dict[Hashable, Any]:
    """The entries of `value` at `keys`, with MISSING for a key it does not hold."""
    return {key: value[key] if key in value else MISSING for key in keys}


class _Missing:
    """No value: a key a dict does not hold, an attribute gone. One of it, copies included."""

    def __repr__(self) -> str:
        return "missing"

    def __deepcopy__(self, memo: dict[int, Any]) -> "_Missing":
        return self

    def __copy__(self) -> "_Missing":
        return self


MISSING: Any = _Missing()


class Entries(dict):  # type: ignore[type-arg]
    """What a watched dict held at the keys the graph read (MISSING where it held none)."""
