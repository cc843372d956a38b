"""Settings objects: instances of the model's own classes (a config, a namespace) whose attributes a forward reads or assigns."""
from __future__ import annotations

import argparse
import enum
import functools
import sys
import types
from typing import Any

import torch
from torch import nn

_NOT_SETTINGS = (nn.Module, torch.Tensor, type, enum.Enum, types.ModuleType, types.FunctionType, types.MethodType,
                 types.BuiltinFunctionType, functools.partial)


_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class defined in Python, whose lookup can be wrapped


def settings(value: Any) -> bool:
    """An object whose attributes a forward may read as settings (a config, a dataclass of options,
    an argparse.Namespace or a types.SimpleNamespace): an instance of a Python class of the model's
    libraries (not torch's, nor Python's own: a logger's level is no setting of the model), neither a module, tensor,
    function nor class. Decided on its class alone: the object's own lookup is not run."""
    cls = type(value)
    if cls is types.SimpleNamespace:
        return True
    home = (getattr(cls, "__module__", None) or "builtins").partition(".")[0]
    ours = home != "torch" and (home not in sys.stdlib_module_names or cls is argparse.Namespace)
    return bool(cls.__flags__ & _HEAP_TYPE) and ours and not isinstance(value, _NOT_SETTINGS)


def holds_fields(value: Any) -> bool:
    """A settings object (a config, a dataclass of options, a namespace) whose attributes a forward
    may assign: `self.state.calls += 1` is lost from a graph as `self.calls += 1` is."""
    return settings(value) and isinstance(getattr(value, "__dict__", None), dict)
