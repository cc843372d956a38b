"""Hook tables by kind, a module's four (or the global ones) and a tensor's on its gradient: the one place naming them."""

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
from torch import nn

# Each kind as messages name it, and the table that holds it on a module (prefixed "_global" in
# torch.nn.modules.module for the hooks of every module).
KINDS = {"forward pre-hook": "_forward_pre_hooks", "forward hook": "_forward_hooks",
         "backward hook": "_backward_hooks", "backward pre-hook": "_backward_pre_hooks"}  # fmt: skip


def hook_tables(module: Optional[nn.Module]) -> list[dict[int, Any]]:
    """The module's hook tables in the order of `KINDS`, or the global ones for None."""
    if module is None:
        return [getattr(nn.modules.module, "_global" + table) for table in KINDS.values()]
    return [getattr(module, table) for table in KINDS.values()]


def hook_name(hook: Any) -> str:
    """A hook as messages name it: its function's qualified name, or its class's."""
    return str(getattr(hook, "__qualname__", None) or type(hook).__qualname__)


def gradient_hooks(tensor: torch.Tensor) -> tuple[int, ...]:
    """The ids of the hooks on a tensor's gradient: register_hook's, then
    register_post_accumulate_grad_hook's (which run once it is accumulated into `.grad`)."""
    return tuple([*(tensor._backward_hooks or {}), *(tensor._post_accumulate_grad_hooks or {})])


def steps_after_accumulating(tensor: torch.Tensor) -> bool:
    """Whether a hook runs once the tensor's gradient is accumulated (an optimizer stepped in backward)."""
    return bool(tensor._post_accumulate_grad_hooks)


# Why global backward hooks are refused, at compile time or when registered after.
GLOBAL_BACKWARD_HOOKS = (
    "global backward hooks are registered (nn.modules.module.register_module_full_backward_hook or "
    "register_module_full_backward_pre_hook): they would never fire for the modules the trace goes through, "
    "the model itself among them, where the plain model's backward fires them for every module.\n"
    "How to fix: remove them (handle.remove()) before compiling, or hook a tensor or a parameter instead "
    "(tensor.register_hook)."
)


def global_backward_hooks() -> bool:
    """Whether a global backward hook or backward pre-hook is registered."""
    return bool(nn.modules.module._global_backward_hooks or nn.modules.module._global_backward_pre_hooks)


def output_hook(hook: Any) -> bool:
    """A forward hook whose whole effect is in the model's own output: Hugging Face's output
    capturing (`output_hidden_states=True`, `output_attentions=True`), which hands a module's
    output to a collector that only the model's forward sets up and reads, within the call. A
    trace of that call captures what it collects; a call without a collector finds it idle."""
    return getattr(hook, "__module__", None) == "transformers.utils.output_capturing"


def hooked(module: Optional[nn.Module]) -> bool:
    """Whether any hook is registered on the module (or globally, for None)."""
    return any(hook_tables(module))


@contextmanager
def hooks_put_back_on_failure(model: nn.Module) -> Iterator[None]:
    """Run the body; if it raises, every module's hook tables hold what they held before, and
    the attributes the body added to a module are gone: a refused compile whose runs of the model
    made a library register hooks (and mark the module as hooked) leaves none behind. A body that
    succeeds keeps them, as one call of the plain model would."""
    before = [(module, [dict(table) for table in hook_tables(module)], set(vars(module))) for module in model.modules()]
    try:
        yield
    except BaseException:
        for module, tables, names in before:
            for table, held in zip(hook_tables(module), tables):
                if table != held:
                    table.clear()
                    table.update(held)
            for name in set(vars(module)) - names:
                del vars(module)[name]
        raise
