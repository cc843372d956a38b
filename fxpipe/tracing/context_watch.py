"""The contexts a traced forward enters for a part of it (grad mode, inference mode, autocast, saved-tensor hooks), watched at torch's own entry points while it is traced."""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Any, Callable, Iterator

import torch

_TORCH_DIR = os.path.dirname(torch.__file__)


@contextlib.contextmanager
def _calls_watched(owner: Any, name: str, counts: Callable[..., bool]) -> Iterator[list[tuple[Any, ...]]]:
    """The arguments of this thread's calls of `owner.name` that `counts` (another pipeline's
    workers may run meanwhile) while the block runs."""
    calls: list[tuple[Any, ...]] = []
    original = getattr(owner, name)
    tracing = threading.get_ident()

    def watch(*args: Any) -> Any:
        if threading.get_ident() == tracing and counts(*args):
            calls.append(args)
        return original(*args)

    setattr(owner, name, watch)
    try:
        yield calls
    finally:
        setattr(owner, name, original)


def grad_mode_watched() -> contextlib.AbstractContextManager[list[tuple[Any, ...]]]:
    """The grad modes the traced forward set (`with torch.no_grad():` in it, say), even to the
    one it was traced in (compiled under no_grad): the graph would run those parts with
    gradients as the caller has them."""
    return _calls_watched(torch._C, "_set_grad_enabled", lambda enabled: _set_by_the_model())


@contextlib.contextmanager
def unseen_grad_modes_watched() -> Iterator[list[tuple[bool]]]:
    """The grad modes the captured forward set to the one it already ran in, which torch.export
    does not record (`torch.enable_grad()` in a forward captured with gradients on, or
    `torch.no_grad()` in one captured under no_grad): the graph would run those parts with
    gradients as the caller has them. Watched at torch's context managers, which call
    `torch._C._set_grad_enabled` itself, as torch.export records it."""
    calls: list[tuple[bool]] = []
    tracing = threading.get_ident()
    grad_mode = torch.autograd.grad_mode
    set_init, enable_enter = grad_mode.set_grad_enabled.__init__, grad_mode.enable_grad.__enter__

    def noted(mode: bool) -> None:
        if threading.get_ident() == tracing and mode == torch.is_grad_enabled() and _set_by_the_model():
            calls.append((mode,))

    def init(self: Any, mode: bool) -> None:
        noted(mode)
        set_init(self, mode)

    def enter(self: Any) -> None:
        noted(True)
        enable_enter(self)

    grad_mode.set_grad_enabled.__init__, grad_mode.enable_grad.__enter__ = init, enter  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        grad_mode.set_grad_enabled.__init__, grad_mode.enable_grad.__enter__ = set_init, enable_enter  # type: ignore[method-assign]


_GRAD_MODE_FILES = ("grad_mode.py", "_contextlib.py", "contextlib.py")


def _set_by_the_model(depth: int = 3) -> bool:
    """Whether the grad mode being set was asked for by code outside torch (the model's),
    through torch's context managers or directly; `depth`: the frames of the watch above."""
    frame = sys._getframe(depth)
    while frame is not None and frame.f_code.co_filename.endswith(_GRAD_MODE_FILES):
        frame = frame.f_back  # type: ignore[assignment]
    return frame is not None and not frame.f_code.co_filename.startswith(_TORCH_DIR)


def grad_mode_message(switched: list[tuple[Any, ...]], captured_under_no_grad: bool, by_fx: bool = False) -> str:
    """Why a front end's graph cannot serve a forward that sets gradients for a part."""
    off = (False,) in switched
    how = "off for a part (torch.no_grad(), torch.set_grad_enabled)" if off else "on for a part (torch.enable_grad())"
    if captured_under_no_grad and off:
        fix = "compile outside torch.no_grad(), so that the capture records the part's switch"
    elif off:
        fix = "use .detach() on what the part must not differentiate" + (", or let torch.export capture the model" if by_fx else "")
    else:
        fix = ("keep the module that switches them on whole (leaf_modules=[...], with torch.fx), whose forward runs as it "
               "is (the model's own forward is never kept whole: move that code into a submodule)")
    return f"its forward switches gradients {how}, and a captured graph keeps the operations, not the mode they ran in.\nHow to fix: {fix}."


def inference_mode_watched() -> contextlib.AbstractContextManager[list[tuple[Any, ...]]]:
    """Each time the traced forward entered torch.inference_mode()."""
    return _calls_watched(torch._C, "_InferenceMode", lambda mode=True: bool(mode))


INFERENCE_MODE = (
    "its forward enters torch.inference_mode() for a part, and a captured graph keeps the operations, not the "
    "mode they ran in: the pipeline would train what the part computes.\nHow to fix: use .detach() on what the "
    "part must not differentiate (and torch.no_grad() around it, which torch.export keeps)."
)


def autocast_watched() -> contextlib.AbstractContextManager[list[tuple[Any, ...]]]:
    """Each time the traced forward entered torch.autocast (`with torch.autocast("cuda",
    enabled=False):` in it)."""
    return _calls_watched(torch, "autocast_increment_nesting", lambda: True)


SAVED_TENSOR_HOOKS = (
    "its forward enters torch.autograd.graph.saved_tensors_hooks of its own for a part (a compression of what "
    "backward keeps), and a traced graph keeps the operations, not the hooks on what they save.\nHow to fix: keep "
    "the module that enters them whole (leaf_modules=[...], with torch.fx), whose forward runs as it is; or enter "
    "them around the pipeline's call and its backward."
)


def saved_tensor_hooks_watched() -> contextlib.AbstractContextManager[list[tuple[Any, ...]]]:
    """Each time the traced forward entered torch.autograd.graph.saved_tensors_hooks of its own:
    torch's (save_on_cpu, torch.utils.checkpoint's) change where or when a saved tensor is kept,
    never its value."""
    return _calls_watched(torch._C._autograd, "_push_saved_tensors_default_hooks", lambda pack, unpack: not _from_torch(pack))


def _from_torch(function: Any) -> bool:
    code = getattr(function, "__code__", None)
    return code is not None and code.co_filename.startswith(_TORCH_DIR)


@contextlib.contextmanager
def grad_mode_reads() -> Iterator[list[str]]:
    """'file:line' of each place code outside torch (the model's) read `torch.is_grad_enabled()`
    on this thread while the block ran: a branch on it may compute otherwise without gradients."""
    lines: list[str] = []
    original, reading = torch.is_grad_enabled, threading.get_ident()

    def read() -> bool:
        caller = sys._getframe(1)
        if threading.get_ident() == reading and not caller.f_code.co_filename.startswith(_TORCH_DIR):
            lines.append(f"{caller.f_code.co_filename}:{caller.f_lineno}")
        return original()

    torch.is_grad_enabled = read
    try:
        yield lines
    finally:
        torch.is_grad_enabled = original
