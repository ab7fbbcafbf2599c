"""Forwards installed on one module instance, over whatever forward it had: the class and the state-dict names
stay as they are, and the schemes stack (a streamed base under recompute, tiling inside a layer).

Each installed forward keeps the instance forward it replaced as ``prior`` (None: the class's own) and calls
``inner``, the prior or the class's forward bound to the module. ``installed`` finds one kind in the stack and
``remove`` takes it out wherever it sits, the forwards above it then calling what it called.
"""

from __future__ import annotations

from typing import Any, TypeVar

from torch import nn


class InstanceForward:
    """A forward installed on ``module`` over its current one (see the module docstring)."""

    def __init__(self, module: nn.Module) -> None:
        self.prior: Any = module.__dict__.get("forward")
        self.inner: Any = self.prior or type(module).forward.__get__(module)


F = TypeVar("F", bound=InstanceForward)


def installed(module: nn.Module, kind: type[F]) -> F | None:
    """The forward of type ``kind`` installed on ``module``, under whatever was installed after it, or None."""
    f = module.__dict__.get("forward")
    while f is not None and not isinstance(f, kind):
        f = getattr(f, "prior", None)
    return f


def remove(module: nn.Module, kind: type[F]) -> F | None:
    """Take the forward of type ``kind`` off ``module`` (the one ``installed`` finds); returns it, or None."""
    current = installed(module, kind)
    if current is None:
        return None
    outer = module.__dict__["forward"]
    if outer is current:
        del module.forward
        if current.prior is not None:
            module.forward = current.prior
        return current
    while outer.prior is not current:
        outer = outer.prior
    outer.prior, outer.inner = current.prior, current.inner
    return current
