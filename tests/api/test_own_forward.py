"""A model whose forward, replaced since compiling, calls its own pipeline: `model(x)` and `model.generate()` run on it as the plain model runs."""
from __future__ import annotations

import copy
import functools
import warnings
from typing import Any, Optional

import pytest
import torch
from torch import nn

from fxpipe import compile_pipeline
from helpers import assert_grads_equal, twin

X = torch.randn(8, 6, dtype=torch.float64)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = self.c(torch.tanh(self.b(h)) + h)
        return h if scale is None else h * scale


def _replaced(model: nn.Module, pipe: Any, how: str) -> None:
    """The model's forward replaced by one that calls the pipeline, as a caller would do it."""
    if how == "instance forward":  # (wraps: the forward's signature, which Hugging Face reads to give it position_ids)
        model.forward = functools.wraps(model.forward)(lambda *args, **kwargs: pipe(*args, **kwargs))  # type: ignore[method-assign]
    else:

        class Piped(type(model)):  # type: ignore[misc]
            def forward(self, *args: Any, **kwargs: Any) -> Any:
                return pipe(*args, **kwargs)

        model.__class__ = Piped


@pytest.mark.parametrize("how", ["instance forward", "class swapped"])
@pytest.mark.parametrize("mode", ["train", "eval", "no_grad", "autograd.grad", "two forwards, one backward", "after an error"])
def test_the_model_called_runs_the_pipeline_on_the_forward_it_traced(how: str, mode: str) -> None:
    """Before, every call was refused as code changed since compiling, with a fix ('compile the
    model again') that failed the same way."""
    model, reference = twin(_Net())
    pipe = compile_pipeline(model, X, ["cpu", "cpu"], chunks=2)
    _replaced(model, pipe, how)
    if mode == "eval":
        model.eval(), reference.eval()
    if mode == "after an error":
        with pytest.raises(TypeError):
            model(X, X, X)  # (a call the forward cannot bind)
    x, x_ref = X.clone().requires_grad_(), X.clone().requires_grad_()
    with torch.no_grad() if mode == "no_grad" else torch.enable_grad():
        out, want = model(x), reference(x_ref)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    if mode == "two forwards, one backward":
        out, want = out + model(2 * x), want + reference(2 * x_ref)
    if mode == "autograd.grad":
        got = torch.autograd.grad(out.pow(2).sum(), [x, *model.parameters()])
        expected = torch.autograd.grad(want.pow(2).sum(), [x_ref, *reference.parameters()])
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
        assert all(p.grad is None for p in model.parameters())
    elif mode != "no_grad":
        out.pow(2).sum().backward()
        want.pow(2).sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=1e-12)
        assert_grads_equal(pipe, reference, tol=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the note of compiling stages for the new kind of call
        scale = torch.full((8, 1), 0.5, dtype=torch.float64)
        torch.testing.assert_close(model(X, scale=scale), reference(X, scale=scale), rtol=0, atol=1e-12)  # compiled from the traced forward
    with pytest.raises(RuntimeError, match=r"the model itself: .*If the model's new forward calls this pipeline .* call the model"):
        pipe(X)  # called directly, the replaced forward is no longer what the graph holds: refused, saying what works
    with pytest.raises(RuntimeError, match=r"A copy of the model .* would run the original's weights: compile a pipeline of the copy"):
        copy.deepcopy(model)(X)  # (the copy's forward calls the original's pipeline)


def test_the_models_own_hooks_run_once_around_its_call() -> None:
    model, reference = twin(_Net())
    pipe = compile_pipeline(model, X, ["cpu", "cpu"], chunks=2)
    _replaced(model, pipe, "instance forward")
    seen: list[str] = []
    for m, log in ((model, seen), (reference, [])):
        m.register_forward_hook(lambda module, args, out, log=log: log.append("forward") or out * 2)
    torch.testing.assert_close(model(X), reference(X), rtol=0, atol=1e-12)
    assert seen == ["forward"]


def test_compiling_a_model_whose_forward_calls_its_pipeline_says_what_to_put_back() -> None:
    """Before: 'neither torch.fx nor torch.export can capture', advising tensor operations."""
    model, reference = twin(_Net())
    pipe = compile_pipeline(model, X, ["cpu", "cpu"], chunks=2)
    _replaced(model, pipe, "instance forward")
    with pytest.raises(RuntimeError, match=r"_Net's forward calls a Pipeline of the model .*\n.*How to fix: .*\(del model\.forward\)"):
        compile_pipeline(model, X, ["cpu", "cpu"], chunks=2)
    torch.testing.assert_close(model(X), reference(X), rtol=0, atol=1e-12)  # the first pipeline still serves
    del model.forward
    again = compile_pipeline(model, X, ["cpu", "cpu"], chunks=2)
    torch.testing.assert_close(again(X), reference(X), rtol=0, atol=1e-12)


def test_generate_runs_on_the_pipeline_and_gives_the_plain_models_tokens() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=64, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).double().eval()
    reference = copy.deepcopy(model)
    ids = torch.randint(1, 64, (4, 6))
    mask = torch.ones_like(ids)
    mask[0, :2] = mask[2, :1] = 0  # left padding: generate gives the forward position_ids, where its signature names them
    ids[mask == 0] = 0
    pipe = compile_pipeline(model, ids, ["cpu", "cpu"], chunks=2)
    _replaced(model, pipe, "instance forward")
    calls = []
    pipe.register_forward_pre_hook(lambda module, args: calls.append(1))
    asked = dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, use_cache=False, output_scores=True, return_dict_in_generate=True)
    for search in (dict(do_sample=False), dict(num_beams=2)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got, expected = model.generate(**asked, **search), reference.generate(**asked, **search)
        assert torch.equal(got.sequences, expected.sequences), search
        assert max(float((a - b).abs().max()) for a, b in zip(got.scores, expected.scores)) <= 1e-10, search
    assert len(calls) == 6  # each token from the pipeline
