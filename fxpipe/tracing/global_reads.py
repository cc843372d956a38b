"""Module-level constants the model's code reads while traced (`SCALE`, `USE_BIAS`, a settings
module's `settings.GAIN`), which the graph holds as they were: named `module:NAME` so that one
changed after compiling is seen, like a module attribute (fxpipe/tracing/attribute_reads.py).

The code is that of each frame that read a module's attribute while traced (`Reads.note`: a
forward reads `self.something`), and of the functions it names, followed through; what a code
object reads from its module is told by its bytecode (`LOAD_GLOBAL NAME`, then `LOAD_ATTR`s
through modules). Only immutable plain values count (None, numbers, strings and tuples of them):
a dict or list a module keeps is most often a cache or a registry that the plain model fills as
it runs. Of a dict, an entry the code reads at a constant key (`FLAGS["on"]`, `FLAGS.get("on")`)
is watched, as `module:FLAGS['on']`, when its value is such a constant; so is a variable of
`os.environ`, set or not, read there or through `os.getenv`. The bytecode tells too what a forward reads of its own class
(`type(self).SCALE`), which no lookup of the instance sees (`class_reads`).
"""
from __future__ import annotations

import dis
import functools
import os
import sys
import sysconfig
import types
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from fxpipe.tracing.dict_reads import MISSING

_TORCH = os.path.dirname(torch.__file__) + os.sep
_PYTHONS = tuple({sysconfig.get_paths()["stdlib"] + os.sep, os.path.realpath(sysconfig.get_paths()["stdlib"]) + os.sep})
_LIBRARIES = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)
_LOOKUPS = ("LOAD_ATTR", "LOAD_METHOD")


def constant(value: Any) -> bool:
    """An immutable plain value: None, a number, a string, a tuple of them."""
    return value is None or type(value) in (bool, int, float, str) or (type(value) is tuple and all(map(constant, value)))


def settings_code(filename: str) -> bool:
    """Whether the module-level constants that code from `filename` reads may be the model's
    settings: not for torch's code (its modules' too: torch's flags are torch's), Python's own
    (a library's is the model's), or code made at run time or frozen."""
    if filename.startswith((_TORCH, "<")):
        return False
    return not filename.startswith(_PYTHONS) or any(part in filename for part in _LIBRARIES)


@dataclass
class ModuleReads:
    """What one code object reads from its module and writes there."""

    constants: dict[str, Any]  # by `module:NAME` (`module:settings.NAME` through a module it imported), as now
    functions: list[types.FunctionType]  # the Python functions it names (`rotate_half`), whose code may read more
    assigned: list[str]  # `module:NAME` of each `global NAME; NAME = ...`


def module_reads(code: types.CodeType, module_globals: dict[str, Any]) -> ModuleReads:
    """What `code`, run with `module_globals`, reads from its module and writes there."""
    module = module_globals.get("__name__", "?")
    instructions = _instructions(code)
    assigned = {str(i.argval) for i in instructions if i.opname == "STORE_GLOBAL"}
    found = ModuleReads({}, [], [f"{module}:{name}" for name in sorted(assigned)])
    for name in assigned:  # as it is before this code assigns it
        if constant(value := module_globals.get(name, MISSING)) or value is MISSING:
            found.constants[f"{module}:{name}"] = value
    for at, instruction in enumerate(instructions):
        if instruction.opname != "LOAD_GLOBAL" or instruction.argval not in module_globals:
            continue  # a builtin, or not there (yet)
        path, value = str(instruction.argval), module_globals[instruction.argval]
        at += 1
        while at < len(instructions) and isinstance(value, types.ModuleType) and instructions[at].opname in _LOOKUPS:
            path, value = f"{path}.{instructions[at].argval}", getattr(value, str(instructions[at].argval), MISSING)
            at += 1
        if value is os.getenv and at < len(instructions) and instructions[at].opname == "LOAD_CONST" and simple_key(key := instructions[at].argval):
            found.constants[f"os:environ[{key!r}]"] = os.environ.get(key, MISSING)  # os.getenv("FLAG"), getenv("FLAG")
            continue
        if (type(value) is dict or value is os.environ) and simple_key(key := _key_read(instructions[at : at + 2])):
            if key in value:
                path, value = f"{path}[{key!r}]", value[key]  # an entry: FLAGS["on"], FLAGS.get("on"), os.environ.get("FLAG")
            elif value is os.environ:
                path, value = f"{path}[{key!r}]", MISSING  # a variable not set: watched as missing, as one set later differs
                found.constants[f"{module}:{path}"] = value
                continue
        if constant(value):
            found.constants[f"{module}:{path}"] = value
        elif isinstance(value, types.FunctionType):
            found.functions.append(value)
    return found


@functools.lru_cache(maxsize=4096)
def _instructions(code: types.CodeType) -> tuple[dis.Instruction, ...]:
    """The bytecode of `code`, read once: each trace of each mode runs the same code objects."""
    return tuple(dis.get_instructions(code))


def simple_key(key: Any) -> bool:
    """A dict key or a list's place that a path `name[key]` names (fxpipe/tracing/attribute_reads.py's `read`)."""
    return (type(key) is int and key >= 0) or (type(key) is str and not any(c in key for c in "'[]\\"))


def _key_read(following: Sequence[dis.Instruction]) -> Any:
    """The constant key a dict just loaded is read at (`d["k"]`, `d.get("k")`), or MISSING."""
    if len(following) < 2:
        return MISSING
    first, second = following
    if first.opname == "LOAD_CONST" and (second.opname == "BINARY_SUBSCR" or (second.opname == "BINARY_OP" and second.argrepr == "[]")):
        return first.argval
    if first.opname in _LOOKUPS and first.argval == "get" and second.opname == "LOAD_CONST":
        return second.argval
    return MISSING


def class_reads(code: types.CodeType) -> list[str]:
    """The attributes `code` reads of its first argument's class (`type(self).SCALE`,
    `self.__class__.SCALE`), which no instance lookup sees."""
    if not code.co_argcount:
        return []
    first, found = code.co_varnames[0], []
    instructions = [i for i in _instructions(code) if i.opname not in ("PRECALL", "CACHE")]
    for at, instruction in enumerate(instructions[:-2]):
        if instruction.opname != "LOAD_FAST" or instruction.argval != first:
            continue
        before, after, then = instructions[at - 1] if at else None, instructions[at + 1], instructions[at + 2]
        by_type = before is not None and before.opname == "LOAD_GLOBAL" and before.argval == "type" and after.opname == "CALL" and after.arg == 1
        by_class = after.opname == "LOAD_ATTR" and after.argval == "__class__"
        if (by_type or by_class) and then.opname in _LOOKUPS and isinstance(then.argval, str) and not then.argval.startswith("__"):
            found.append(then.argval)
    return found


def nested(code: types.CodeType) -> list[types.CodeType]:
    """The code objects defined inside `code` (comprehensions, lambdas, inner functions)."""
    return [const for const in code.co_consts if isinstance(const, types.CodeType)]


@contextmanager
def put_back_on_failure(model: nn.Module) -> Iterator[None]:
    """Run the body; if it raises, put back the module-level constants of the modules that
    define the model's classes that it changed, or add or remove them: a refused compile leaves
    a counter the forward advances (`global calls; calls += 1`) as it found it. A body that
    succeeds keeps them, as one call of the plain model would (a flag set on first use)."""
    saved = {}
    for module in {sys.modules.get(type(m).__module__) for m in model.modules()}:
        if module is not None and settings_code(getattr(module, "__file__", None) or "<none>"):
            saved[module] = {name: value for name, value in vars(module).items() if constant(value)}
    try:
        yield
    except BaseException:
        for module, constants in saved.items():
            table = vars(module)
            for name in [n for n, v in table.items() if constant(v) and n not in constants]:
                del table[name]  # assigned by a run: not there before
            for name, value in constants.items():
                if table.get(name, MISSING) is not value:
                    table[name] = value
        raise
