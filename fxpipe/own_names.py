"""Attributes of the pipeline's own that give way to a child of the model's of the same name."""
from __future__ import annotations

from typing import Any, Generic, Optional, TypeVar, cast, overload

T = TypeVar("T")


class OwnUnlessAChild(Generic[T]):
    """`pipe.plan` (say) is the pipeline's, unless the model has a child called `plan`: then it is
    the child, as on the plain model, since torch's tools reach children by name (`get_submodule`,
    `get_parameter`, `torch.func.functional_call`, pruning). `Pipeline.plan.own(pipe)` is the
    pipeline's in either case. The value is held in the instance's `__dict__` as `_<name>`, where
    setting it puts it."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.key = name, f"_{name}"

    @overload
    def __get__(self, pipe: None, kind: Optional[type] = None) -> "OwnUnlessAChild[T]": ...

    @overload
    def __get__(self, pipe: object, kind: Optional[type] = None) -> T: ...

    def __get__(self, pipe: Any, kind: Optional[type] = None) -> Any:
        if pipe is None:
            return self
        child = pipe.__dict__["_modules"].get(self.name)
        return child if child is not None else self.own(pipe)

    def __set__(self, pipe: Any, value: T) -> None:
        pipe.__dict__[self.key] = value

    def own(self, pipe: Any) -> T:
        """The pipeline's own value, whatever the model's children are called."""
        return cast(T, pipe.__dict__[self.key])
