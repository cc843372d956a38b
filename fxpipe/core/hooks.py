"""A module's four hook tables (or the global ones), by kind: the one place that names them."""

from typing import Any, Optional

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


def hooked(module: Optional[nn.Module]) -> bool:
    """Whether any hook is registered on the module (or globally, for None)."""
    return any(hook_tables(module))
