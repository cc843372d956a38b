"""The examples' shared training loop: compile, train with a progress bar, draw the stages."""
from __future__ import annotations

import argparse
from typing import Callable, Optional, Sequence

import torch
from torch import nn
from tqdm import tqdm

from fxpipe import compile_pipeline

Batch = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def default_devices() -> list[str]:
    """All GPUs when there are at least two, else two CPU stages."""
    n = torch.cuda.device_count()
    return [f"cuda:{i}" for i in range(n)] if n >= 2 else ["cpu", "cpu"]


def train(
    description: Optional[str],
    model: nn.Module,
    make_batch: Batch,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    steps: int,
    lr: float,
    svg: str,
    argv: Optional[Sequence[str]] = None,
) -> list[float]:
    """Parse the command line, pipeline `model`, train it on fresh synthetic batches with Adam,
    print the first and last loss, write the stage graph; returns the losses."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--checkpoint", default="except_last")
    p.add_argument("--devices", nargs="+", default=default_devices())
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--svg", default=svg)
    p.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "interleaved-1f1b", "zb-h1"),
                   help="what --distributed trains with (pipe.train_step); in one process the examples train with "
                        "pipe(x) and loss.backward(), which run GPipe")  # fmt: skip
    p.add_argument("--distributed", action="store_true",
                   help="one stage per process, under torchrun: gloo on CPUs, NCCL on GPUs")  # fmt: skip
    args = p.parse_args(argv)
    if args.distributed:
        return train_distributed(model, make_batch, loss_fn, args)
    devices = [d for arg in args.devices for d in arg.split()]  # also accept one quoted list

    example, _ = make_batch(args.batch)
    pipe = compile_pipeline(model, example, devices, chunks=args.chunks, checkpoint=args.checkpoint)
    opt = torch.optim.Adam(pipe.parameters(), lr=args.lr)
    losses: list[float] = []
    bar = tqdm(range(args.steps))
    for step in bar:
        x, y = make_batch(args.batch, seed=step + 1)
        out = pipe(x.to(devices[0]))
        loss = loss_fn(out, y.to(out.device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    pipe.to_svg(args.svg)
    print(f"wrote {args.svg}")
    return losses


def train_distributed(model: nn.Module, make_batch: Batch, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], args: argparse.Namespace) -> list[float]:
    """The same training under torchrun: every rank compiles the same plan on a "pp" DeviceMesh
    and runs its own stage; every rank gets the same loss, rank 0 prints it."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    mesh = init_device_mesh("cuda" if cuda else "cpu", (dist.get_world_size(),), mesh_dim_names=("pp",))
    device = torch.device("cuda") if cuda else torch.device("cpu")
    example, _ = make_batch(args.batch)
    pipe = compile_pipeline(model, example, mesh=mesh, chunks=args.chunks, checkpoint=args.checkpoint, schedule=args.schedule)
    first = dist.get_rank() == 0
    if first:
        print(pipe.plan)
    opt = torch.optim.Adam(pipe.parameters(), lr=args.lr)
    losses: list[float] = []
    bar = tqdm(range(args.steps), disable=not first)
    for step in bar:
        x, y = make_batch(args.batch, seed=step + 1)
        opt.zero_grad()
        loss = pipe.train_step(x.to(device), target=y.to(device), loss_fn=loss_fn)
        opt.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    if first:
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} (the same on every rank)")
        pipe.to_svg(args.svg)
        print(f"wrote {args.svg}")
    dist.barrier()  # no rank leaves while another still reads the end of the last step
    dist.destroy_process_group()
    return losses
