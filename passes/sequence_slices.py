"""The graph that runs one slice of the sequence, from what passes/causal.py proved, and its check against the whole.

The graph keeps its inputs and outputs; run inside `in_slice` (fxpipe/core/carry.py) on a slice
of the inputs, it computes that slice of the outputs. Its tables read the positions they stand
for: arange(T) becomes arange(offset, offset + T) where it stands for the slice's positions (Q),
arange(offset + T) where it stands for keys (K); a table cut to T is cut the same way. Each value
attention reads as keys or values gets those of the slices before it (`with_carry`), which the
slice also hands on; causal attention gets the mask aligned to the lower right. Outside a slice
the graph computes what it did.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_unflatten

from fxpipe.core.carry import SliceState, causal_mask, in_slice, slice_offset, with_carry
from fxpipe.core.snapshot import preserved
from fxpipe.passes.fixed_draws import FixedDraws
from fxpipe.passes.position_tags import K, CausalityError, Proof
from fxpipe.passes.validate import first_line

_ATTENTION_ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class _Slicer:
    """Copies `gm`'s graph node by node, rewriting what the proof names."""

    def __init__(self, gm: fx.GraphModule, proof: Proof) -> None:
        self.gm, self.proof = gm, proof
        self.graph = fx.Graph()
        self.env: dict[str, fx.Node] = {}
        self.carried: dict[tuple[str, int], fx.Node] = {}
        self.keys = list(proof.carries)
        self.reads = {(user, argument): key for key, users in proof.carries.items() for user, argument in users}

    def build(self) -> fx.GraphModule:
        for node in self.gm.graph.nodes:
            if node.name in self.proof.tables:
                self.env[node.name] = self._table(node)
            elif node.name in self.proof.attention:
                self.env[node.name] = self._attention(node)
            else:
                self.env[node.name] = self._copy(node)
        return fx.GraphModule(self.gm, self.graph, f"{type(self.gm).__name__}Slice")

    def _arg(self, node: fx.Node) -> fx.Node:
        return self.env[node.name]

    def _carried(self, user: str, argument: Any, value: fx.Node) -> fx.Node:
        """`value` with the keys of earlier slices before it, where `user` reads it as keys."""
        key = self.reads.get((user, argument))
        if key is None:
            return value
        if key not in self.carried:
            self.carried[key] = self.graph.call_function(with_carry, (self.keys.index(key), value, key[1]))
        return self.carried[key]

    def _copy(self, node: fx.Node) -> fx.Node:
        carried = {
            position: self._carried(node.name, position, self._arg(arg))
            for position, arg in enumerate(node.args)
            if isinstance(arg, fx.Node) and (node.name, position) in self.reads
        }  # fmt: skip
        new = self.graph.node_copy(node, self._arg)
        for position, value in carried.items():
            new.update_arg(position, value)
        return new

    def _attention(self, node: fx.Node) -> fx.Node:
        """scaled_dot_product_attention with carried keys and values, and the causal mask of a
        slice in place of `is_causal` (a mask it was given reads the slice's rows and keys already:
        its tables are cut so)."""
        given = {**dict(zip(_ATTENTION_ARGUMENTS, node.args)), **node.kwargs}
        given = {name: fx.map_arg(value, self._arg) for name, value in given.items()}
        position = {name: i for i, name in enumerate(_ATTENTION_ARGUMENTS)}
        for name in ("key", "value"):
            argument = position[name] if position[name] < len(node.args) else name
            given[name] = self._carried(node.name, argument, _node(given[name]))
        if given.get("attn_mask") is None:  # is_causal, for a slice: the mask aligned to the lower right
            given["attn_mask"] = self.graph.call_function(causal_mask, (given["query"], given["key"]))
        given["is_causal"] = False
        q, k, v = given.pop("query"), given.pop("key"), given.pop("value")
        new = self.graph.call_function(F.scaled_dot_product_attention, (q, k, v), given)
        new.meta = dict(node.meta)
        return new

    def _table(self, node: fx.Node) -> fx.Node:
        """A table read at the positions it stands for: arange, or a cut to the length."""
        cuts = self.proof.tables[node.name]
        offset = self.graph.call_function(slice_offset, ())  # in the table's stage, wherever the cut falls
        if node.target is torch.arange:
            count = self._arg(_node(node.args[-1]))
            keys = self.proof.role_of(cuts[0][0]) == K
            end = self.graph.call_function(operator.add, (offset, count))
            start = 0 if keys else offset
            return self.graph.call_function(torch.arange, (start, end), fx.map_arg(dict(node.kwargs), self._arg))
        length: Optional[fx.Node] = None
        if node.target in ("narrow", torch.narrow):
            source, length = self._arg(_node(node.args[0])), self._arg(_node(node.args[3]))
        else:  # x[..., :T, ...]: the whole of those dims, then each cut
            source = self.graph.call_function(operator.getitem, (self._arg(_node(node.args[0])), _uncut(fx.map_arg(node.args[1], self._arg))))
        out = source
        for variable, dim_cut in cuts:
            size = length if length is not None else _stop(node.args[1], self._arg)
            if self.proof.role_of(variable) == K:
                start, size = 0, self.graph.call_function(operator.add, (offset, size))
            else:
                start = offset
            out = self.graph.call_function(torch.narrow, (out, dim_cut, start, size))
        return out


def _node(arg: Any) -> fx.Node:
    assert isinstance(arg, fx.Node), f"expected a node of the graph, not {arg!r}"
    return arg


def _uncut(index: Any) -> Any:
    """The index with each slice cut by a traced length made whole."""
    items = index if isinstance(index, tuple) else (index,)
    whole = tuple(slice(None) if isinstance(i, slice) and isinstance(i.stop, fx.Node) else i for i in items)
    return whole if isinstance(index, tuple) else whole[0]


def _stop(index: Any, arg: Callable[[fx.Node], fx.Node]) -> fx.Node:
    items = index if isinstance(index, tuple) else (index,)
    stops = [i.stop for i in items if isinstance(i, slice) and isinstance(i.stop, fx.Node)]
    return arg(stops[0])


def slice_graph(gm: fx.GraphModule, proof: Proof) -> fx.GraphModule:
    """The graph of one slice of the sequence (module docstring); it shares `gm`'s modules,
    parameters and buffers."""
    return _Slicer(gm, proof).build()


def run_in_slices(sliced: fx.GraphModule, proof: Proof, inputs: Sequence[Any], lengths: Sequence[int]) -> Any:
    """`sliced` run on each slice of `inputs` in turn, each handed the carries of the one
    before as they are (autograd goes through them); the slices' outputs joined along their
    sequence dims."""
    names = [n.name for n in sliced.graph.nodes if n.op == "placeholder"]
    carried: dict[int, torch.Tensor] = {}
    outputs, offset = [], 0
    for length in lengths:
        part = [x.narrow(proof.inputs[name], offset, length) if name in proof.inputs else x for name, x in zip(names, inputs)]
        with in_slice(SliceState(offset, carried)) as state:
            outputs.append(sliced(*part))
        carried = state.made
        offset += length
    leaves = [tree_flatten(out)[0] for out in outputs]
    spec = tree_flatten(outputs[0])[1]
    joined = [
        torch.cat([each[i] for each in leaves], dim) if dim is not None else leaves[0][i]
        for i, dim in enumerate(proof.outputs)
    ]  # fmt: skip
    return tree_unflatten(joined, spec)


# Relative difference (to the whole output's largest magnitude) taken as rounding, by dtype.
_ROUNDING = {torch.float64: 1e-9, torch.float32: 1e-4}


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a value with no plain equality: taken as alike, as before
        return True


def check_slices(gm: fx.GraphModule, sliced: fx.GraphModule, proof: Proof, inputs: Sequence[Any], lengths: Sequence[int]) -> None:
    """Raise CausalityError when `sliced`, run on `lengths` slices of `inputs`, computes
    otherwise than `gm` on the whole (beyond rounding). Random ops draw fixed values here, as
    slices draw masks of their own shapes; the model's state is left as it was."""
    with torch.no_grad(), preserved(gm), FixedDraws():
        whole = tree_flatten(gm(*inputs))[0]
        try:
            parts = tree_flatten(run_in_slices(sliced, proof, inputs, lengths))[0]
        except Exception as error:  # noqa: BLE001 - the whole ran: what fails is the cut into slices
            raise CausalityError([
                f"slices of {list(lengths)} do not run ({first_line(error)}): a value that holds the sequence along two "
                "dims, such as an attention mask of (batch, T, T) given as an input or attention weights returned, "
                "cannot be cut into slices of positions"
            ]) from None
    problems = []
    for k, (w, p) in enumerate(zip(whole, parts)):
        if not isinstance(w, torch.Tensor):
            if not _same(w, p):  # the slices' value is the first slice's (a length: x.size(1))
                problems.append(f"output {k} is no tensor, and slices of {list(lengths)} give {p!r} where the whole sequence gives {w!r}")
            continue
        if p.shape != w.shape:
            problems.append(f"output {k}: slices of {list(lengths)} give shape {tuple(p.shape)}, the whole {tuple(w.shape)}")
            continue
        if not w.is_floating_point():
            if not torch.equal(w, p):
                problems.append(f"output {k}: slices of {list(lengths)} give other values than the whole sequence")
            continue
        scale = w.abs().max().item() or 1.0
        tolerance = _ROUNDING.get(w.dtype, 5e-2) * scale
        worst = (w - p).abs().max().item()
        if not worst <= tolerance:
            problems.append(f"output {k}: slices of {list(lengths)} differ from the whole sequence by {worst:.3g} (rounding allows {tolerance:.3g})")
    if problems:
        raise CausalityError(problems)
