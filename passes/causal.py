"""Which dims of each value hold positions of the sequence, and the proof that no position reads a later one.

The graph runs once on the example. Each value gets a tag: the dims that index positions, each
with a role, or nothing (weights, constants, other dims):

    Q   the positions a slice owns: the inputs' sequence dim, and what is computed per position
    K   every position up to the slice's last: the key dim of attention's scores
    ?n  a table read by position (arange(T), a tril buffer narrowed to T, a rotary table [:T]),
        its role decided by what it meets: added to Q values it is Q, a mask of scores' key dim K

    x (B, T, C) Q@1 --linear, layernorm, gelu, view, transpose--> (B, H, T, D) Q@2
    q @ k.transpose(-2, -1)        -> (B, H, T, T) Q@2 K@3         k is carried: it gains the
    .masked_fill(tril == 0, -inf)  -> the keys after each query hold -inf   keys of earlier slices
    softmax(-1)                    -> ... hold 0
    att @ v                        -> (B, H, T, D) Q@2             v is carried as k is

A value that mixes positions otherwise (a sum or mean over the sequence, scores that are not
masked, a convolution, an op this pass does not know) is refused, naming the op and its line.
What the proof finds is what `passes/sequence_slices.py` rewrites: the tables to offset, the
keys and values to carry.
The tags, the proof's record and the families of ops the rules know are in
`passes/position_tags.py`; the rules for ops that move dims (sizes, indexing, reshapes, splits,
joins, reductions) in `passes/causal_layout.py`.
"""
from __future__ import annotations

import operator
from dataclasses import replace
from typing import Any, Collection, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten

from fxpipe.core.attrs import fetch_attr
from fxpipe.core.snapshot import preserved
from fxpipe.passes.causal_layout import LayoutRules
from fxpipe.passes.sources import value_inputs
from fxpipe.passes.position_tags import (
    CausalityError, Length, Positions, Proof, Refused, Sizes, conflict, future_all, key_of, tags_in,
    unmasked, op_and_line, BROKEN, FACTORIES, K, KEEPS_MASK, MATMULS, MINUS_INF, NORMS, POINTWISE_FUNCTIONS,
    PAIRWISE, POINTWISE_METHODS, POINTWISE_MODULES, Q, REDUCTIONS, RESHAPES, SCALES, SHIFTS, SOFTMAXES, ZERO,
)  # fmt: skip


# The modules kept whole whose reads this check knows (the rest it refuses, naming them).
_KNOWN_MODULES = (*POINTWISE_MODULES, nn.Linear, nn.LayerNorm, nn.RMSNorm, nn.Embedding, nn.Softmax)


class _Prover(LayoutRules, fx.Interpreter):
    """Runs the graph on the example, tagging each value (module docstring)."""

    def __init__(self, gm: fx.GraphModule, sequence_dim: int, length: int, holding: Optional[Collection[str]] = None) -> None:
        super().__init__(gm)
        self.gm, self.sequence_dim, self.length, self.holding = gm, sequence_dim, length, holding
        self.proof = Proof()
        self.problems: list[str] = []
        self.at_fault: list[fx.Node] = []
        self.node: Optional[fx.Node] = None

    def _refuse(self, why: str) -> None:
        assert self.node is not None
        self.problems.append(f"{op_and_line(self.gm, self.node)}: {why}")
        self.at_fault.append(self.node)

    # -- the walk ---------------------------------------------------------------------------
    def run_node(self, n: fx.Node) -> Any:
        self.node = n
        value = super().run_node(n)
        if n.op == "output":
            return value
        args, kwargs = self.fetch_args_kwargs_from_env(n) if n.op not in ("placeholder", "get_attr") else ((), {})
        tags = fx.node.map_aggregate((n.args, n.kwargs), self._tag_of)
        if any(t is BROKEN for t in tags_in(tags)):
            self.proof.tags[n.name] = BROKEN  # refused upstream: said once, there
            return value
        try:
            tag = self._rule(n, value, args, kwargs, tags[0], tags[1])
        except Refused as refused:
            self._refuse(str(refused))
            tag = BROKEN
        self.proof.tags[n.name] = tag
        return value

    def _tag_of(self, arg: Any) -> Any:
        return self.proof.tags.get(arg.name) if isinstance(arg, fx.Node) else None

    def _rule(self, n: fx.Node, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any], tags: tuple[Any, ...], kwtags: dict[str, Any]) -> Any:
        if n.op == "placeholder":
            return self._input(n, value)
        if n.op == "get_attr":
            return None
        if not tags_in((tags, kwtags)):
            return None
        if n.op == "call_module":
            return self._module(fetch_attr(self.gm, str(n.target)), value, args, tags)
        return self._call(key_of(n), n, value, args, kwargs, tags, kwtags)

    def _input(self, n: fx.Node, value: Any) -> Any:
        d = self.sequence_dim
        if self.holding is not None and n.name not in self.holding:
            return None
        if isinstance(value, torch.Tensor) and value.dim() > d and value.shape[d] == self.length:
            self.proof.inputs[n.name] = d
            return Positions(((d, Q),))
        if isinstance(value, torch.Tensor) and d > 0 and value.dim() == d and value.shape[d - 1] == self.length:
            self.proof.inputs[n.name] = d - 1  # no batch dim: positions every sample shares, (T,) ids
            return Positions(((d - 1, Q),))
        return None

    # -- modules ----------------------------------------------------------------------------
    def _module(self, module: nn.Module, value: Any, args: tuple[Any, ...], tags: tuple[Any, ...]) -> Any:
        x, tag = args[0], tags[0]
        if not isinstance(module, _KNOWN_MODULES):  # (whatever it is called on: what it reads is not known)
            raise Refused(
                f"{type(module).__name__} is called whole, and this check does not know what it reads (attention "
                "written in the model's own code, F.scaled_dot_product_attention(..., is_causal=True), it knows)"
            )
        if not isinstance(tag, Positions) or tags_in(tags[1:]):
            raise Refused("a module called on positions other than through its first input")
        if isinstance(module, POINTWISE_MODULES):
            return tag if isinstance(module, nn.Dropout) else unmasked(tag)
        if isinstance(module, nn.Linear):
            return self._last_dims_free(tag, x, 1, "a linear layer over the sequence dim")
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            return self._last_dims_free(tag, x, len(module.normalized_shape), "a norm over the sequence dim")
        if isinstance(module, nn.Embedding):
            return tag
        assert isinstance(module, nn.Softmax)
        return self._softmax(tag, x, module.dim if module.dim is not None else -1)

    def _last_dims_free(self, tag: Positions, x: torch.Tensor, count: int, what: str) -> Positions:
        if any(d >= x.dim() - count for d, _ in tag.dims):
            raise Refused(f"{what} mixes positions")
        return unmasked(tag)

    # -- functions and methods --------------------------------------------------------------
    def _call(self, key: Any, n: fx.Node, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any], tags: tuple[Any, ...], kwtags: dict[str, Any]) -> Any:
        if key == "size":
            return self._size(tags[0], args[0], args[1] if len(args) > 1 else kwargs.get("dim"))
        if key is getattr:
            return self._attribute(tags[0], args[0], args[1])
        if key is operator.getitem:
            return self._getitem(n, value, args, tags)
        if key in ("dim", "numel", "element_size", "get_device"):
            return None
        if key is torch.arange:
            return self._arange(n, args, kwargs, tags, kwtags)
        if key in SOFTMAXES:
            dim = args[1] if len(args) > 1 else kwargs.get("dim", -1)
            return self._softmax(tags[0], args[0], dim)
        if key in MATMULS:
            return self._matmul(n, args, tags)
        if key is F.scaled_dot_product_attention:
            return self._attention(n, args, kwargs, tags, kwtags)
        if key is F.linear:
            return self._last_dims_free(self._only_first(tags, kwtags), args[0], 1, "a linear layer over the sequence dim")
        if key in NORMS:
            shape = args[1] if len(args) > 1 else kwargs["normalized_shape"]
            return self._last_dims_free(self._only_first(tags, kwtags), args[0], len(shape), "a norm over the sequence dim")
        if key is F.embedding:
            return self._only_first(tags, kwtags)
        if key in ("narrow",) or key is torch.narrow:
            return self._narrow(n, value, args, kwargs, tags)
        if key in RESHAPES:
            return self._reshaped(tags[0], args[0], value)
        if key in ("permute", torch.permute):
            order = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
            return self._moved(tags[0], args[0], {int(o) % args[0].dim(): i for i, o in enumerate(order)})
        if key in ("transpose", torch.transpose, "swapaxes", torch.swapaxes):
            a, b = (int(args[1]) % args[0].dim(), int(args[2]) % args[0].dim())
            return self._moved(tags[0], args[0], {a: b, b: a})
        if key in ("t",) or key is torch.t:
            return self._moved(tags[0], args[0], {0: 1, 1: 0})
        if key in ("expand", "expand_as"):
            return self._expanded(tags[0], args[0], value)
        if key in ("split", "chunk", "unbind", torch.split, torch.chunk, torch.unbind):
            return self._split(key, args, kwargs, tags, value)
        if key in (torch.cat, torch.stack):
            return self._joined(key, args, kwargs, tags)
        if key in PAIRWISE and len(args) > 1 and isinstance(args[1], torch.Tensor):  # torch.max(a, b): elementwise
            return self._pointwise(key, n, value, args, kwargs, tags, kwtags)
        if key in REDUCTIONS:
            return self._reduced(key, args, kwargs, tags, value)
        if key in POINTWISE_FUNCTIONS or key in POINTWISE_METHODS:
            return self._pointwise(key, n, value, args, kwargs, tags, kwtags)
        if key in FACTORIES:
            raise Refused(
                "it builds a tensor of the sequence's length in forward (a mask made there), which a slice "
                "would build for its own positions alone: register it as a buffer and narrow it to the length, "
                "or compare two aranges"
            )
        raise Refused("this check does not know how it reads positions" + _KNOWN_FORMS.get(getattr(key, "__name__", key), ""))

    def _only_first(self, tags: tuple[Any, ...], kwtags: dict[str, Any]) -> Positions:
        if not isinstance(tags[0], Positions) or tags_in((tags[1:], kwtags)):
            raise Refused("positions reach it other than through its first input")
        return unmasked(tags[0])

    # -- pointwise, softmax, matmul, attention --------------------------------------------
    def _aligned(self, value: torch.Tensor, operands: list[tuple[Any, Any]]) -> dict[int, str]:
        """The roles of `value`'s dims from its operands, aligned from the right as broadcasting
        does; an operand without positions must broadcast along theirs."""
        roles: dict[int, str] = {}
        rank = value.dim() if isinstance(value, torch.Tensor) else 0
        for operand, tag in operands:
            if isinstance(tag, (Length, Sizes)):
                raise Refused("it computes with the sequence's length as a number (it differs between slices)")
            if not isinstance(operand, torch.Tensor):
                continue
            shift = rank - operand.dim()
            for d, role in tag.dims if isinstance(tag, Positions) else ():
                at = d + shift
                have = roles.get(at)
                roles[at] = role if have is None else self.proof.unify(have, role) or conflict()
        for operand, tag in operands:
            if isinstance(operand, torch.Tensor) and not isinstance(tag, Positions):
                shift = rank - operand.dim()
                if any(d - shift >= 0 and operand.shape[d - shift] != 1 for d in roles):
                    raise Refused(
                        f"a tensor of shape {tuple(operand.shape)} that does not follow the sequence meets one that does along "
                        f"the sequence dim (dim {sorted(roles)[0]} of the result): a table sized by the example's length, or an "
                        "input that holds its positions on another dim than sequence_dim"
                    )
        return roles

    def _pointwise(self, key: Any, n: fx.Node, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any], tags: tuple[Any, ...], kwtags: dict[str, Any]) -> Positions:
        operands = [*zip(args, tags), *((value_, kwtags.get(name)) for name, value_ in kwargs.items())]
        if any(isinstance(o, (list, tuple, dict, slice)) for o, _ in operands):
            raise Refused("an elementwise op given a container")
        roles = self._aligned(value, operands)
        tag = Positions(tuple(sorted(roles.items())))
        scores = [d for d, r in roles.items() if self.proof.find(r) == Q], [d for d, r in roles.items() if self.proof.find(r) == K]
        if not (scores[0] and scores[1]):
            return tag
        return replace(tag, masked=self._mask_after(key, value, args, tags, operands, scores[0][0], scores[1][0]))

    def _mask_after(self, key: Any, value: Any, args: tuple[Any, ...], tags: tuple[Any, ...], operands: list[tuple[Any, Any]], q: int, k: int) -> str:
        """What scores hold where the key follows the query after this op; a mask found hiding
        the future has its sources noted (`_note_mask`)."""
        masked = self._masked_after(key, value, args, tags, operands, q, k)
        before = tags[0].masked if isinstance(tags[0], Positions) else ""
        kept = key in KEEPS_MASK or key in SCALES or (key in SHIFTS and before == MINUS_INF)  # (what is added does not matter)
        if masked and not kept:  # decided on a mask's values
            assert self.node is not None
            self._note_mask([a for a in _mask_side(key, self.node, args) if isinstance(a, fx.Node)])
        return masked

    def _note_mask(self, nodes: list[fx.Node]) -> None:
        """Note the tensors the model holds and the inputs that `nodes` (a mask) are computed
        from, by value: not through a size, a dtype or a device read from them, nor the shape
        of a tensor made like another (`torch.ones_like(scores)`)."""
        seen: set[fx.Node] = set()
        stack = list(nodes)
        while stack:
            node = stack.pop()
            if node in seen or _reads_no_values(node):
                continue
            seen.add(node)
            if node.op == "placeholder":
                self.proof.mask_inputs.add(node.name)
            elif node.op == "get_attr":  # a buffer, or a parameter (a mask kept as one, frozen)
                self.proof.mask_state.add(str(node.target))
            stack.extend(value_inputs(node))

    def _masked_after(self, key: Any, value: Any, args: tuple[Any, ...], tags: tuple[Any, ...], operands: list[tuple[Any, Any]], q: int, k: int) -> str:
        first = tags[0] if isinstance(tags[0], Positions) else None
        before = first.masked if first is not None else ""
        if key in ("masked_fill", torch.masked_fill):
            fill = _number(args[2])
            hides = future_all(args[1], value.shape, q, k)
            if hides and isinstance(fill, (int, float)):
                return ZERO if fill == 0 else _filled(fill, value.dtype) or before
            return before if hides else ""
        if key in ("where", torch.where) and isinstance(args[0], torch.Tensor) and args[0].dtype == torch.bool and len(args) > 2:
            # where(keep, scores, fill), or where(hide, fill, scores): the fill is the number
            kept, fill = (args[0], _number(args[2])) if isinstance(_number(args[2]), (int, float)) else (~args[0], _number(args[1]))
            hides = future_all(~kept, value.shape, q, k)
            if hides and isinstance(fill, (int, float)):
                return ZERO if fill == 0 else _filled(fill, value.dtype)
            return ""
        if key in KEEPS_MASK:
            return before
        if key in SCALES:
            others = [o for o, t in operands if t is not first]
            # 0 times anything is 0; 0 divided by something, but nothing divided by 0.
            multiplied = key in (operator.mul, torch.mul, "mul")
            zeros = operands if multiplied else operands[:1]
            if any(isinstance(t, Positions) and t.masked == ZERO for _, t in zeros):
                return ZERO
            # Scores times a mask that is 0 wherever the key follows the query (a tril buffer
            # narrowed to the length): linear attention, summed over keys with no softmax.
            if multiplied and any(isinstance(o, torch.Tensor) and future_all(o == 0, value.shape, q, k) for o in others):
                return ZERO
            return before if before == MINUS_INF and all(isinstance(o, (int, float)) and o > 0 for o in others) else ""
        if key in SHIFTS:
            if before == MINUS_INF:
                return MINUS_INF
            subtracted = key in (operator.sub, torch.sub, "sub")
            if first is None and subtracted:
                return ""  # scores subtracted from something: negated, not hidden
            # -inf, or a finite fill that no score outweighs (torch.finfo(dtype).min, -1e9): softmax gives it 0;
            # subtracted, a fill that large the other way (GPT-2's w * b - 1e4 * (1 - b))
            shifts = [-o if subtracted and isinstance(o, torch.Tensor) else o for o, t in operands if t is not first]
            biases = [o for o in shifts if isinstance(o, torch.Tensor) and o.is_floating_point()]
            if any(future_all(o <= _hidden_below(o.dtype), value.shape, q, k) for o in biases):
                return MINUS_INF
            weak = [o for o in biases if future_all(o <= _MEANT_TO_HIDE, value.shape, q, k)]
            if weak:
                _refuse_finite_mask(float(weak[0].min()), value.dtype)
        return ""

    def _softmax(self, tag: Any, x: torch.Tensor, dim: int) -> Positions:
        if not isinstance(tag, Positions):
            raise Refused("positions reach a softmax other than through its input")
        role = tag.role(int(dim) % x.dim())
        role = self.proof.find(role) if role is not None else None
        if role == Q:
            raise Refused("a softmax over the sequence's positions")
        if role == K:
            return replace(tag, masked=ZERO if tag.masked == MINUS_INF else "")
        if role is not None:
            raise Refused("a softmax over a table's positions")
        return unmasked(tag)

    def _matmul(self, n: fx.Node, args: tuple[Any, ...], tags: tuple[Any, ...]) -> Optional[Positions]:
        """a (..., m, c) @ b (..., c, p): scores where a's rows and b's columns are both positions
        (b's are carried); attention's output where a's columns are keys and b's rows the values
        (b carried); refused where positions are contracted otherwise."""
        a, b = args[0], args[1]
        if a.dim() < 2 or b.dim() < 2:
            raise Refused("a matrix product of a vector")
        ta, tb = (t if isinstance(t, Positions) else Positions(()) for t in tags[:2])
        rank = max(a.dim(), b.dim())
        roles: dict[int, str] = {}
        for t, x in ((ta, a), (tb, b)):  # the batch dims, aligned from the right
            for d, role in t.dims:
                if d < x.dim() - 2:
                    at = d + rank - x.dim()
                    roles[at] = role if at not in roles else self.proof.unify(roles[at], role) or conflict()
        rows, columns = ta.role(a.dim() - 2), tb.role(b.dim() - 1)
        inner_a, inner_b = ta.role(a.dim() - 1), tb.role(b.dim() - 2)
        if inner_a is None and inner_b is None:
            if rows is not None and columns is not None:
                if self.proof.unify(rows, Q) is None or self.proof.unify(columns, Q) is None:
                    raise Refused("a product of keys with keys")
                self._carry(n, 1, b.dim() - 1)
                roles[rank - 2], roles[rank - 1] = Q, K
                return Positions(tuple(sorted(roles.items())))
            if rows is not None:
                roles[rank - 2] = rows
            if columns is not None:
                roles[rank - 1] = columns
            return Positions(tuple(sorted(roles.items()))) if roles else None
        keys = inner_a is not None and self.proof.find(inner_a) == K and inner_b is not None and self.proof.unify(inner_b, Q) == Q
        if not keys:
            raise Refused("a matrix product sums over the sequence's positions")
        if ta.masked != ZERO:
            raise Refused("attention reads keys after the query: its scores are not masked causally (bidirectional attention)")
        self._carry(n, 1, b.dim() - 2)
        if rows is not None:
            roles[rank - 2] = rows
        if columns is not None:
            raise Refused("a product of attention with positions along its columns")
        return Positions(tuple(sorted(roles.items())))

    def _attention(self, n: fx.Node, args: tuple[Any, ...], kwargs: dict[str, Any], tags: tuple[Any, ...], kwtags: dict[str, Any]) -> Positions:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
        given = {**dict(zip(names, args)), **kwargs}
        tagged = {**dict(zip(names, tags)), **kwtags}
        mask = given.get("attn_mask")
        if not any(isinstance(tagged.get(name), Positions) and tagged[name].dims for name in ("key", "value", "attn_mask")):
            return self._cross_attention(given["query"], tagged.get("query"))
        if mask is not None:
            self._causal_mask(mask, tagged.get("attn_mask"), given["query"].dim())
        elif not given.get("is_causal", False):
            raise Refused("attention that is not causal (is_causal=False and no mask): bidirectional attention reads later positions")
        for name in ("query", "key", "value"):
            x, tag = given[name], tagged.get(name)
            if not isinstance(tag, Positions) or [d for d, _ in tag.dims] != [x.dim() - 2] or self.proof.unify(tag.dims[0][1], Q) is None:
                raise Refused(f"attention's {name} holds the positions on another dim than its rows")
        for position, name in ((1, "key"), (2, "value")):
            self._carry(n, position if len(args) > position else name, given[name].dim() - 2)
        self.proof.attention.append(n.name)
        return Positions(((given["query"].dim() - 2, Q),))

    def _cross_attention(self, query: torch.Tensor, tag: Any) -> Positions:
        """Attention whose keys and values hold no position of the sequence (an encoder's memory,
        another input): each query reads what every slice reads, position by position."""
        if not isinstance(tag, Positions) or [d for d, _ in tag.dims] != [query.dim() - 2] or self.proof.unify(tag.dims[0][1], Q) is None:
            raise Refused("attention's query holds the positions on another dim than its rows")
        return Positions(((query.dim() - 2, Q),))

    def _causal_mask(self, mask: Any, tag: Any, rank: int) -> None:
        """An attention mask whose last two dims are the queries' and the keys' positions (its
        tables take those roles), hiding every key after its query on the example: False where
        boolean, -inf where added."""
        if not isinstance(mask, torch.Tensor) or not isinstance(tag, Positions):
            raise Refused("attention's mask does not follow the sequence (a mask made without the length, or no tensor)")
        shift = rank - mask.dim()
        for d, role in tag.dims:
            at = d + shift
            wanted = Q if at == rank - 2 else K if at == rank - 1 else None
            if wanted is None:
                raise Refused("attention's mask holds positions on other dims than its last two (queries, keys)")
            if self.proof.unify(role, wanted) is None:
                raise Refused(
                    "attention's mask reads the slice's own positions along its key dim (a key-padding mask made from "
                    "the inputs, say), where a slice's keys are those of every slice up to it"
                )
        hidden = ~mask if mask.dtype == torch.bool else mask <= _hidden_below(mask.dtype)  # -inf, or a fill no score outweighs (finfo.min)
        if mask.dim() < 2 or not future_all(hidden, hidden.shape, hidden.dim() - 2, hidden.dim() - 1):
            raise Refused("attention's mask lets a query read keys after it (a mask that is not causal): bidirectional attention")
        assert self.node is not None
        given = self.node.kwargs.get("attn_mask", self.node.args[3] if len(self.node.args) > 3 else None)
        self._note_mask([given] if isinstance(given, fx.Node) else [])

    def _carry(self, n: fx.Node, argument: Any, dim: int) -> None:
        """`n` reads its `argument` (a position or a keyword) as keys: the slices before
        carry theirs to it, along `dim`."""
        source = n.args[argument] if isinstance(argument, int) else n.kwargs[argument]
        assert isinstance(source, fx.Node)
        self.proof.carries.setdefault((source.name, dim), []).append((n.name, argument))



# Ops the proof does not know, each with a form it knows that computes the same.
_KNOWN_FORMS = {
    "repeat_interleave": " (repeat heads as x[:, :, None].expand(b, h, n, t, d).reshape(b, h * n, t, d))",
    "repeat": " (repeat heads as x[:, :, None].expand(b, h, n, t, d).reshape(b, h * n, t, d))",
    "outer": " (write it as a broadcast product: positions[:, None] * frequencies[None, :])",
    "einsum": " (write it with matmul, or as a broadcast product: positions[:, None] * frequencies[None, :])",
}

# A key hidden by a finite number has a softmax weight of exactly 0 (exp underflows) only while no
# score is that far above another. -1e9 and torch.finfo(dtype).min are far beyond any score a
# model makes; GPT-2's and BERT's -1e4 is not (attention logits grow to tens of thousands in long
# training): a key it hides would then get weight in the plain model, and no slice can see it.
_HIDDEN = -1e9
_MEANT_TO_HIDE = -1e3  # a fill this low is a mask, where it is too weak to be one, said so


def _hidden_below(dtype: torch.dtype) -> float:
    """The highest finite fill that hides a key: -1e9, or the dtype's lowest (float16's -65504)."""
    return max(_HIDDEN, torch.finfo(dtype).min) if dtype.is_floating_point else _HIDDEN


def _filled(fill: float, dtype: torch.dtype) -> str:
    """What a fill of the future keys makes of the scores: hidden where no score outweighs it;
    refused where it is a mask too weak to be one; else nothing."""
    if fill <= _hidden_below(dtype):
        return MINUS_INF
    if fill <= _MEANT_TO_HIDE:
        _refuse_finite_mask(fill, dtype)
    return ""


def _refuse_finite_mask(fill: float, dtype: torch.dtype) -> None:
    raise Refused(
        f"attention's mask hides later keys with {fill:g}, a finite number that a score {-fill:g} above another "
        "outweighs: the plain model then gives those keys weight (it reads the future), where a slice cannot see "
        f"them. Mask with float('-inf') or torch.finfo(scores.dtype).min ({torch.finfo(dtype).min:g}) instead "
        "(GPT-2's w * b - 1e4 * (1 - b): w.masked_fill(b == 0, torch.finfo(w.dtype).min))"
    )


def _mask_side(key: Any, node: fx.Node, args: tuple[Any, ...]) -> list[Any]:
    """The arguments of a masking op that are not the scores: masked_fill's mask and fill,
    where's condition and fill (the number, the second or third), an added mask."""
    if key in ("where", torch.where) and len(node.args) > 2:
        return [node.args[0], node.args[2] if isinstance(_number(args[2]), (int, float)) else node.args[1]]
    return [*node.args[1:], *node.kwargs.values()]


_SHAPE_READS = {"size", "dim", "numel", "shape", "dtype", "device", "ndim"}


def _reads_no_values(node: fx.Node) -> bool:
    """A read of a tensor's size, rank, dtype or device (`x.size(1)`, `x.shape`)."""
    if node.op == "call_method":
        return node.target in _SHAPE_READS
    if node.op != "call_function":
        return False
    if node.target is getattr:
        return len(node.args) > 1 and node.args[1] in _SHAPE_READS
    return node.target in (torch.Tensor.size, torch.Tensor.dim, torch.numel, torch.ops.aten.sym_size.int)


def _number(value: Any) -> Any:
    """A fill given as a tensor of one element (a buffer holding -1e9), as the number it holds."""
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value


def prove_causal(gm: fx.GraphModule, inputs: Sequence[Any], sequence_dim: int = 1) -> Proof:
    """Run `gm` on `inputs` and prove each output's position i computed from positions <= i
    alone (module docstring); raises CausalityError naming every op that reads otherwise.

    The sequence is the inputs' longest dim `sequence_dim`, or, where that is no sequence (a
    conditioning vector wider than the sequence is long), the next longest that proves causal;
    the error is the longest's."""
    sizes = {t.shape[sequence_dim] for t in tree_flatten(list(inputs))[0] if isinstance(t, torch.Tensor) and t.dim() > sequence_dim}
    if not sizes:
        raise CausalityError([f"no input has a dim {sequence_dim} to cut into slices (sequence_dim={sequence_dim})"])
    longest: Optional[CausalityError] = None
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    for length in sorted(sizes, reverse=True):
        holders = [name for name, t in zip(placeholders, inputs) if isinstance(t, torch.Tensor) and t.dim() > sequence_dim and t.shape[sequence_dim] == length]
        # Every input of the length holds the sequence; else all but one (an encoder's memory as
        # long as the sequence is no sequence to a decoder's cross-attention, beside the tokens and
        # their position ids); else one alone: the first that proves.
        but_one = [set(holders) - {name} for name in holders] if len(holders) > 2 else []
        for holding in [None, *but_one, *([{name} for name in holders] if len(holders) > 1 else [])]:
            try:
                return prove_causal_at(gm, inputs, sequence_dim, length, holding=holding)
            except CausalityError as error:
                longest = longest or error
    assert longest is not None
    raise longest


def prove_causal_at(
    gm: fx.GraphModule, inputs: Sequence[Any], sequence_dim: int, length: int, holding: Optional[Collection[str]] = None,
) -> Proof:
    """`prove_causal` with the sequence's length given: the inputs of that length along
    `sequence_dim` hold it (of those `holding` names, where given: a proof made before knows)."""
    prover = _Prover(gm, sequence_dim, length, holding)
    with torch.no_grad(), preserved(gm):
        out = prover.run(*inputs)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    leaves, _ = tree_flatten(output.args[0])
    values, _ = tree_flatten(out)
    proof = prover.proof
    for leaf, value in zip(leaves, values):
        tag = proof.tags.get(leaf.name) if isinstance(leaf, fx.Node) else None
        if tag is BROKEN:
            continue
        qs = [d for d, role in tag.dims if proof.role_of(role) == Q] if isinstance(tag, Positions) else []
        if isinstance(value, torch.Tensor) and len(qs) != 1:
            prover.problems.append(f"the output {getattr(leaf, 'name', leaf)} does not hold the sequence along one dim: slices' outputs could not be joined")
        proof.outputs.append(qs[0] if qs else None)
    if not proof.inputs:
        prover.problems.append(f"no input holds the sequence along dim {sequence_dim} at length {length}")
    if prover.problems:
        losses = _reduced_outputs_alone(prover.at_fault, leaves, values)
        raise CausalityError(prover.problems, *([_LOSS_FIX.format(", ".join(losses))] if losses else []))
    return proof


_LOSS_FIX = (
    "the ops above compute only what the model returns as one number for the whole sequence ({}: a loss "
    "computed in forward, which no slice can compute alone). Return the values per position (call the model "
    "without its labels) and give the loss as train_step(..., loss_fn=...), which the pipeline combines over "
    "slices; or sequence_chunks=1."
)


def _reduced_outputs_alone(at_fault: Sequence[fx.Node], leaves: Sequence[Any], values: Sequence[Any]) -> list[str]:
    """The outputs that are one number (0-dim: a loss computed in forward), where the ops at
    fault reach those outputs alone; else []."""
    reduced = {leaf for leaf, value in zip(leaves, values) if isinstance(leaf, fx.Node) and isinstance(value, torch.Tensor) and value.dim() == 0}
    others = {leaf for leaf in leaves if isinstance(leaf, fx.Node)} - reduced
    if not reduced or not at_fault:
        return []
    reached: set[fx.Node] = set()
    frontier = list(at_fault)
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user not in reached:
                reached.add(user)
                frontier.append(user)
    reached |= set(at_fault)
    return [leaf.name for leaf in reduced if leaf in reached] if not reached & others else []
