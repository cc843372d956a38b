"""Stage workers: one thread per stage, even when stages share a device, so CPU stages overlap;
and groups of tasks the caller waits for together."""
from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from typing import Any, Callable, Optional, Sequence

import torch

from fxpipe.runtime.devices import on_device

Task = Callable[[], None]


def _loop(tasks: "queue.SimpleQueue[Optional[list[Task]]]", device: torch.device) -> None:
    torch.set_grad_enabled(True)
    # Autocast keeps its casts of leaves in one table that every thread shares, and empties it
    # when a thread leaves its outermost region. A task's region (under the caller's autocast)
    # is never this thread's outermost: the caller's region keeps its casts for as long as it
    # lasts, as it does without a pipeline.
    torch.autocast_increment_nesting()
    with on_device(device):
        while True:
            batch = tasks.get()
            if batch is None:
                return
            batch.reverse()
            while batch:
                batch.pop()()  # dropped once run: what a task holds goes before the next one waits


class Workers:
    """A thread per stage; each runs the tasks submitted to it, in order.

    The threads hold nothing of their owner: `close()`, or the owner's garbage collection through
    `bind`, stops them.
    """

    def __init__(self, devices: Sequence[torch.device], name: str = "fxpipe") -> None:
        self.closed = False
        self.pid = os.getpid()  # a forked child has none of the threads
        self.queues: list[queue.SimpleQueue[Optional[list[Task]]]] = [queue.SimpleQueue() for _ in devices]
        self.threads = [
            threading.Thread(target=_loop, args=(q, d), name=f"{name}-stage{i}", daemon=True)
            for i, (q, d) in enumerate(zip(self.queues, devices))
        ]
        for thread in self.threads:
            thread.start()

    def submit(self, stage: int, tasks: list[Task]) -> None:
        """Hand the stage's worker `tasks`, to run in order after what it was given before. A
        list at once: one wake-up of the worker, not one per task, while the other workers,
        already woken, compete for the interpreter lock with the thread that hands them out."""
        if self.closed:  # no thread would run it: the caller would wait for ever
            raise RuntimeError(
                "the pipeline was closed (pipe.close()) while a step still had work to run (a backward, say).\n"
                "How to fix: close it after the last backward, or compile the model again."
            )
        if os.getpid() != self.pid:
            raise RuntimeError(
                "this pipeline is called in a process forked from the one that compiled it (a DataLoader worker, "
                "multiprocessing with fork): its stage threads live in that process alone, and none would run the call.\n"
                "How to fix: call the plain model in the child (the pipeline's parameters are the model's), compile "
                "a pipeline in the child, or call the pipeline in the main process."
            )
        self.queues[stage].put(list(tasks))

    def close(self) -> None:
        self.closed = True
        _stop(self.queues)

    def bind(self, owner: Any) -> None:
        """Stop the threads when `owner` is garbage-collected."""
        weakref.finalize(owner, _stop, self.queues)


def _stop(queues: Sequence["queue.SimpleQueue[Optional[list[Task]]]"]) -> None:
    for q in queues:
        q.put(None)


class TaskGroup:
    """Tasks submitted together, and the errors they raised, by task.

    The caller waits once for the whole group, not once per task: waking a sleeping thread costs
    tens of microseconds on an idle core, as much as a small task's work.
    """

    def __init__(self, count: int) -> None:
        self.remaining = count
        self.errors: dict[Any, BaseException] = {}  # in the order they were raised
        self.lock = threading.Lock()
        self.finished = threading.Event()
        if count == 0:
            self.finished.set()

    def finish(self, key: Any, error: Optional[BaseException] = None) -> None:
        with self.lock:
            self.remaining -= 1
            if error is not None:
                self.errors[key] = error
            if self.remaining == 0:
                self.finished.set()

    def wait(self, timeout: Optional[float]) -> None:
        """Until every task has finished; in short slices, so that Ctrl-C reaches the caller.
        Raises TimeoutError after `timeout` seconds (None: never)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.finished.wait(0.1):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"pipeline tasks did not finish in {timeout} s: the pipeline is stuck")
