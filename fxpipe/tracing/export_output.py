"""What torch.export prints of its own while it fails (the partial graph, a log line), held back: the error fxpipe raises names the line."""
from __future__ import annotations

import io
import logging
import sys
from contextlib import contextmanager
from typing import Iterator

# torch.export prints the graph it had made so far to stderr before it raises, and its shape
# logger warns that it found no user code for a data-dependent symbol. When the export is the
# fallback after torch.fx, or when its error becomes one of fxpipe's, that is screens of noise
# above a message that already names the failing line.
_SHAPES_LOGGER = "torch.fx.experimental.symbolic_shapes"
_NO_USER_CODE = "Unable to find user code"


class _Held(io.TextIOBase):
    """Stderr while torch.export runs: everything written is kept, to be written on after."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return len(text)


def _no_user_code(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_NO_USER_CODE)


@contextmanager
def export_failure_unprinted() -> Iterator[None]:
    """Run the body (one torch.export call) with stderr held; if it raises an error that carries
    a partial graph, drop that graph's printing and write the rest on, else write all on."""
    held, stderr = _Held(), sys.stderr
    logger = logging.getLogger(_SHAPES_LOGGER)
    sys.stderr = held
    logger.addFilter(_no_user_code)
    try:
        yield
    except BaseException as error:
        graph = getattr(error, "partial_fx_graph", None)
        if graph is not None:
            printed = str(graph)
            held.parts = [part for k, part in enumerate(held.parts) if part != printed and not (part == "\n" and k and held.parts[k - 1] == printed)]
        raise
    finally:
        logger.removeFilter(_no_user_code)
        if sys.stderr is held:
            sys.stderr = stderr
        stderr.write("".join(held.parts))
