"""Run a function on N gloo processes on 127.0.0.1 and collect what each returns.

Each process joins a process group on a free port; the launcher waits a bounded time for every
result and every exit, and kills what is left, so no test leaves a process behind.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Optional


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(fn: Callable[..., Any], rank: int, world: int, port: int, results: Any, args: tuple[Any, ...]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        results.put((rank, "ok", fn(rank, world, *args)))
    except BaseException as e:  # noqa: BLE001 - reported to the launcher
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    try:  # no rank leaves while another still reads the end of its last step (a dead one is not waited for)
        dist.barrier()
    except Exception:  # noqa: BLE001 - best effort: the results are in
        pass
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a peer that died leaves nothing to destroy cleanly
            pass


def _context() -> Any:
    """New processes forked from a server that imported torch and fxpipe once: each test's ranks
    start in a fraction of a second instead of importing them again, and start as fresh as
    spawned ones (the server runs nothing but imports)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "fxpipe", "distributed_cases"])
    return ctx


def spawn_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 240.0, expect_exit: Optional[set[int]] = None) -> dict[int, tuple[str, Any]]:
    """`fn(rank, world, *args)` on `world` processes; per rank ("ok", result) or ("error", text),
    or ("exited", exit code) for a rank that ended without reporting."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, results, args), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=0.5)
                got[rank] = (status, value)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
        # Every result in, nothing is read any more: a rank still in its last barrier after a peer's
        # failure (a collective it posted alone) is not waited out.
        leave_by = min(deadline, time.monotonic() + (1.0 if len(got) == world else 15.0 * world))
        for p in procs:
            p.join(max(0.1, leave_by - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    for rank, p in enumerate(procs):
        if rank not in got:
            got[rank] = ("exited", p.exitcode)
    return got


def results_of(got: dict[int, tuple[str, Any]]) -> list[Any]:
    """Each rank's result; fails with every rank's error if one did not return."""
    problems = [f"rank {r}: {status}: {value}" for r, (status, value) in sorted(got.items()) if status != "ok"]
    if problems:
        raise AssertionError("\n".join(problems))
    return [got[r][1] for r in sorted(got)]


def env_pid() -> int:
    return os.getpid()
