"""A pipeline across processes: which rank runs which stage, what each rank keeps, and what the
ranks settle together in a step.

With `compile_pipeline(model, example, mesh=mesh)`, every rank of the DeviceMesh compiles the
same plan, and stage s runs on the rank at coordinate `plan.ranks[s]` of the mesh's "pp"
dimension. Each rank keeps the parameters and buffers of its own stages; the rest are moved to
the meta device (shapes kept, memory freed). Values travel on fxpipe/distributed/channel.py; a failure on
one rank is raised on all, and tied weights' gradients are summed among the ranks that read them.
"""
from __future__ import annotations

import functools
import gc
import hashlib
import itertools
import pickle
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Any, Callable, Hashable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from fxpipe.compiled.materialize import freed_refusal, mark_freed, release_for_swap, rnn_weight_refs_let_go, unfillable_refusal
from fxpipe.compiled.placement import RankPlacement
from fxpipe.compiled.plan import Plan
from fxpipe.core.attrs import fetch_attr
from fxpipe.core.edges import CALLER
from fxpipe.core.failures import Failure, PeerLost, RemoteFailure
from fxpipe.distributed.channel import Channel
from fxpipe.runtime.grads import summed as sum_of_two
from fxpipe.runtime.stage_error import raised_here
from fxpipe.runtime.step import StageError

DEFAULT_TIMEOUT = 300.0  # seconds a rank waits for another before it gives up on it
# Values travel on a group per direction of each pair of ranks, on every backend:
#   NCCL  a posted receive holds the pair's stream: rank 0's send of x1 would queue behind its
#         receive of g0, and rank 1's send of g0 behind its receive of x1;
#   gloo  a pair's group is one TCP connection: when both ranks send a large value at once (an
#         activation one way, a gradient the other), one of them waits milliseconds for the
#         other's bytes to drain (benchmarks/distributed.py measures both ways).
# Made once per mesh, timeout and world: each gloo group holds threads of its own.
_directions: dict[tuple[Any, ...], tuple[Any, dict[tuple[int, ...], Any]]] = {}





def placement_of(mesh: Any, timeout: Optional[float]) -> RankPlacement:
    """The placement a DeviceMesh with a "pp" dimension (and optionally "dp") gives this process."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if "pp" not in names:
        raise ValueError(
            f"mesh must be a torch.distributed DeviceMesh with a dimension named 'pp' (got dimensions {names}).\n"
            "How to fix: init_device_mesh('cpu', (stages,), mesh_dim_names=('pp',)), or ('pp', 'dp') for data "
            "parallel replicas too."
        )
    pp = mesh["pp"] if len(names) > 1 else mesh
    ranks = [int(r) for r in pp.mesh.flatten().tolist()]
    if mesh.device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device(mesh.device_type)
    return RankPlacement(
        group=mesh.get_group("pp"),
        ranks=ranks,
        me=ranks.index(dist.get_rank()),
        device=device,
        timeout=DEFAULT_TIMEOUT if timeout is None else float(timeout),
        dp_group=mesh.get_group("dp") if "dp" in names else None,
        lines=mesh.mesh.movedim(names.index("pp"), -1).reshape(-1, len(ranks)).tolist(),
        replica_lines=mesh.mesh.movedim(names.index("dp"), -1).reshape(-1, mesh.mesh.shape[names.index("dp")]).tolist() if "dp" in names else [],
    )


def connect(placement: RankPlacement) -> None:
    """Give `placement` its group for each direction of each pair of ranks in its pipeline,
    keyed by (from, to) pipeline coordinates. Made once the ranks have compared their plans, so
    that a rank that never came is found by that comparison, within the timeout."""
    key = (tuple(map(tuple, placement.lines)), tuple(map(tuple, placement.replica_lines)), placement.timeout)
    world, groups = _directions.get(key, (None, {}))
    if world is not dist.group.WORLD:  # first use of this mesh, or a new world since
        groups = _make_direction_groups(placement)
        _directions[key] = (dist.group.WORLD, groups)
    mine = placement.ranks
    placement.directions = {(a, b): groups[(mine[a], mine[b])] for a, b in itertools.permutations(range(len(mine)), 2)}
    if placement.replica_lines:
        placement.dp_group = next(groups[tuple(line)] for line in placement.replica_lines if dist.get_rank() in line)


def _make_direction_groups(placement: RankPlacement) -> dict[tuple[int, ...], Any]:
    """A group for each (from, to) pair of global ranks in every pipeline of the mesh, and one
    for each stage's data-parallel replicas (keyed by their global ranks), all with the
    pipeline's timeout, which then bounds the replicas' gradient all-reduce too (the mesh's own
    groups wait for as long as the process group's default): every rank makes every group, in
    one order, as torch.distributed requires."""
    timeout = timedelta(seconds=placement.timeout)
    try:
        groups: dict[tuple[int, ...], Any] = {
            (line[a], line[b]): dist.new_group([line[a], line[b]], timeout=timeout)
            for line in placement.lines
            for a, b in itertools.permutations(range(len(line)), 2)
        }
        groups.update({tuple(line): dist.new_group(line, timeout=timeout) for line in placement.replica_lines})
        return groups
    except (RuntimeError, dist.DistError) as e:
        raise PeerLost(_late("making the pipeline's process groups", placement.timeout, e, COMPILING_LATE)) from e


# Why a rank may be missing from an exchange, and what to do: while compiling, and in a loop.
COMPILING_LATE = (
    "A rank failed or stopped before compile_pipeline, or is still building its model: see its own "
    "output. Every rank must call compile_pipeline; a slow start needs a longer timeout: "
    "compile_pipeline(..., timeout=seconds)."
)
LOOP_LATE = (
    "A rank stopped its train_steps loop (a break, close(), or an error in its own code between two losses), "
    "or fell behind: see its own output. Every rank must take the same batches and stop after the same one "
    "(an error in one rank's code between two losses stops that rank's loop alone: raise it on every rank); a "
    "rank that may be slow needs a longer timeout: compile_pipeline(..., timeout=seconds)."
)


def gathered(value: Any, placement: RankPlacement, what: str, late: str = COMPILING_LATE) -> list[Any]:
    """`value` from every rank of the world, in rank order; raises PeerLost when a rank has not
    sent its own within the timeout (`what`: the exchange, and `late`: why a rank may be missing
    from it, for the message)."""
    data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
    # One exchange of a fixed size carries every rank's size and what it meets for, and its value
    # where every value fits (the loop's meetings, several per batch); a larger one takes a
    # second, of the largest.
    first = torch.zeros(_HEAD + _ONE_EXCHANGE, dtype=torch.uint8)
    first[:8] = torch.tensor([data.numel()], dtype=torch.int64).view(torch.uint8)
    named = what.encode()[: _HEAD - 8]
    first[8 : 8 + len(named)] = torch.frombuffer(bytearray(named), dtype=torch.uint8)
    if data.numel() <= _ONE_EXCHANGE:
        first[_HEAD : _HEAD + data.numel()] = data
    heads = [part.cpu() for part in _all_gathered(first, placement, what, late)]
    _refuse_ranks_out_of_step([bytes(head[8:_HEAD].numpy()).rstrip(b"\0").decode(errors="replace") for head in heads])
    sizes = [int(head[:8].view(torch.int64)) for head in heads]
    if max(sizes) <= _ONE_EXCHANGE:
        return [pickle.loads(head[_HEAD : _HEAD + n].numpy().tobytes()) for head, n in zip(heads, sizes)]
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[: data.numel()] = data
    parts = _all_gathered(padded, placement, what, late)
    return [pickle.loads(part[:n].cpu().numpy().tobytes()) for part, n in zip(parts, sizes)]


_ONE_EXCHANGE = 4096  # bytes of a value that travels with its size
_HEAD = 8 + 192  # its size, and what the exchange is for (its first bytes)


def _refuse_ranks_out_of_step(meetings: list[str]) -> None:
    """Every rank in the same exchange, or every rank raises, naming where each is: an exchange
    paired with another (a rank that broke out of a loop the others went on with, or that
    called again after a timeout) would hand each rank values of another kind."""
    if len(set(meetings)) == 1:
        return
    where = "; ".join(f"rank {rank}: {meeting}" for rank, meeting in enumerate(meetings))
    raise RuntimeError(
        f"the ranks are out of step, each at another exchange ({where}): a rank stopped a loop or a call that the "
        "others went on with (a break or an error on one rank, a timeout), and they no longer meet at the same points."
        "\nHow to fix: restart every process (a process group out of step cannot be put back in step); end a "
        "train_steps loop on every rank alike (break on every rank, or close() it on every rank)."
    )


def _all_gathered(tensor: torch.Tensor, placement: RankPlacement, what: str, late: str) -> list[torch.Tensor]:
    tensor = tensor.to(placement.device)
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    work: Any = dist.all_gather(parts, tensor, async_op=True)
    try:
        work.wait(timedelta(seconds=placement.timeout))
    except RuntimeError as e:
        raise PeerLost(_late(what, placement.timeout, e, late)) from e
    return parts


def _late(what: str, timeout: float, error: BaseException, why: str) -> str:
    return f"not every rank took part in {what} within {timeout:g} s: {type(error).__name__}: {error}\n{why}"


def agree_on_times(gm: fx.GraphModule, placement: RankPlacement) -> None:
    """balance='time' measures on every rank, and rank 0's measures are the ones every rank
    cuts by: one plan, however the ranks' timings differ."""
    nodes = [n for n in gm.graph.nodes if "time" in n.meta]
    rank_0 = gathered([n.meta["time"] for n in nodes], placement, "comparing the measured times")[0]
    for node, seconds in zip(nodes, rank_0):
        node.meta["time"] = seconds


def plan_parts(plan: Plan, computes: Sequence[str] = ()) -> dict[str, str]:
    """What every rank's plan must agree on, by part, each as a short digest: the stages' nodes
    and parameter bytes (a layer built wider on one rank), what each computes (`computes`, by
    stage: a constant, an option, a module's settings), and what travels. Not the shapes of
    what travels: data-parallel replicas may compile with shares of different sizes."""
    parts = {
        "options": repr((plan.chunks, plan.checkpoint, plan.schedule, plan.ranks)),
        "edges": repr([(e.value, e.src, e.dst, e.kind, e.dtype) for e in plan.edges]),
        **{f"stage {s.index}": repr((s.nodes, s.inputs, s.outputs, s.param_bytes, computes[s.index] if computes else ""))
           for s in plan.stages},  # fmt: skip
    }
    return {name: hashlib.sha256(text.encode()).hexdigest()[:16] for name, text in parts.items()}


def what_it_computes(gm: fx.GraphModule, run: Sequence[fx.Node]) -> str:
    """Each node's op, target and arguments (nodes by name, other values as plain data or their
    type), and the settings of each module it calls: the same on every rank given the same model,
    whatever the values of its tensors."""
    return repr([
        (node.op, _named(node.target), fx.node.map_aggregate((node.args, node.kwargs), _plain),
         str(fetch_attr(gm, str(node.target))) if node.op == "call_module" else "")
        for node in run
    ])  # fmt: skip


def _named(target: Any) -> str:
    return target if isinstance(target, str) else f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', type(target).__qualname__)}"


_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format, type(Ellipsis))


def _plain(value: Any) -> Any:
    """A node by name, plain data as it is, anything else by its type (its repr may hold an address)."""
    if isinstance(value, fx.Node):
        return value.name
    if isinstance(value, slice):
        return (value.start, value.stop, value.step)
    return value if isinstance(value, _PLAIN) else type(value).__qualname__


def check_same_plan(
    plan: Plan, placement: RankPlacement, freed: Sequence[str] = (), unfilled: Sequence[str] = (), computes: Sequence[str] = (),
) -> None:
    """Every rank of the world compiled the same plan, and can make its stages (`freed`: the
    tensors they read that an earlier compile freed here; `unfilled`: buffers of a model built on
    the meta device that nothing can fill; `computes`: `what_it_computes` of each stage); else
    one error on every rank."""
    mine = plan_parts(plan, computes)
    every = gathered((mine, list(freed), list(unfilled)), placement, "comparing the plans")
    first = every[0][0]
    problems = []
    for rank, (parts, _, _) in enumerate(every):
        differ = sorted(name for name in set(mine) | set(parts) if parts.get(name) != first.get(name))
        if differ:
            problems.append(f"rank {rank} differs from rank 0 in: {', '.join(differ)}")
    if problems:
        raise RuntimeError(
            "the ranks compiled different plans:\n" + "\n".join(f"  - {p}" for p in problems) + "\n"
            "How to fix: give every rank the same model, example shapes and arguments."
        )
    needed = {f"rank {rank}": names for rank, (_, names, _) in enumerate(every) if names}
    if needed:
        raise freed_refusal(needed)
    unfillable = {f"rank {rank}": names for rank, (_, _, names) in enumerate(every) if names}
    if unfillable:
        raise unfillable_refusal(unfillable)


Router = Callable[[Hashable], int]


def routes(stages: Sequence[Any], stage_ranks: Sequence[int], loss_stage: int, me: int) -> tuple[Router, Router]:
    """For a step's mailbox keys (fxpipe/runtime/step.py): the coordinate of the rank a value is for
    (`home`) and of the rank that makes it (`source`). The pipeline's inputs are on every rank;
    its outputs, and the loss, on the rank of the loss stage."""
    sink = len(stages)
    output_rank = stage_ranks[loss_stage]
    makers = {name: s.index for s in stages for name, dsts in s.consumers.items() if sink in dsts}

    def rank_of(stage: int) -> int:
        return me if stage == CALLER else output_rank if stage == sink else stage_ranks[stage]

    def home(key: Hashable) -> int:
        assert isinstance(key, tuple)
        return rank_of(key[1])

    def source(key: Hashable) -> int:
        assert isinstance(key, tuple)
        if key[0] == "fwd":
            dst, name = key[1], key[3]
            return rank_of(makers[name] if dst == sink else stages[dst].sources[name])
        return rank_of(key[4])  # a gradient comes from the value's consumer

    return home, source





def refuse_written_inputs(programs: dict[bool, Any]) -> None:
    """An input the model writes in place is written, in each rank's own copy of the call's
    inputs, only on the rank of the stage that writes it: the others' (a target that is the input,
    read by the loss on the last rank) would stay as before the write, where the plain model run on
    each rank writes each one."""
    written = sorted(set().union(*(program.written_inputs for program in programs.values())))
    if written:
        raise ValueError(
            f"the model writes its input{'s' if len(written) > 1 else ''} {', '.join(map(repr, written))} in place: "
            "across processes only the rank of the stage that writes it would see the write, and every other "
            "rank's copy (a target that is the input, say) would stay as it was.\nHow to fix: write a copy in the "
            "model (x = x - m in place of x.sub_(m)), or run it in one process."
        )


def unread(owner: nn.Module, programs: Sequence[Any]) -> list[torch.Tensor]:
    """Parameters and buffers that no stage reads, in any mode: a parameter of a branch no mode
    takes, a buffer forward never reads. The rank at pipeline coordinate 0 holds them, so that
    they stay in its part of the state dict and nothing of the model is lost."""
    read: set[int] = set()
    for program in programs:
        read.update(id(t) for t in program.given.values() if isinstance(t, torch.Tensor))
        read.update(program.readers)
    return [t for t in _state(owner) if id(t) not in read]


def keep_local_state(owner: nn.Module, programs: Sequence[Any], placement: RankPlacement) -> None:
    """Move every parameter and buffer that no stage of this rank reads to the meta device (what
    no stage reads stays on coordinate 0): the tensor objects stay (and their shapes), their
    memory goes. If something else holds one on any rank (the autograd graph of an output kept
    from an earlier forward), every rank puts back what it moved and raises, naming them."""
    me = placement.me
    kept: set[int] = {id(t) for t in unread(owner, programs)} if me == 0 else set()
    for program in programs:
        kept.update(id(t) for t in program.given.values() if isinstance(t, torch.Tensor))
        for index, rank in enumerate(program.layout.ranks):
            if rank == me:
                kept.update(id(t) for t in program.stage_tensors(index))
    freed = [t for t in _state(owner) if id(t) not in kept and t.device.type != "meta"]
    gc.collect()  # cycles not yet collected (the frames of a failed trace) may hold one
    release_for_swap(freed)
    moved, held = [], []
    with rnn_weight_refs_let_go(owner):
        for tensor in freed:
            empty = _on_meta(tensor)
            try:
                torch.utils.swap_tensors(tensor, empty)
            except RuntimeError:
                held.append(tensor)
                continue
            moved.append((tensor, empty))
        names = {id(t): name for name, t in [*owner.named_parameters(remove_duplicate=False), *owner.named_buffers(remove_duplicate=False)]}
        every = gathered(sorted(names.get(id(t), "?") for t in held), placement, "freeing the other ranks' tensors")
        if any(every):
            for tensor, empty in reversed(moved):
                torch.utils.swap_tensors(tensor, empty)  # back as it was
            raise RuntimeError(_held_refusal(every))
    mark_freed(owner, [tensor for tensor, _ in moved])


def _held_refusal(every: list[list[str]]) -> str:
    found = "; ".join(f"on rank {rank}: {', '.join(names)}" for rank, names in enumerate(every) if names)
    return (
        f"compile_pipeline could not free the tensors of other ranks' stages ({found}): something else "
        "holds them, such as the autograd graph of an output kept from an earlier forward.\n"
        "How to fix: drop such outputs before compiling (del out), or compute them under torch.no_grad()."
    )


def _state(owner: nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer of the model, once."""
    found: dict[int, torch.Tensor] = {}
    for module in owner.modules():
        for table in (module._parameters, module._buffers):
            for tensor in table.values():
                if tensor is not None:
                    found.setdefault(id(tensor), tensor)
    return list(found.values())


def _on_meta(tensor: torch.Tensor) -> torch.Tensor:
    empty = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    return nn.Parameter(empty, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty


def holders(program: Any, params: Sequence[nn.Parameter]) -> list[list[int]]:
    """For each parameter, the pipeline coordinates of the ranks whose stages read it."""
    return [sorted(program.readers.get(id(p), ())) for p in params]


@contextmanager
def failing_together(channel: Channel, phase: str = "the end of the step") -> Iterator[None]:
    """A step across processes fails on every rank: what fails here is sent to the others, and
    a failure heard from another rank is raised here as that rank's error. `phase` names where
    an error that is not a stage's own was raised."""
    try:
        yield
    except StageError as e:
        channel.fail(e.failure(channel.ranks[channel.me]))
        raise
    except RemoteFailure as e:
        channel.fail(e.failure)
        raise raised_here(e.failure) from e
    except BaseException as e:
        channel.fail(_failed_here(channel, e, phase))
        raise


def _failed_here(channel: Channel, error: BaseException, phase: str) -> Failure:
    """What the other ranks are told of an error raised here that is not a stage's own."""
    stage, micro_batch, where = getattr(error, "fxpipe_where", (-1, -1, phase))  # a Ctrl-C in a stage says where
    return Failure(channel.ranks[channel.me], stage, micro_batch, where, f"{type(error).__name__}: {error}")


@contextmanager
def refused_on_every_rank(channel: Optional[Channel]) -> Iterator[None]:
    """Across processes, a call refused on this rank before its ranks meet (a check of its own,
    run before the call's agreement) is refused on every rank: the others hear of it as they
    prepare theirs, as of a refusal in preparing the call, where they would wait out the
    timeout and then blame this rank as lost."""
    try:
        yield
    except Exception as error:
        if channel is not None:
            with suppress(Exception):  # (a peer that is gone: its own error says so)
                channel.begin()
                channel.fail(_failed_here(channel, error, "preparing the call"))
        raise


def summed_in_rank_order(grads: list[torch.Tensor]) -> Optional[torch.Tensor]:
    """The sum of the ranks' gradients, alike on every rank; a sparse one (a sparse embedding's)
    added as autograd adds it in one process."""
    if len(grads) <= 1:
        return grads[0] if grads else None
    if all(g.layout == torch.strided for g in grads):
        return torch.stack(grads).sum(0)
    return functools.reduce(sum_of_two, grads)


def sum_tied(
    channel: Channel, program: Any, params: Sequence[nn.Parameter], grads: list[Optional[torch.Tensor]], owner: nn.Module
) -> list[Optional[torch.Tensor]]:
    """A parameter several ranks read (a tied embedding, say) gets the sum of every rank's
    gradient, added in rank order on each of them: the same bits everywhere. Each rank that
    holds a copy sends whether it trains there, and its gradient (None: unused this step), under
    the parameter's place among all the program's, which no rank's `requires_grad` changes: a
    rank that froze only the parameters it holds (`pipe.named_parameters()` on every rank) still
    pairs its messages with the others'. A copy frozen on one rank and trained on another is
    refused."""
    me = channel.me
    mine = {id(p): (True, g) for p, g in zip(params, grads)}
    tied = [(k, p, ranks) for k, (p, ranks) in enumerate(zip(program.parameters, holders(program, program.parameters)))
            if me in ranks and len(ranks) > 1]  # fmt: skip
    for k, p, ranks in tied:
        for rank in ranks:
            if rank != me:
                channel.send(rank, ("tied", k), mine.get(id(p), (False, None)))
    summed = {id(p): g for p, g in zip(params, grads)}
    problems = []
    for k, p, ranks in tied:
        parts = [mine.get(id(p), (False, None)) if rank == me else channel.take(rank, ("tied", k)) for rank in ranks]
        if len({trains for trains, _ in parts}) > 1:
            name = next((n for n, q in owner.named_parameters(remove_duplicate=False) if q is p), f"parameter {k}")
            trained = [channel.ranks[rank] for rank, (trains, _) in zip(ranks, parts) if trains]
            frozen = [channel.ranks[rank] for rank, (trains, _) in zip(ranks, parts) if not trains]
            problems.append(f"{name!r} requires grad on rank(s) {trained} and not on {frozen}")
        present = [g.to(p.device) for _, g in parts if g is not None]
        summed[id(p)] = summed_in_rank_order(present)
    if problems:
        raise ValueError(
            "a parameter read on several ranks is trained on some and frozen on others:\n"
            + "\n".join(f"  - {line}" for line in problems)
            + "\nHow to fix: set requires_grad alike on every rank that holds it (through the model, or "
            "pipe.named_parameters() on every rank)."
        )
    return [summed[id(p)] for p in params]
