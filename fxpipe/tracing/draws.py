"""Random draws a trace makes outside its graph, whose values the graph would hold for every call.

torch.fx runs what takes no traced value as plain Python, once, while tracing:

    if self.training and torch.rand([]) < self.layerdrop:   # a layer drop decided in Python
        continue                                             # the graph keeps the trace's choice
    x = x + torch.randn(8)                                   # the graph keeps the trace's noise

A trace that drew (a generator's state moved) is traced again twice, with every draw at its
lowest, then at its highest value: a choice or a constant that follows the draw makes the two
graphs differ. A draw that decides nothing (Hugging Face's BART draws for a layer drop of 0)
gives the same graph, and is fine. A draw from numpy's generator not set to its extremes
(`choice`, `permutation`, ...) cannot be told apart, and counts as deciding.
"""
from __future__ import annotations

import contextlib
import random
import sys
import threading
from typing import Any, Callable, Iterator, Optional, TypeVar, cast

import torch
import torch.fx as fx

_TORCH_DRAWS = ("rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "bernoulli", "normal", "randperm", "multinomial")
_TENSOR_DRAWS = ("uniform_", "normal_", "bernoulli_", "exponential_")  # in place, on a tensor made in forward
# Python's: the primitives every other draw of `random.Random` goes through (`randrange`,
# `choice`, `shuffle`, `sample` through `_randbelow`; `uniform`, `choices` through `random`),
# and those whose extremes are not their primitives' (a normal's).
_PYTHON_DRAWS = ("random", "getrandbits", "_randbelow", "gauss", "normalvariate")
_NUMPY_DRAWS = ("random", "rand", "random_sample", "ranf", "sample", "uniform", "randn", "standard_normal", "normal", "randint")
_FAR = 1e6  # a normal draw at its "extremes"
_MOST_DRAWS = 100_000  # in one trace: more is a loop that a draw at an extreme never leaves
T = TypeVar("T")


def generator_states() -> list[Any]:
    """The states of torch's CPU (and CUDA) generators, Python's and numpy's."""
    states: list[Any] = [torch.get_rng_state(), random.getstate()]
    if torch.cuda.is_initialized():
        states += torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        name, keys, position, has_gauss, gauss = numpy.random.get_state()
        states.append((name, keys.tobytes(), position, has_gauss, gauss))  # a draw may move `position` alone
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
        "what it computes depends on them, or fxpipe cannot tell that it does not (a layer drop decided in Python, "
        "`if torch.rand([]) < p:`; a noise of a fixed size, torch.randn(8); a draw numpy's `choice` makes): the "
        "graph would hold the trace's draws for every call.\nHow to fix: draw "
        "with operations on the traced values (torch.rand_like(x), torch.where), turn the draw off (layerdrop=0), "
        "or keep the module that draws whole (leaf_modules=[...])."
    )


def decided_by_draws(make: Callable[[], fx.GraphModule]) -> bool:
    """Whether `make()` (a trace) makes another graph with every draw at its lowest value than at
    its highest: its draws decide its code or its constants. A trace that draws from numpy's
    generator in a way not set to its extremes (`choice`, `permutation`, ...) cannot be told
    apart, and counts as decided. (Which draws it made is known per thread: another thread that
    draws meanwhile, training another model, say, decides nothing here.)"""
    graphs = []
    for high in (False, True):
        with _draws_at(high) as unknown:
            try:
                graphs.append(make())
            except Exception:  # noqa: BLE001 - a draw at an extreme the forward cannot take: it decides
                return True
            if unknown:
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
def _draws_at(high: bool) -> Iterator[list[str]]:
    """torch's, Python's and numpy's random draws on this thread give their lowest (or highest)
    values, and move no generator. Yields the draws of numpy's generator made on this thread
    that are not set to their extremes (filled in as they are made)."""
    count, thread, unknown = [0], threading.get_ident(), cast(list[str], [])
    # Each draw, with what gives its extreme: None for numpy's draws that this does not set.
    saved: list[tuple[Any, str, Callable[..., Any], Optional[Callable[..., Any]]]] = [
        (torch, name, getattr(torch, name), _torch_extreme) for name in _TORCH_DRAWS
    ]
    saved += [(torch.Tensor, name, getattr(torch.Tensor, name), _torch_extreme) for name in _TENSOR_DRAWS]
    saved += [
        (owner, name, getattr(owner, name), _python_extreme) for owner in (random, random.Random) for name in _PYTHON_DRAWS if hasattr(owner, name)
    ]  # fmt: skip
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        saved += [
            (numpy.random, name, getattr(numpy.random, name), _numpy_extreme if name in _NUMPY_DRAWS else None) for name in _numpy_draws(numpy)
        ]  # fmt: skip
    own = [name in vars(owner) for owner, name, _, _ in saved]  # else inherited (Tensor's from TensorBase)
    try:
        for owner, name, draw, at in saved:
            setattr(owner, name, _extreme(owner, name, draw, at, high, count, thread, unknown))
        yield unknown
    finally:
        for (owner, name, draw, _), its_own in zip(saved, own):
            if its_own:
                setattr(owner, name, draw)
            else:
                delattr(owner, name)


def _numpy_draws(numpy: Any) -> list[str]:
    """The draws of numpy's global generator, by their names in `numpy.random`."""
    generator = numpy.random.mtrand._rand
    return [
        name for name in dir(numpy.random)
        if getattr(getattr(numpy.random, name), "__self__", None) is generator and name not in ("get_state", "set_state", "seed")
    ]  # fmt: skip


def _extreme(
    owner: Any, name: str, draw: Callable[..., Any], at: Optional[Callable[..., Any]], high: bool, count: list[int], thread: int,
    unknown: list[str],
) -> Callable[..., Any]:  # fmt: skip
    """`draw` on this thread giving its extreme by `at`; with no `at`, noted in `unknown`."""

    def extreme(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != thread:  # another thread's draw (another pipeline's stage, say)
            return draw(*args, **kwargs)
        if at is None:
            unknown.append(f"numpy.random.{name}")
            with _unmoved():
                return draw(*args, **kwargs)
        count[0] += 1
        if count[0] > _MOST_DRAWS:
            raise RuntimeError(f"more than {_MOST_DRAWS} random draws in one trace, with every draw at an extreme")
        if at is _python_extreme:  # Python's primitives: no draw (a method's `self` first)
            return at(name, args[1:] if owner is random.Random else args, kwargs, high)
        with _unmoved():  # the draw's value gives its shape and type; the extreme replaces it
            value = draw(*args, **kwargs)
        return at(name, args, kwargs, high, value)

    return extreme


@contextlib.contextmanager
def _unmoved() -> Iterator[None]:
    """The generators as they were, after the block."""
    states = [torch.get_rng_state(), *(torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [])]
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        if len(states) > 1:
            torch.cuda.set_rng_state_all(states[1:])
        if numpy is not None:
            numpy.random.set_state(numpy_state)


def _torch_extreme(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], high: bool, value: Any) -> Any:
    # Only a tensor of this process: a traced one (a Proxy, export's fake tensors) draws in the graph.
    if type(value) is not torch.Tensor:
        return value
    values = value.detach()  # (no grad-mode switch: the tracer would take it for the model's)
    if name.startswith("randint"):
        values.fill_(_randint_bound(args, kwargs, high))
    elif name == "randperm":
        order = torch.arange(values.numel(), device=values.device)
        values.copy_(order.flip(0) if high else order)
    elif name == "multinomial":
        values.copy_(_category_at_end(args[0] if args else kwargs["input"], high).unsqueeze(-1).expand_as(values))
    elif name == "uniform_":
        low, top = (list(args[1:]) + [kwargs.get("from", 0.0), kwargs.get("to", 1.0)][len(args) - 1 :])[:2]
        values.fill_(top if high else low)
    elif name in ("randn", "randn_like", "normal", "normal_", "exponential_"):
        values.fill_(_FAR if high else (0.0 if name == "exponential_" else -_FAR))
    else:  # rand, rand_like, bernoulli, bernoulli_
        values.fill_(1.0 - torch.finfo(value.dtype).eps if high and value.is_floating_point() and name.startswith("rand") else float(high))
    return value


def _category_at_end(probabilities: torch.Tensor, high: bool) -> torch.Tensor:
    """Per row, the first (or last) category that may be drawn."""
    possible = (probabilities > 0).to(torch.int8)
    if high:
        return probabilities.shape[-1] - 1 - possible.flip(-1).argmax(-1)
    return possible.argmax(-1)


def _randint_bound(args: tuple[Any, ...], kwargs: dict[str, Any], high: bool) -> int:
    """randint(high, size) or randint(low, high, size), and randint_like(t, high) or (t, low, high):
    the lowest or highest value it may give."""
    numbers = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
    top = kwargs.get("high", numbers[-1] if numbers else 1)
    bottom = kwargs.get("low", numbers[0] if len(numbers) > 1 else 0)
    return int(top) - 1 if high else int(bottom)


def _python_extreme(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], high: bool) -> Any:
    if name == "random":
        return 1.0 - sys.float_info.epsilon if high else 0.0
    if name == "getrandbits":
        return (1 << int(args[0] if args else kwargs["k"])) - 1 if high else 0
    if name == "_randbelow":
        return int(args[0]) - 1 if high else 0
    mu, sigma = (list(args) + [kwargs.get("mu", 0.0), kwargs.get("sigma", 1.0)][len(args) :])[:2]  # gauss, normalvariate
    return mu + sigma * (_FAR if high else -_FAR)


def _numpy_extreme(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], high: bool, value: Any) -> Any:
    numpy = sys.modules["numpy"]
    if name == "uniform":
        low, top = (list(args) + [kwargs.get("low", 0.0), kwargs.get("high", 1.0)][len(args) :])[:2]
        at = top if high else low
    elif name == "randint":
        low, top = (list(args) + [kwargs.get("low"), kwargs.get("high")][len(args) :])[:2]
        low, top = (0, low) if top is None else (low, top)
        at = numpy.asarray(top) - 1 if high else low
    elif name in ("randn", "standard_normal", "normal"):
        loc, scale = ((list(args) + [kwargs.get("loc", 0.0), kwargs.get("scale", 1.0)][len(args) :])[:2]) if name == "normal" else (0.0, 1.0)
        at = numpy.asarray(loc) + numpy.asarray(scale) * (_FAR if high else -_FAR)
    else:  # random, rand, random_sample, ranf, sample: [0, 1)
        at = 1.0 - sys.float_info.epsilon if high else 0.0
    if isinstance(value, numpy.ndarray):
        return numpy.broadcast_to(numpy.asarray(at, dtype=value.dtype), value.shape).copy()
    return type(value)(at)
