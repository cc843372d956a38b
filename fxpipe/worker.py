"""Stage workers: one thread per stage, even when stages share a device, so CPU stages overlap."""
from __future__ import annotations

import queue
import threading
import weakref
from typing import Any, Callable, Optional, Sequence

import torch

from fxpipe.devices import on_device

Task = Callable[[], None]


def _loop(tasks: "queue.SimpleQueue[Optional[Task]]", device: torch.device) -> None:
    torch.set_grad_enabled(True)
    with on_device(device):
        while True:
            task = tasks.get()
            if task is None:
                return
            task()
            del task  # drop what the task holds before blocking on the next one


class Workers:
    """A thread per stage; each runs the tasks submitted to it, in order.

    The threads hold nothing of their owner: `close()`, or the owner's garbage collection through
    `bind`, stops them.
    """

    def __init__(self, devices: Sequence[torch.device], name: str = "fxpipe") -> None:
        self.queues: list[queue.SimpleQueue[Optional[Task]]] = [queue.SimpleQueue() for _ in devices]
        self.threads = [
            threading.Thread(target=_loop, args=(q, d), name=f"{name}-stage{i}", daemon=True)
            for i, (q, d) in enumerate(zip(self.queues, devices))
        ]
        for thread in self.threads:
            thread.start()

    def submit(self, stage: int, task: Task) -> None:
        self.queues[stage].put(task)

    def close(self) -> None:
        _stop(self.queues)

    def bind(self, owner: Any) -> None:
        """Stop the threads when `owner` is garbage-collected."""
        weakref.finalize(owner, _stop, self.queues)


def _stop(queues: Sequence["queue.SimpleQueue[Optional[Task]]"]) -> None:
    for q in queues:
        q.put(None)
