"""The causality proof's vocabulary (passes/causal.py): position tags, what the proof found, the op families its rules know."""
from __future__ import annotations

import operator
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fxpipe.core.attrs import fetch_attr
from fxpipe.passes.validate import source_line

Q, K = "q", "k"
MINUS_INF, ZERO = "-inf", "0"  # what scores hold where the key follows the query


@dataclass(frozen=True)
class Positions:
    """A tensor whose dims in `dims` index positions, each with its role; `masked`: for scores
    (a Q dim and a K dim), what they hold where the key follows the query ('' where unknown)."""

    dims: tuple[tuple[int, str], ...]
    masked: str = ""

    def role(self, dim: int) -> Optional[str]:
        return dict(self.dims).get(dim)


@dataclass(frozen=True)
class Length:
    """The sequence's length as a number (`x.size(1)`, `x.shape[1]`)."""

    role: str = Q


@dataclass(frozen=True)
class Sizes:
    """A tensor's size (`x.size()`, `x.shape`): the entries at `dims` are lengths."""

    dims: tuple[tuple[int, str], ...]


@dataclass
class Proof:
    """What the proof found: each node's tag (by name); the keys and values to carry, by the
    node that makes them and the dim, with the nodes that read them as keys and the argument
    (a position or a keyword); the tables to offset, by node, each dim the node cuts by the
    length (of its output) with its role variable; and the roles the variables took."""

    tags: dict[str, Any] = field(default_factory=dict)
    carries: dict[tuple[str, int], list[tuple[str, Any]]] = field(default_factory=dict)
    tables: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)
    attention: list[str] = field(default_factory=list)  # scaled_dot_product_attention nodes, made causal by a mask
    inputs: dict[str, int] = field(default_factory=dict)  # placeholder name -> its sequence dim
    outputs: list[Optional[int]] = field(default_factory=list)  # each output leaf's sequence dim
    # What the masks the proof found hiding the future were computed from, by value: tensors the
    # model holds (get_attr targets), and inputs (placeholder names). A call proves them again
    # where one changed, or where the masks read an input's values (a prefix length).
    mask_state: set[str] = field(default_factory=set)
    mask_inputs: set[str] = field(default_factory=set)
    fresh: int = 0  # role variables made so far

    def role_of(self, variable: str) -> str:
        """A role variable's role: Q unless a use made it K."""
        role = self.find(variable)
        return role if role in (Q, K) else Q

    def new_variable(self) -> str:
        """A role variable no value holds yet ('?n')."""
        self.fresh += 1
        return f"?{self.fresh}"

    def find(self, role: str) -> str:
        """What `role` is bound to: a role, or a variable bound to nothing yet."""
        while role in self.roles:
            role = self.roles[role]
        return role

    def unify(self, a: str, b: str) -> Optional[str]:
        """The role both are, binding a variable to the other; None where they differ."""
        a, b = self.find(a), self.find(b)
        if a == b:
            return a
        if a.startswith("?"):
            self.roles[a] = b
            return b
        if b.startswith("?"):
            self.roles[b] = a
            return a
        return None


class CausalityError(ValueError):
    """The model cannot run in slices of its sequence; `problems` name each op and its line."""

    FIX = (
        "causal attention (scaled_dot_product_attention(..., is_causal=True), or scores masked with a tril buffer "
        "narrowed to the length), position-wise layers elsewhere; or sequence_chunks=1."
    )

    def __init__(self, problems: Sequence[str], fix: str = FIX, taken: str = "") -> None:
        """`taken`: where the check took the sequence to be, said after the problems."""
        self.problems, self.fix, self.taken = list(problems), fix, taken
        super().__init__(
            "the model cannot run in slices of its sequence: a slice must compute from its own positions and "
            "the earlier ones, and these ops read otherwise (or are not known to this check):\n"
            + "\n".join(f"  - {p}" for p in self.problems)
            + (f"\n{taken}" if taken else "")
            + f"\nHow to fix: {fix}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.problems, self.fix), {k: v for k, v in self.__dict__.items() if k not in ("problems", "fix")}


# Ops that compute each element from the elements at the same index of their inputs.
POINTWISE_FUNCTIONS: set[Any] = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.neg, operator.pow,
    operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge, operator.and_, operator.or_,
    operator.invert, torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.pow, torch.exp, torch.log,
    torch.tanh, torch.sigmoid, torch.sqrt, torch.rsqrt, torch.abs, torch.cos, torch.sin, torch.where, torch.eq,
    torch.ne, torch.lt, torch.le, torch.gt, torch.ge, torch.clamp, torch.maximum, torch.minimum, torch.erf,
    torch.masked_fill, torch.reciprocal, torch.square, torch.logical_not, torch.relu, F.gelu, F.relu, F.silu,
    F.tanh, F.sigmoid, F.dropout, F.softplus, F.mish, F.leaky_relu, F.elu, F.hardswish,
}  # fmt: skip
POINTWISE_METHODS = {
    "add", "sub", "mul", "div", "neg", "pow", "exp", "log", "tanh", "sigmoid", "sqrt", "rsqrt", "abs", "cos", "sin",
    "float", "double", "half", "bfloat16", "to", "type", "type_as", "contiguous", "clone", "detach", "masked_fill",
    "eq", "ne", "lt", "le", "gt", "ge", "clamp", "relu", "bool", "long", "int", "logical_not", "reciprocal", "square",
    "erf", "__and__", "__or__", "where",
}  # fmt: skip
POINTWISE_MODULES = (
    nn.Dropout, nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Identity, nn.LeakyReLU, nn.ELU, nn.Mish,
    nn.Softplus, nn.Hardswish, nn.ReLU6,
)  # fmt: skip
# What keeps the mask of scores as it is: a copy, another dtype, a dropout (0 stays 0).
KEEPS_MASK = {"float", "double", "half", "bfloat16", "to", "type", "type_as", "contiguous", "clone", "detach", F.dropout}
SCALES = {operator.mul, operator.truediv, torch.mul, torch.div, "mul", "div"}
SHIFTS = {operator.add, operator.sub, torch.add, torch.sub, "add", "sub"}
RESHAPES = {"view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "view_as", "reshape_as",
             torch.reshape, torch.flatten, torch.unflatten, torch.unsqueeze, torch.squeeze}  # fmt: skip
REDUCTIONS = {
    "sum", "mean", "max", "amax", "min", "amin", "prod", "std", "var", "norm", "logsumexp", "all", "any", "argmax",
    "argmin", "cumsum", "cumprod", torch.sum, torch.mean, torch.max, torch.amax, torch.min, torch.amin, torch.prod,
    torch.std, torch.var, torch.norm, torch.logsumexp, torch.all, torch.any, torch.argmax, torch.argmin,
    torch.cumsum, torch.cumprod,
}  # fmt: skip
CUMULATIVE = {"cumsum", "cumprod", torch.cumsum, torch.cumprod}
PAIRWISE = {"max", "min", torch.max, torch.min}  # with a tensor second: elementwise, as torch.maximum
# Reductions whose arguments are not (dim, keepdim): norm's are (p, dim, keepdim), std's and
# var's (dim, unbiased, keepdim), or (unbiased) alone, a bool: a reduction over every dim.
P_FIRST = {"norm", torch.norm}
STD_LIKE = {"std", "var", torch.std, torch.var}
SOFTMAXES = {F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, "softmax", "log_softmax"}
MATMULS = {operator.matmul, torch.matmul, torch.bmm, "matmul", "bmm"}
FACTORIES = {torch.ones, torch.zeros, torch.full, torch.empty, torch.rand, torch.randn, torch.eye, torch.tril, torch.triu}
NORMS = {F.layer_norm, F.rms_norm} if hasattr(F, "rms_norm") else {F.layer_norm}


def key_of(node: fx.Node) -> Any:
    return node.target if node.op == "call_function" else str(node.target)


def op_and_line(gm: fx.GraphModule, node: fx.Node) -> str:
    """The op, the module it runs in, and the model's line that made it."""
    stack = node.meta.get("nn_module_stack") or {}
    module = next(reversed(stack.values()))[0] if stack else (str(node.target) if node.op == "call_module" else "")
    op = getattr(node.target, "__name__", str(node.target)) if node.op != "call_module" else type(fetch_attr(gm, str(node.target))).__name__
    line = source_line(node)
    return f"{op} ({node.name}{', in ' + module if module else ''}{', ' + line if line != 'an unknown line' else ''})"



class Refused(Exception):
    """Why one op cannot run in slices."""


BROKEN = "refused"  # the tag of a value an op refused made, and of what is made from it


def positions_of(tag: Any) -> Positions:
    """`tag`, for an op that keeps the positions of its first input where it has any."""
    if not isinstance(tag, Positions):
        raise Refused("it shapes a value by the sequence's length (a tensor made of that many elements)")
    return tag


def tags_in(structure: Any) -> list[Any]:
    """The tags in a structure of arguments' tags (tuples, lists, dicts, slices)."""
    if isinstance(structure, (tuple, list)):
        return [t for item in structure for t in tags_in(item)]
    if isinstance(structure, dict):
        return tags_in(list(structure.values()))
    if isinstance(structure, slice):
        return tags_in([structure.start, structure.stop, structure.step])
    return [] if structure is None else [structure]


def conflict() -> str:
    raise Refused(
        "one value stands for both the slice's own positions and the keys' (an arange compared with itself "
        "transposed: make one for each, torch.arange(T)[:, None] >= torch.arange(T)[None, :]; or a mask made "
        "from the inputs, such as a key-padding mask, applied along the keys, where a slice's keys are those of "
        "every slice up to it)"
    )


def unmasked(tag: Positions) -> Positions:
    return replace(tag, masked="") if tag.masked else tag


def future_all(condition: Any, shape: torch.Size, q: int, k: int) -> bool:
    """Whether `condition` (broadcast to `shape`) holds wherever the key (dim `k`) follows the
    query (dim `q`), on the example's positions."""
    if not isinstance(condition, torch.Tensor) or condition.dtype != torch.bool:
        return False
    full = condition.expand(shape).movedim((q, k), (-2, -1))
    later = torch.ones(full.shape[-2], full.shape[-1], dtype=torch.bool, device=full.device).triu(1)
    return bool(full[..., later].all())
