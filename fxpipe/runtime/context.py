"""The caller's thread-local state, captured at a call and applied on the stage workers.

Autocast, grad mode, inference mode, anomaly detection and saved-tensor hooks are per thread in
PyTorch: a stage worker would otherwise run every forward in float32, with grad on, saving its
activations as they are, whatever the caller chose. A checkpointed micro-batch recomputes under
the state its forward ran under.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch

_AUTOCAST_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class Autocast:
    device_type: str
    dtype: torch.dtype
    cache_enabled: bool


@dataclass(frozen=True)
class CallerContext:
    """What a stage must run under to compute what the caller's thread would."""

    autocast: tuple[Autocast, ...]
    inference: bool
    anomaly: Optional[bool]  # None: off; else whether it checks for NaN too
    # The caller's current CUDA streams where they are not the default ones: the stages compute on
    # them, so that they run after what the caller queued there (the inputs) and what the caller
    # queues next (the loss) runs after them, as the plain model's kernels would.
    streams: tuple[Any, ...] = ()
    # The caller's saved-tensor hooks (pack, unpack), as `torch.autograd.graph.saved_tensors_hooks`
    # or `save_on_cpu` set them: what autograd saves in the stages goes through them too.
    saved_hooks: Optional[tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]] = None

    @staticmethod
    def capture() -> "CallerContext":
        cache = torch.is_autocast_cache_enabled()
        autocast = tuple(
            Autocast(device, torch.get_autocast_dtype(device), cache)
            for device in _AUTOCAST_DEVICES
            if torch.is_autocast_enabled(device)
        )
        anomaly = torch.is_anomaly_check_nan_enabled() if torch.is_anomaly_enabled() else None
        return CallerContext(autocast, torch.is_inference_mode_enabled(), anomaly, _side_streams(), _saved_hooks_on())

    def enter(self, stack: ExitStack) -> None:
        """Enter this state on the current thread, for as long as `stack` is open."""
        for stream in self.streams:
            stack.enter_context(torch.cuda.stream(stream))
        if self.inference:
            stack.enter_context(torch.inference_mode())
        if self.anomaly is not None:
            stack.enter_context(torch.autograd.set_detect_anomaly(True, check_nan=self.anomaly))
        for cast in self.autocast:
            stack.enter_context(torch.autocast(cast.device_type, cast.dtype, cache_enabled=cast.cache_enabled))
        if self.saved_hooks is not None:
            stack.enter_context(_after_this_threads(*self.saved_hooks))

    @cached_property
    def plain(self) -> bool:
        """Nothing to enter: the common case, kept free of any context manager (read by every
        task: computed once)."""
        return not self.autocast and not self.inference and self.anomaly is None and not self.streams and self.saved_hooks is None


def _after_this_threads(pack: Callable[[torch.Tensor], Any], unpack: Callable[[Any], torch.Tensor]) -> Any:
    """Saved-tensor hooks that run `pack` on what the hooks this thread has on already (the
    memory meter's) return, and `unpack` before theirs: only the innermost hooks run."""
    inner = _saved_hooks_on()
    if inner is None:
        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
    inner_pack, inner_unpack = inner
    return torch.autograd.graph.saved_tensors_hooks(lambda t: pack(inner_pack(t)), lambda packed: inner_unpack(unpack(packed)))


def _saved_hooks_on() -> Optional[tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]]:
    """The saved-tensor hooks this thread has on (the innermost: the only ones autograd runs)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def _side_streams() -> tuple[Any, ...]:
    """The calling thread's current stream on each CUDA device, where it is not the default."""
    if not torch.cuda.is_initialized():
        return ()
    current = (torch.cuda.current_stream(i) for i in range(torch.cuda.device_count()))
    return tuple(s for s in current if s != torch.cuda.default_stream(s.device))


def worker_state() -> ContextManager[None]:
    """The thread-local state a stage worker starts with (grad on, no inference mode, no
    autocast, no saved-tensor hooks), for tasks run on the caller's own thread: they must
    compute what a worker would. Nothing to enter where the thread is in it already (the common
    case, twice per call)."""
    if (
        torch.is_grad_enabled() and not torch.is_inference_mode_enabled() and _saved_hooks_on() is None
        and not any(torch.is_autocast_enabled(device) for device in _AUTOCAST_DEVICES)
    ):  # fmt: skip
        return nullcontext()
    return _into_worker_state()


@contextmanager
def _into_worker_state() -> Iterator[None]:
    with ExitStack() as stack:
        stack.enter_context(torch.enable_grad())
        if _saved_hooks_on() is not None:  # the caller's: a task enters them itself
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_as_it_is, _as_it_is))
        if torch.is_inference_mode_enabled():
            stack.enter_context(torch.inference_mode(False))
        for device in _AUTOCAST_DEVICES:
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


def _as_it_is(t: Any) -> Any:
    return t
