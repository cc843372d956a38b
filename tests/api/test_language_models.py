"""Hugging Face language models, made from small configs: exact at every sequence length."""
from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import pytest
import torch
from torch import nn

from helpers import assert_grads_equal
from fxpipe import Pipeline, compile_pipeline

transformers = pytest.importorskip("transformers")  # a test dependency: installed by `make test`


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=64, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def bert() -> nn.Module:
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=64,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertModel(config)


def llama() -> nn.Module:
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, vocab_size=64, max_position_embeddings=64, use_cache=False,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def first(output: Any) -> torch.Tensor:
    return output["logits"] if "logits" in output else output["last_hidden_state"]


def loss(output: Any) -> torch.Tensor:
    return sum(value.pow(2).mean() for value in output.values() if isinstance(value, torch.Tensor))  # type: ignore[return-value]


@pytest.mark.parametrize("make", [gpt2, bert, llama], ids=["gpt2", "bert", "llama"])
def test_language_model_at_every_sequence_length(make: Callable[[], nn.Module]) -> None:
    torch.manual_seed(0)
    model = make().double()
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the note that torch.export took over from torch.fx
        pipe = compile_pipeline(model, torch.randint(0, 64, (4, 12)), ["cpu"] * 2, chunks=2)
    for length in (12, 20, 5):
        ids = torch.randint(0, 64, (4, length))
        out, expected = pipe(ids), reference(ids)
        assert type(out) is type(expected)
        torch.testing.assert_close(first(out), first(expected), rtol=0, atol=1e-9)
        loss(out).backward()
        loss(expected).backward()
        assert_grads_equal(pipe, reference, tol=1e-9)


class _CacheAnyway(nn.Module):
    """Returns a cache with use_cache off (as peft's prefix tuning makes Llama do)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from transformers import DynamicCache  # (transformers comes from importorskip)

        return self.model(*args, **kwargs).logits, DynamicCache()


def test_a_model_that_returns_a_cache_with_it_turned_off_says_to_return_what_is_needed() -> None:
    """Before, the fix was to register the cache's class with pytree, a class of the library's."""
    model = gpt2().eval()
    config: Any = model.config
    config.use_cache = False
    with pytest.raises(Exception, match=r"(?s)How to fix: the model returns a key/value cache with use_cache off.*\.logits`\)") as refused:
        compile_pipeline(_CacheAnyway(model), torch.randint(0, 64, (4, 12)), ["cpu"] * 2)
    assert str(refused.value).splitlines()[-1].startswith("How to fix: the model returns a key/value cache with use_cache off")


def test_a_model_that_returns_its_cache_says_to_turn_it_off() -> None:
    model = gpt2().eval()
    config: Any = model.config  # a transformers config (transformers comes from importorskip: untyped here)
    config.use_cache = True
    with pytest.raises(Exception, match="use_cache = False") as refused:
        compile_pipeline(model, torch.randint(0, 64, (4, 12)), ["cpu"] * 2)
    # The cache's fix is the one the error ends with, not advice about control flow.
    assert str(refused.value).splitlines()[-1].startswith("How to fix: the model returns its key/value cache")
    pipe = compile_pipeline(model, torch.randint(0, 64, (4, 12)), ["cpu"] * 2, example_kwargs={"use_cache": False})
    ids = torch.randint(0, 64, (4, 9))
    torch.testing.assert_close(pipe(ids, use_cache=False)["logits"], model(ids, use_cache=False)["logits"])


@pytest.mark.parametrize("make", [gpt2, bert], ids=["gpt2", "bert"])
def test_a_config_value_changed_after_compiling_is_refused_and_runs_once_back(make: Callable[[], nn.Module]) -> None:
    """Before, `model.config.output_hidden_states = True` after compiling left the pipeline
    returning the logits alone, where the plain model returned the hidden states too."""
    model = make().double()
    ids = torch.randint(0, 64, (4, 12))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the note that torch.export took over from torch.fx
        pipe = compile_pipeline(model, ids, ["cpu"] * 2, chunks=2)
    config: Any = model.config
    config.output_hidden_states = True
    with pytest.raises(RuntimeError, match=r"have changed since compiling: config.output_hidden_states \(False -> True\)"):
        pipe(ids)
    config.output_hidden_states = False
    torch.testing.assert_close(first(pipe(ids)), first(model(ids)), rtol=0, atol=1e-9)


def _hidden(output: Any) -> list[torch.Tensor]:
    return [output["last_hidden_state"], *(output.get("hidden_states") or ())]


def test_hidden_states_come_back_as_the_plain_model_s_with_the_hooks_transformers_installs_for_them() -> None:
    """transformers hands each layer's output to the model's forward through forward hooks it
    installs the first time a call asks for hidden states. Before, hooks installed after
    compiling refused every call, and a call asking for hidden states (its own kind of call,
    compiled then, with the hooks in place) was refused ("it would run the model's hooks
    once"), with advice that left the plain model returning no hidden states."""
    torch.manual_seed(0)
    model, ids = bert().double(), torch.randint(0, 64, (4, 12))
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the note that torch.export took over from torch.fx
        pipe = compile_pipeline(model, ids, ["cpu"] * 2, chunks=2)
        with torch.no_grad():
            model(ids, output_hidden_states=True), reference(ids, output_hidden_states=True)  # install the hooks
        for kwargs in ({}, {"output_hidden_states": True}):
            out, expected = _hidden(pipe(ids, **kwargs)), _hidden(reference(ids, **kwargs))
            assert len(out) == len(expected) == (4 if kwargs else 1)
            for got, want in zip(out, expected):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
            for output in (pipe(ids, **kwargs), reference(ids, **kwargs)):
                (loss(output) + sum(h.square().mean() for h in output.get("hidden_states") or ())).backward()
            assert_grads_equal(pipe, reference, tol=1e-9)


def test_bert_compiled_with_token_type_ids_is_called_without_them() -> None:
    """Before, the call was refused ("the pipeline was exported for arguments shaped like the
    example"); the plain model takes both."""
    torch.manual_seed(0)
    model = bert().double()
    reference = copy.deepcopy(model)
    ids, types = torch.randint(0, 64, (4, 12)), torch.zeros(4, 12, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the note that torch.export took over from torch.fx
        pipe = compile_pipeline(model, ids, ["cpu"] * 2, chunks=2, example_kwargs={"token_type_ids": types})
        for kwargs in ({"token_type_ids": types}, {}):
            out, expected = pipe(ids, **kwargs), reference(ids, **kwargs)
            torch.testing.assert_close(first(out), first(expected), rtol=0, atol=1e-9)
            loss(out).backward()
            loss(expected).backward()
            assert_grads_equal(pipe, reference, tol=1e-9)


@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2", "llama"])
def test_train_step_on_the_model_s_own_loss_with_padded_labels_is_the_plain_model_s(make: Callable[[], nn.Module]) -> None:
    """Labels padded with -100 unevenly across the batch: each micro-batch's own loss is a mean
    over the positions it counts, and train_step weights it by that count, with nothing to warn of."""
    model, reference, ids, labels = _padded(make, (3, 7))
    pipe = compile_pipeline(model, (ids,), ["cpu", "cpu"], chunks=4, example_kwargs={"labels": labels}, schedule="1f1b")
    _assert_trains_as_the_plain_model(pipe, reference, ids, {"labels": labels})


def _padded(make: Callable[[], nn.Module], lengths: tuple[int, ...]) -> tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor]:
    """The model in float64, its plain twin, token ids and their labels, row i padded with -100
    from position lengths[i] on."""
    torch.manual_seed(0)
    model = make().double()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 64, (4, 12))
    labels = ids.clone()
    for row, length in enumerate(lengths):
        labels[row, length:] = -100
    return model, reference, ids, labels


def _assert_trains_as_the_plain_model(pipe: Pipeline, reference: nn.Module, ids: torch.Tensor, kwargs: dict[str, Any]) -> None:
    """train_step on the model's own loss, with nothing to warn of: the plain model's loss and gradients."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        loss = pipe.train_step(ids, **kwargs)
    expected = reference(ids, **kwargs).loss
    expected.backward()
    # Llama's loss upcasts its logits to float32 (the plain model's and each micro-batch's alike).
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-6, atol=0)
    assert_grads_equal(pipe, reference, tol=1e-10)


@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2", "llama"])
def test_train_step_on_the_model_s_own_loss_over_num_items_in_batch_is_the_plain_model_s(make: Callable[[], nn.Module]) -> None:
    """Given num_items_in_batch (as Hugging Face's Trainer gives it), the model's own loss is a sum
    over the positions counted, divided by the batch's count: compiling sees it is the sum of its
    halves', and train_step sums the micro-batches' losses, under the default reduction. Before,
    it took their mean, with a warning: the loss and gradients a quarter of the plain model's."""
    model, reference, ids, labels = _padded(make, (3,))
    count = torch.tensor(int((labels[:, 1:] != -100).sum()))
    kwargs: dict[str, Any] = {"labels": labels, "num_items_in_batch": count}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the note that torch.export took over from torch.fx, where it does
        pipe = compile_pipeline(model, (ids,), ["cpu", "cpu"], chunks=4, example_kwargs=kwargs)
    assert pipe.program().own_loss_combines == "sum"
    _assert_trains_as_the_plain_model(pipe, reference, ids, kwargs)
