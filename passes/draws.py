"""Random draws a trace makes outside its graph, whose values the graph would hold for every call.

torch.fx runs what takes no traced value as plain Python, once, while tracing:

    if self.training and torch.rand([]) < self.layerdrop:   # a layer drop decided in Python
        continue                                             # the graph keeps the trace's choice
    x = x + torch.randn(8)                                   # the graph keeps the trace's noise

A trace that drew (a generator's state moved) is traced again twice, with every draw at its
lowest, then at its highest value: a choice or a constant that follows the draw makes the two
graphs differ. A draw that decides nothing (Hugging Face's BART draws for a layer drop of 0)
gives the same graph, and is fine.
"""
from __future__ import annotations

import contextlib
import random
import sys
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.fx as fx

_TORCH_DRAWS = ("rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "bernoulli", "normal")
_PYTHON_DRAWS = ("random", "uniform", "randint", "randrange", "gauss", "normalvariate")
_FAR = 1e6  # a normal draw at its "extremes"
T = TypeVar("T")


def generator_states() -> list[Any]:
    """The states of torch's CPU (and CUDA) generators, Python's and numpy's."""
    states: list[Any] = [torch.get_rng_state(), random.getstate()]
    if torch.cuda.is_initialized():
        states += torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        states.append(numpy.random.get_state()[1].tobytes())
    return states


def moved(before: list[Any], after: list[Any]) -> bool:
    return len(before) != len(after) or any(
        not torch.equal(a, b) if isinstance(a, torch.Tensor) else a != b for a, b in zip(before, after)
    )


def traced_checking_draws(make: Callable[[], T], graph_of: Callable[[T], fx.GraphModule]) -> tuple[T, bool]:
    """`make()` (a trace), and whether its draws decide the graph it made."""
    before = generator_states()
    made = make()
    if not moved(before, generator_states()):
        return made, False
    return made, decided_by_draws(lambda: graph_of(make()))


def drawn_message(name: str, front_end: str) -> str:
    return (
        f"{front_end} cannot trace {name}: its forward draws random numbers while traced, outside the graph, and "
        "what it computes depends on them (a layer drop decided in Python, `if torch.rand([]) < p:`; a noise of a "
        "fixed size, torch.randn(8)): the graph would hold the trace's draws for every call.\nHow to fix: draw "
        "with operations on the traced values (torch.rand_like(x), torch.where), turn the draw off (layerdrop=0), "
        "or keep the module that draws whole (leaf_modules=[...])."
    )


def decided_by_draws(make: Callable[[], fx.GraphModule]) -> bool:
    """Whether `make()` (a trace) makes another graph with every draw at its lowest value than at
    its highest: its draws decide its code or its constants."""
    graphs = []
    for high in (False, True):
        with _draws_at(high):
            try:
                graphs.append(make())
            except Exception:  # noqa: BLE001 - a draw at an extreme the forward cannot take: it decides
                return True
    low, high_ = graphs
    return low.code != high_.code or not _same_constants(low, high_)


def _same_constants(a: fx.GraphModule, b: fx.GraphModule) -> bool:
    names = [n.target for n in a.graph.nodes if n.op == "get_attr" and str(n.target).startswith("_tensor_constant")]
    for name in names:
        x, y = getattr(a, str(name), None), getattr(b, str(name), None)
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape and torch.equal(x, y)):
            return False
    return True


@contextlib.contextmanager
def _draws_at(high: bool) -> Iterator[None]:
    """torch's and Python's random draws give their lowest (or highest) values; a draw still
    moves its generator, which the caller puts back."""
    saved = [(torch, name, getattr(torch, name)) for name in _TORCH_DRAWS]
    saved += [(random, name, getattr(random, name)) for name in _PYTHON_DRAWS]
    try:
        for owner, name, draw in saved:
            setattr(owner, name, _extreme(owner, name, draw, high))
        yield
    finally:
        for owner, name, draw in saved:
            setattr(owner, name, draw)


def _extreme(owner: Any, name: str, draw: Callable[..., Any], high: bool) -> Callable[..., Any]:
    def extreme(*args: Any, **kwargs: Any) -> Any:
        value = draw(*args, **kwargs)
        if owner is random:
            return _python_extreme(name, args, kwargs, high, value)
        if not isinstance(value, torch.Tensor) or isinstance(value, fx.Proxy):
            return value
        values = value.detach()  # (no grad-mode switch: the tracer would take it for the model's)
        if name.startswith("randint"):
            values.fill_(_randint_bound(args, kwargs, high))
        elif name in ("randn", "randn_like", "normal"):
            values.fill_(_FAR if high else -_FAR)
        else:
            values.fill_(1.0 - torch.finfo(value.dtype).eps if high and value.is_floating_point() else float(high))
        return value

    return extreme


def _randint_bound(args: tuple[Any, ...], kwargs: dict[str, Any], high: bool) -> int:
    """randint(high, size) or randint(low, high, size), and randint_like(t, high) or (t, low, high):
    the lowest or highest value it may give."""
    numbers = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
    top = kwargs.get("high", numbers[-1] if numbers else 1)
    bottom = kwargs.get("low", numbers[0] if len(numbers) > 1 else 0)
    return int(top) - 1 if high else int(bottom)


def _python_extreme(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], high: bool, value: Any) -> Any:
    if name == "random":
        return 1.0 - sys.float_info.epsilon if high else 0.0
    if name in ("uniform", "randint") and len(args) >= 2:
        return args[1] if high else args[0]
    if name in ("gauss", "normalvariate"):
        return _FAR if high else -_FAR
    return value
