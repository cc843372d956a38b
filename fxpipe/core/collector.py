"""The cyclic garbage collector held off while compiling, as torch's own state-dict helpers do."""
from __future__ import annotations

import gc
from types import TracebackType
from typing import Optional


class collector_paused:
    """Within this block Python's cyclic collector does not run; it is switched back on after,
    unless it was off before.

    Compiling a large model builds tens of thousands of objects that live to its end (graphs,
    their nodes and metadata), and a full collection walks every object of the process (with
    torch imported, about 250k): a 48-block GPT paid one or two, 110-130 ms each, on every
    compile. Tensors are freed by their reference counts, as before; what reference cycles the
    compile leaves are collected after it, by the collector's next run.
    """

    def __enter__(self) -> None:
        self.was_on = gc.isenabled()
        gc.disable()

    def __exit__(self, kind: Optional[type[BaseException]], error: Optional[BaseException], trace: Optional[TracebackType]) -> None:
        if self.was_on:
            gc.enable()
