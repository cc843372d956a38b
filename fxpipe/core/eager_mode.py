"""Dispatch modes that run only while compiling, never under torch.compile."""
from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class EagerDispatchMode(TorchDispatchMode):
    """A TorchDispatchMode that torch does not wrap for dynamo to skip: the wrapper imports
    torch._dynamo on its first call, 1-3 s in a fresh process, and these modes (shape and FLOP
    propagation, the checks that run the model on its example) run at compile time, eagerly."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False
