"""The Pipeline's state: across processes this rank's own parameters and buffers, its state dict, loading one, and both refused while a 2bw loop's steps overlap."""
from __future__ import annotations

import collections
import contextlib
import functools
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch import nn

from fxpipe.calls import PipelineCalls
from fxpipe.compiled.program import Program
from fxpipe.distributed.ranks import keep_local_state


def _refuse_shared_entries_across_ranks(model: nn.Module, program: Program, state_dict: Any) -> None:
    """With assign=True, entries that share memory (a tied weight's keys, as torch.load gives
    them) become parameters that share it, as in the plain model, each updated in place of the
    other: ranks hold no memory in common, so where the parameters are read on different ranks
    each would go its own way. The same on every rank, which loads the same state dict."""
    params = dict(model.named_parameters(remove_duplicate=False))
    by_storage: dict[tuple[str, int], list[str]] = collections.defaultdict(list)
    for key, value in state_dict.items():
        if key in params and isinstance(value, torch.Tensor) and value.device.type != "meta":
            by_storage[(str(value.device), value.untyped_storage().data_ptr())].append(key)
    def ranks_reading(keys: list[str]) -> set[int]:
        return {rank for key in keys for rank in program.readers.get(id(params[key]), ())}

    apart = [keys for keys in by_storage.values() if len(keys) > 1 and len(ranks_reading(keys)) > 1]
    if apart:
        raise RuntimeError(
            f"load_state_dict(assign=True) across processes was given entries that share memory, read on different ranks: "
            f"{'; '.join(' and '.join(keys) for keys in apart)}. The plain model would make them parameters over one "
            "memory, each updated in place of the other; ranks hold no memory in common.\nHow to fix: load without "
            "assign=True (the values are copied into the model's tied weight, which stays tied), or clone the entries "
            "first ({k: v.clone() for k, v in state_dict.items()}) to load them as untied weights."
        )


def _on_the_model(hook: Callable[[nn.Module, Any], Any], model: nn.Module, pipe: nn.Module, keys: Any) -> Any:
    """A load post-hook of the model's, called by torch's loading of the pipeline: on the model."""
    return hook(model, keys)


class PipelineState(PipelineCalls):
    """The Pipeline's parameters, buffers and state dict: the model's, and across processes this
    rank's part of them (fxpipe/pipeline.py builds on it)."""

    def _refuse_while_steps_overlap(self, what: str) -> None:
        if not self.__dict__.get("_overlapping"):
            return
        if not self.__dict__.get("_in_hook"):
            raise RuntimeError(
                f"{what} during a train_steps loop with schedule='2bw': its stages run and update their weights "
                "between the losses it gives, so no version of the model is whole until the loop ends, but in its "
                "hooks.\nHow to fix: call it after the loop (or state_dict() in after_step, where the model is whole); "
                "to stop early, break out of the loop (it completes the update of the last batch whose loss it gave, "
                "and drops the rest), or close it (steps.close())."
            )
        if what == "load_state_dict()":
            raise RuntimeError(
                "load_state_dict() in a hook of a train_steps loop with schedule='2bw': the next batch started before "
                "the hook, on the model as it was, and would go on with the state loaded.\nHow to fix: load between two "
                "loops (break out of this one, which completes the update of the last batch whose loss it gave), or "
                "use a synchronous schedule (1f1b), which follows such a change from the next batch."
            )
        # The hooks see the model whole, but the workers a call would run on hold the stages of
        # the batches in flight, which wait for the hook to return.
        raise RuntimeError(
            f"{what} in a hook of a train_steps loop with schedule='2bw': the model is whole there, but the loop's "
            "workers are running the next batch's stages, which wait for the hook to return, and a call of the "
            "pipeline would run on them.\nHow to fix: save the version the hook sees (pipe.state_dict(), which "
            "works there) and evaluate it after the loop, or evaluate between two loops (break out of this one, "
            "which completes the update of the last batch whose loss it gave); or use a synchronous schedule "
            "(1f1b), whose hooks may call the pipeline."
        )

    # -- across processes: this rank's own parameters and buffers ---------------------------------
    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The model's parameters; across processes, those of this rank's stages only."""
        with self._slots_held_still():
            found = list(super().named_parameters(prefix, recurse, remove_duplicate))
        yield from found if self.__dict__.get("_channel") is None else ((name, p) for name, p in found if not self._elsewhere(p))

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        with self._slots_held_still():
            found = list(super().named_buffers(prefix, recurse, remove_duplicate))
        yield from ((name, b) for name, b in found if not self._elsewhere(b))

    def _slots_held_still(self) -> ContextManager[None]:
        """During a loop whose steps overlap, its stages hold the model's parameter slots as they
        run: the modules are read with every stage kept out of them (fxpipe/runtime/versions.py)."""
        gate = self.__dict__.get("_overlapping")
        return gate.shut() if gate else contextlib.nullcontext()

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The model's state dict (its keys, its extra state, hooks and overrides); across
        processes, this rank's part. In a 2bw loop's hooks it is the version they see."""
        if not self.__dict__.get("_in_hook"):
            self._refuse_while_steps_overlap("state_dict()")
        prefix, keep_vars = kwargs.get("prefix", ""), kwargs.get("keep_vars", False)
        for pre in self._state_dict_pre_hooks.values():  # the pipeline's own hooks, around the model's state dict
            pre(self, prefix, keep_vars)
        state = self._owner.state_dict(*args, **kwargs)
        for key in [k for k, v in state.items() if isinstance(v, torch.Tensor) and self._elsewhere(v)]:
            del state[key]
        metadata = getattr(state, "_metadata", {}).get(prefix[:-1], {})
        for post in self._state_dict_hooks.values():
            replaced = post(self, state, prefix, metadata)
            if replaced is not None:  # as on any module: the private form may return another dict
                if getattr(post, "_from_public_api", False):
                    raise RuntimeError("state_dict post-hook must return None")
                state = replaced
        return state

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *rest: Any) -> None:
        """The model's own loading of its top level: its load pre-hooks and extra state run,
        after the pipeline's own load pre-hooks."""
        for pre in self._load_state_dict_pre_hooks.values():
            pre(state_dict, prefix, *rest)
        self._owner._load_from_state_dict(state_dict, prefix, *rest)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """The model's state under its own keys; across processes, this rank takes its part of a
        whole model's state dict (keys of other ranks' stages are not unexpected). With `assign`,
        the stages are built again on the tensors put in place (across processes, on every rank:
        the ranks agree on what each keeps)."""
        self._refuse_while_steps_overlap("load_state_dict()")
        if self.__dict__.get("_channel") is None:
            with self._models_post_hooks_too():
                result = super().load_state_dict(state_dict, strict, assign)
            if assign:
                self._build()
            return result
        own, every = set(self.state_dict()), set(super().state_dict())
        missing = sorted(own - set(state_dict))
        unexpected = sorted(set(state_dict) - every)
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"this rank's part of the state dict does not match: missing keys {missing}, unexpected keys "
                f"{unexpected}.\nHow to fix: load a state dict of the same model (or pass strict=False)."
            )
        if assign:
            _refuse_shared_entries_across_ranks(self._owner, self._programs[True], state_dict)
        with self._models_post_hooks_too():
            super().load_state_dict({k: v for k, v in state_dict.items() if k in own}, strict=False, assign=assign)
        if assign:  # tensors put in place that this rank's stages no longer read (a tie undone) go, as at compile
            self._build()
            placement = self._compiled.placement
            assert placement is not None
            keep_local_state(self._owner, list(self._programs.values()), placement)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    @contextlib.contextmanager
    def _models_post_hooks_too(self) -> Iterator[None]:
        """The model's own load post-hooks, run by torch's loading as the pipeline's are, before
        them (torch runs those of the module it loads from, which is the pipeline): they may
        mend the keys a strict load checks."""
        own = self._load_state_dict_post_hooks
        model = self._owner
        merged = collections.OrderedDict(
            [*((("model", key), functools.partial(_on_the_model, hook, model)) for key, hook in model._load_state_dict_post_hooks.items()),
             *own.items()]
        )  # fmt: skip
        self.__dict__["_load_state_dict_post_hooks"] = merged
        try:
            yield
        finally:
            self.__dict__["_load_state_dict_post_hooks"] = own

    def _elsewhere(self, tensor: torch.Tensor) -> bool:
        """Held by another rank (this one keeps its shape only, on the meta device)."""
        return self.__dict__.get("_channel") is not None and tensor.device.type == "meta"
