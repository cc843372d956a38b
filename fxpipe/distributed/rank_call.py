"""A pipeline's call across processes, on this rank: the call compared with the other ranks'
first, then its stages' part of the step, and what the step ends with settled among the ranks
(the loss, tied weights' gradients, the data-parallel replicas)."""
from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map_only

from fxpipe.compiled.program import Program
from fxpipe.core.model_hooks import refuse_model_hooks_across
from fxpipe.core.randomness import draw_step_seed, generator_put_back_on_error
from fxpipe.distributed.channel import Channel
from fxpipe.distributed.ranks import failing_together, holders, sum_tied
from fxpipe.distributed.replicas import ReplicaFailed, Replicas
from fxpipe.runtime.batch_loss import loss_and_outputs, own_loss_reduction, own_mean_size
from fxpipe.runtime.call import Call, sliced_call
from fxpipe.runtime.grads import accumulate, parameter_grads
from fxpipe.runtime.loss_state import LossStateKept, calls_of_loss_fn
from fxpipe.runtime.losses import LeafGrads, refuse_whole_batch_outputs_of_a_call, replay_once
from fxpipe.runtime.step import Step
from fxpipe.schedules.slices import SliceSpec


@dataclass(frozen=True)
class Host:
    """What a call across processes needs of the pipeline making it: its model, its channel to the
    other ranks, its replicas, and the parts of a local call it runs on this rank's stages."""

    owner: nn.Module
    channel: Channel
    replicas: Optional[Replicas]
    training: Callable[[], bool]
    program: Callable[[], Program]  # the program of the mode the pipeline is in
    prepare: Callable[[tuple[Any, ...], dict[str, Any]], Call]
    make_step: Callable[..., Step]
    train_call: Callable[..., tuple[Call, Step]]
    held_here: Callable[[Program], list[nn.Parameter]]
    slicing: Optional[SliceSpec] = None  # how calls are cut into slices of their sequence, if they are


def forward_across(pipe: Host, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Forward only; the output on the rank of the last stage, None on the others."""
    channel = pipe.channel
    channel.begin()
    with failing_together(channel, "preparing the call"):
        refuse_model_hooks_across(pipe.owner)
        call = pipe.prepare(args, kwargs)
        if call.grad:
            raise RuntimeError(
                "across processes, pipe(x) runs forward only: the backward of one rank's output cannot "
                "reach the stages on other ranks.\nHow to fix: train with pipe.train_step(x, target=y, "
                "loss_fn=...), and call pipe(x) under torch.no_grad() for inference."
            )
        refuse_whole_batch_outputs_of_a_call(call.program.template, len(call.sizes))
        call = sliced_call(call, pipe.slicing)
        step = pipe.make_step(call, "gpipe", loss=None)
        _agree(pipe, call, "pipe(x)", seed=step.seed)
    # A failure on any rank, this one's stages done or not, puts back what they wrote (buffers,
    # inputs): the call leaves every rank as it found it, as in one process.
    with failing_together(channel), _put_back_on_error(step):
        outputs = step.forward()
        gathered = call.gather(outputs) if outputs else None  # (a failure here is every rank's too)
        settle_generators(step, channel.finish(step.drew))
    return gathered.rebuild(gathered.tensors) if gathered is not None else None


@contextlib.contextmanager
def _put_back_on_error(step: Step) -> Iterator[None]:
    try:
        yield
    except BaseException:
        step.put_back_buffers()
        raise


def train_across(
    pipe: Host, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any, loss_fn: Any, reduction: str, return_outputs: bool
) -> Any:
    """train_step on this rank: its stages' actions, the loss from the loss stage's rank (the
    same on every rank), tied weights' gradients summed among the ranks that read them. A
    call refused on one rank (its arguments, say) is refused on every rank."""
    kept = LeafGrads()
    with generator_put_back_on_error(), kept.put_back_on_error():  # on every rank: they stay alike
        return _train_across(pipe, args, kwargs, target, loss_fn, reduction, return_outputs, kept)


def settle_generators(step: Step, drew: dict[int, bool], state: Optional[torch.Tensor] = None) -> None:
    """Every rank's generator as the step leaves it in one process: as `loss_fn` left it on the
    loss rank (`state`, when it drew), then past the step's seed if a stage on any rank drew
    (`drew`: by peer, whether its stages drew; this rank's is `step.drew`)."""
    if state is not None:
        torch.set_rng_state(state)
    if step.drew or any(drew.values()):
        draw_step_seed()


def _train_across(
    pipe: Host, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any, loss_fn: Any, reduction: str,
    return_outputs: bool, kept: LeafGrads,
) -> Any:
    channel = pipe.channel
    channel.begin()
    call: Optional[Call] = None
    total, outputs, problem = None, None, None
    grads: list[Optional[torch.Tensor]] = []
    try:
        with failing_together(channel, "preparing the call"):
            call, step = pipe.train_call(args, kwargs, target, loss_fn, reduction, kept, return_outputs)
            if loss_fn is None:  # (as the call's losses were weighted)
                reduction = own_loss_reduction(call, reduction, sliced=call.slices is not None)
            _agree(pipe, call, f"train_step, reduction={reduction!r}", target, seed=step.seed)
        layout = call.program.layout
        loss_rank = layout.ranks[layout.loss_stage]
        here = channel.me == loss_rank
        before = torch.get_rng_state()
        kept_state = LossStateKept(loss_fn if here else None, calls=calls_of_loss_fn(len(call.sizes)))  # (the loss stage calls it here)
        with failing_together(channel):
            step.train()
            if here:
                try:
                    with kept_state:
                        total, outputs = loss_and_outputs(call, step, loss_fn, target, reduction, return_outputs)
                        kept_state.replay = replay_once(loss_fn, outputs, target, total.device) if loss_fn is not None else None
                except ValueError as e:  # every rank raises it, after the step ends on all
                    problem = str(e)
            if call.grad:
                grads = sum_tied(channel, call.program, call.params, parameter_grads(call.program, step, call.params), pipe.owner)
            after = torch.get_rng_state() if here else before
            drawn = None if torch.equal(after, before) else after  # by loss_fn, which ran on this rank alone
            got = channel.finish((total, problem, step.drew, drawn) if here else (None, None, step.drew, None))
        settle_generators(step, {peer: payload[2] for peer, payload in got.items()}, got[loss_rank][3] if not here else None)
    except BaseException as e:
        if pipe.replicas is not None:  # the replicas must not wait for this one's gradients
            wanting = _wanting_grad(pipe) if call is None else len(call.params) if call.grad else 0
            with contextlib.suppress(Exception):
                pipe.replicas.agree([False] * wanting, None, 0, True, first_line(e), _alike(pipe, call))
        raise
    if not here:
        total, problem = got[loss_rank][:2]
    if pipe.replicas is None:
        if problem is not None:
            raise ValueError(problem)
        if call.grad:
            accumulate(call, [], grads)
            kept.backward_targets()
        return (total, outputs) if return_outputs else total
    present = [g is not None for g in grads]
    try:
        failed = f"ValueError: {problem}" if problem else ""
        size = own_mean_size(call, reduction) if loss_fn is None else sum(call.sizes)
        scale, total = pipe.replicas.agree(present, total, size, reduction == "mean", failed, _alike(pipe, call))
    except ReplicaFailed:
        if problem is None:
            raise
    if problem is not None:
        raise ValueError(problem)
    if call.grad:
        pipe.replicas.accumulate(pipe.held_here(call.program), call.params, grads, scale)
        kept.backward_targets()
    return (total, outputs) if return_outputs else total


def _alike(pipe: Host, call: Optional[Call]) -> dict[str, bool]:
    """What data-parallel replicas compare of their calls (the same keys on every replica, a
    failed one's too: the values travel in one all-reduce)."""
    return {"training mode": pipe.training(), "autocast": call is not None and bool(call.context.autocast)}


def _agree(pipe: Host, call: Call, kind: str, target: Any = None, seed: int = 0) -> None:
    """Every rank of the pipeline makes the same call, or every rank raises, naming what
    differs: the same micro-batches (sizes and shapes), grad mode and train or eval mode, and
    the same data. A rank that ran another step's schedule would wait for values that never
    come, or pair its micro-batches with another call's; one given a batch of its own (loaded
    apart, as under DDP) would pair its inputs with another rank's targets."""
    mine = call_signature(pipe, call, kind, target, seed)
    refuse_calls_that_differ(pipe, {**pipe.channel.exchange("call", mine), pipe.channel.me: mine})


def call_signature(pipe: Host, call: Call, kind: str, target: Any = None, seed: int = 0) -> dict[str, Any]:
    """What the ranks compare of a call (`refuse_calls_that_differ`)."""
    return {**_call_signature(pipe, call, kind, target), "seed": seed}


def refuse_calls_that_differ(pipe: Host, calls: dict[int, dict[str, Any]], tied: bool = True) -> None:
    """Raise, naming what differs, unless every rank's call (`calls`, by pipeline coordinate,
    this rank's included) is this rank's; with `tied`, the copies of tied weights are compared too."""
    mine = calls[pipe.channel.me]
    differing = [key for key in mine if key not in ("tied", "data", "seed") and any(c.get(key) != mine[key] for c in calls.values())]
    ranks = pipe.channel.ranks
    lines = [f"{key}: " + ", ".join(f"rank {ranks[r]} {calls[r].get(key)}" for r in sorted(calls)) for key in differing]
    if not lines:  # (a call in another mode draws no seed: its seed differs anyway)
        seeds = {ranks[r]: c["seed"] for r, c in calls.items()}
        _refuse_draws_apart(seeds)
        _refuse_generators_apart(seeds)
    apart = [name for name, digest in mine["data"].items() if any(c.get("data", {}).get(name) != digest for c in calls.values())]
    if apart and not differing:  # (data of other shapes differs anyway)
        lines += [_odd_ranks(name, {ranks[r]: c.get("data", {}).get(name) for r, c in calls.items()}) for name in apart]
    if lines:
        raise RuntimeError(
            "the ranks of the pipeline were called differently:\n" + "\n".join(f"  - {line}" for line in lines)
            + "\nHow to fix: call it on every rank at once, with the same inputs and targets (the ranks of one "
            "pipeline share a batch; each data-parallel replica has its own share), under the same grad mode and "
            "autocast, and pipe.train() or pipe.eval() on every rank."
        )
    if tied:
        refuse_tied_copies_that_differ({ranks[r]: c["tied"] for r, c in calls.items()})


def _odd_ranks(name: str, digests: dict[int, Any]) -> str:
    """'data of x: rank(s) [2] differ from rank(s) [0, 1]': the ranks apart from the most alike."""
    groups: dict[Any, list[int]] = {}
    for rank in sorted(digests):
        groups.setdefault(digests[rank], []).append(rank)
    most = max(groups.values(), key=len)
    return f"data of {name}: rank(s) {sorted(set(digests) - set(most))} differ from rank(s) {most}"


Fingerprint = tuple[str, int, float, float, float]  # the copy's device type, its sample's size and sums (`tied_fingerprints`)


def refuse_tied_copies_that_differ(tied: dict[int, dict[str, Fingerprint]], after: Optional[int] = None) -> None:
    """Every rank holding a copy of a tied parameter must hold the same values: else the ranks
    compute with different models (one initialised apart on each rank), which no plain model
    computes, while their summed gradients keep the copies apart for ever. `after`: the batch
    whose update the copies hold, in a loop (None: before its first)."""
    differ = []
    for name in sorted({name for held in tied.values() for name in held}):
        values = {rank: held[name] for rank, held in tied.items() if name in held}
        first = next(iter(values.values()))
        # Copies stepped alike on one kind of device are equal to the last bit (the sums of the
        # sample alone may differ in their last bits, with the threads that added them); on
        # several, each kind's arithmetic rounds the updates its own way.
        close = 1e-12 if len({device for device, *_ in values.values()}) == 1 else 1e-6
        scale = math.sqrt(first[1] * first[3])  # at least the sum of the sample's magnitudes (a sum may cancel to near 0)
        if not all(math.isclose(a, b, rel_tol=close, abs_tol=close * scale) for v in values.values() for a, b in zip(first[1:], v[1:])):
            differ.append(f"{name!r}, held on ranks {sorted(values)}")
    if not differ:
        return
    if after is None:
        when, fix = "", (
            "build the model alike on every rank (one torch.manual_seed(...) before building it), or load one "
            "checkpoint on every rank; step every rank's optimizer alike (clip with pipe.clip_grad_norm_(...), the "
            "norm of every rank's gradients, not torch.nn.utils.clip_grad_norm_ over one rank's parameters)."
        )
    else:  # the copies were alike as the loop began: the ranks stepped them apart since
        when, fix = f" after batch {after}'s update", (
            "step every rank's copy alike: clip with pipe.clip_grad_norm_(...) (the norm of every rank's gradients), "
            "not torch.nn.utils.clip_grad_norm_ over one rank's parameters, and change the optimizer's settings "
            "(lr, weight decay) in after_step on every rank, not on some."
        )
    raise RuntimeError(
        f"the copies of a tied parameter differ between the ranks that hold them{when}, so the ranks would compute "
        "with different models:\n" + "\n".join(f"  - {line}" for line in differ) + f"\nHow to fix: {fix}"
    )


def _refuse_draws_apart(seeds: dict[int, int]) -> None:
    """Ranks whose stages may draw take the step's seed, the others none (seed 0): where they
    differ, a module's hooks on some ranks alone (a hook runs as its module does, and may draw)
    would move those ranks' generators apart from the others'."""
    drawing = sorted(rank for rank, seed in seeds.items() if seed)
    if drawing and len(drawing) < len(seeds):
        raise RuntimeError(
            f"the stages of rank(s) {drawing} may draw random numbers and those of rank(s) "
            f"{sorted(set(seeds) - set(drawing))} may not: hooks on modules of the model (forward hooks, pre-hooks, "
            "backward hooks) on some ranks alone, or a dropout's rate set on some ranks alone. A hook runs as its module "
            "does and may draw, which would move those ranks' random generators apart from the others'.\nHow to fix: "
            "register the same hooks on every rank (each rank holds the whole model, the modules of other ranks' stages "
            "on the meta device, where a hook never runs), and set the model alike on every rank."
        )


def _refuse_generators_apart(seeds: dict[int, int]) -> None:
    """A step that may draw (dropout) takes one seed from the caller's generator, as one process
    does; ranks whose generators differ (seeded `seed + rank`) would each draw their stages'
    masks from their own, a mix no one process draws, and leave the generators apart."""
    if len(set(seeds.values())) > 1:
        raise RuntimeError(
            "the ranks' random generators differ, and the model draws (dropout): each rank would draw its "
            f"stages' masks from its own generator (ranks {sorted(seeds)} would each draw another).\nHow to fix: "
            "seed every rank of a pipeline alike (torch.manual_seed(seed) on each, not seed + rank); data loading "
            "that needs a seed of its own per rank can take a generator of its own (DataLoader(generator=...))."
        )


def _call_signature(pipe: Host, call: Call, kind: str, target: Any = None) -> dict[str, Any]:
    """What the ranks compare of a call: every one of them must make the same."""
    modes = [m.training for m in pipe.owner.modules()]
    return {
        "call": kind,
        "micro-batch sizes": tuple(call.sizes),
        "inputs": {name: [_leaf_signature(leaf) for leaf in tree_flatten(value)[0]] for name, value in call.values.items()},
        "grad": call.grad,
        "autocast": ", ".join(f"{cast.device_type} {cast.dtype}" for cast in call.context.autocast) or "off",
        "mode": ("train" if pipe.training() else "eval", f"{sum(modes)} of {len(modes)} modules training"),
        "tied": tied_fingerprints(pipe, call.program),
        "data": _data_fingerprints(call.values, target),
    }


def _data_fingerprints(values: dict[str, Any], target: Any) -> dict[str, str]:
    """A fingerprint of the data of each input, and of the target if given: a hash of the bytes
    of an even sample of at most 4096 values of each tensor (batches loaded apart differ there;
    a NaN hashes alike on every rank, where it would compare unequal)."""
    found = {}
    named = [*values.items(), *([("train_step's target" if "target" in values else "target", target)] if target is not None else [])]
    for name, value in named:
        digest = hashlib.blake2b(digest_size=8)
        for leaf in tree_flatten(value)[0]:
            if isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided and not leaf.is_meta and leaf.numel():
                flat = leaf.detach().reshape(-1)
                sample = flat[:: max(1, flat.numel() // 4096)].contiguous()
                digest.update(sample.view(torch.uint8).cpu().numpy().tobytes())
        found[name] = digest.hexdigest()
    return found


def tied_fingerprints(pipe: Host, program: Program) -> dict[str, Fingerprint]:
    """A fingerprint of each tied parameter this rank holds a copy of, by name: sums over an
    even sample of at most 65536 of its values (copies initialised apart differ there too), the
    last weighted by position (two values swapped change it)."""
    me = pipe.channel.me
    tied = [p for p, ranks in zip(program.parameters, holders(program, program.parameters)) if me in ranks and len(ranks) > 1]
    if not tied:  # (most models: no walk over the model's parameters, which a loop does per batch)
        return {}
    names: dict[int, str] = {}
    for name, p in pipe.owner.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    found = {}
    with torch.no_grad():
        for p in tied:
            flat = p.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 65536)].double()
            weights = torch.arange(sample.numel(), dtype=torch.float64, device=sample.device).mul_(0.6180339887).frac_().add_(0.5)
            found[names.get(id(p), "a tied parameter")] = (
                p.device.type, sample.numel(), float(sample.sum()), float(sample.square().sum()), float(sample.mul(weights).sum()),
            )
    return found


def _wanting_grad(pipe: Host) -> int:
    """How many parameters take gradients in a step now (before a call is made)."""
    return len([p for p in pipe.program().parameters if p.requires_grad]) if torch.is_grad_enabled() else 0


def _leaf_signature(leaf: Any) -> Any:
    """What ranks must agree on of an input leaf: a tensor's shape and dtype, a plain value."""
    if isinstance(leaf, torch.Tensor):
        return (tuple(leaf.shape), str(leaf.dtype).removeprefix("torch."))
    return leaf if isinstance(leaf, (int, float, bool, str, type(None))) else type(leaf).__name__


def first_line(error: BaseException) -> str:
    """An error as a replica tells the others of it: its type and first line."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"
