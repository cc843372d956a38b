"""Where fxpipe's own code lives, so that watches and errors point at the model's code, never at fxpipe's."""
from __future__ import annotations

import importlib.util
import os
from functools import cache


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
