"""The benchmarks' steady environment: glibc's malloc thresholds pinned before the process starts."""
from __future__ import annotations

import os
import shlex
import sys

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "1000000000", "MALLOC_TRIM_THRESHOLD_": "1000000000"}
REEXECUTED = "FXPIPE_BENCH_REEXECUTED"


def command_lines(reexecuted: bool, why: str) -> list[str]:
    """The command that reproduces this run, and whether the process re-executed itself."""
    env = " ".join(f"{k}={v}" for k, v in MALLOC_ENV.items())
    lines = [f"command: `{env} {shlex.join(sys.orig_argv)}`"]
    if reexecuted:
        lines.append(f"re-executed itself with {env} ({why})")
    return lines


def ensure_malloc_env() -> bool:
    """Re-execute this process with glibc's malloc thresholds pinned, unless they are set already.

    glibc reads them once, at start-up, so they cannot be set from inside. Returns whether this
    process is the re-executed one.
    """
    if all(os.environ.get(name) == value for name, value in MALLOC_ENV.items()):
        return os.environ.pop(REEXECUTED, None) == "1"
    env = {**os.environ, **MALLOC_ENV, REEXECUTED: "1"}
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    raise AssertionError("unreachable")
