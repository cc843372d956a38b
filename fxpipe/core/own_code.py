"""Where fxpipe's own code lives, so that watches and errors point at the model's code, never at fxpipe's."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from functools import cache

import torch


@cache
def library_dirs() -> tuple[str, ...]:
    """fxpipe's own folders, each ending in a separator: the package's, and its passes' (installed
    as `fxpipe.passes`, from a folder of their own in a source checkout)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # fxpipe/
    spec = importlib.util.find_spec("fxpipe.passes")
    passes = list(spec.submodule_search_locations or []) if spec is not None else []
    return tuple(dict.fromkeys(os.path.abspath(d) + os.sep for d in [here, *passes]))


def is_ours(filename: str) -> bool:
    """Whether `filename` is one of fxpipe's own files."""
    return filename.startswith(library_dirs())


_PASSED_THROUGH = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(contextlib.__file__) + os.sep + "contextlib.py")


def caller_stacklevel() -> int:
    """`warnings.warn`'s `stacklevel`, from the function that warns, naming the first line outside
    fxpipe, torch (`nn.Module.__call__`) and contextlib: the caller's, however deep fxpipe's own
    frames are (a call compiled again for another kind of call is deeper than compile_pipeline)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and (is_ours(frame.f_code.co_filename) or frame.f_code.co_filename.startswith(_PASSED_THROUGH)):
        frame, level = frame.f_back, level + 1
    return level
