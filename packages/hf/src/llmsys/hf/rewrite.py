"""How every rewrite in ``llmsys.hf`` replaces one module's ``forward``: the module's class becomes
a subclass of its transformers class that overrides ``forward``, one subclass per (class, forward).

Binding a function on the instance (``module.forward = MethodType(...)``) would hide the class's
own ``forward``, which transformers wraps for gradient checkpointing (so no layer would be
recomputed), and pickle cannot restore such a binding. The subclass keeps what users rely on:

- transformers wraps the subclass's ``forward`` for gradient checkpointing as it wraps its own;
- ``isinstance`` and the class name are the transformers class's (``_no_split_modules``, FSDP
  wrap policies and ``save_pretrained`` read the name);
- ``torch.save``/``torch.load`` and ``copy.deepcopy`` rebuild the module as the pair (its
  transformers class, the forward), both found by reference;
- other modules of the same class in the process keep transformers' code.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, SupportsIndex, cast

from torch import nn


def original_class(module: nn.Module) -> type[nn.Module]:
    """The class ``module`` had before any rewrite (its own class if none)."""
    return getattr(type(module), "_llmsys_rewrite", (type(module),))[0]


def rewrite(module: nn.Module, forward: Callable[..., Any]) -> bool:
    """Give ``module`` the ``forward`` function (``forward(self, ...)``); False if it has it."""
    base: type = original_class(module)  # (to mypy a module class is not Hashable)
    cls = rewritten_class(base, forward)
    if type(module) is cls:
        return False
    module.__class__ = cls
    return True


@functools.cache
def rewritten_class(base: type, forward: Callable[..., Any]) -> type[nn.Module]:
    """The subclass of ``base`` whose ``forward`` is ``forward``."""
    return type(
        base.__name__,
        (base,),
        {
            "forward": forward,
            "_llmsys_rewrite": (base, forward),
            "__reduce_ex__": _reduce_ex,
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
        },
    )


def _reduce_ex(self: Any, protocol: SupportsIndex) -> tuple:  # self: a rewritten module
    # object's reduction, with the class replaced by the (base, forward) pair that rebuilds it
    _, _, *state = cast(tuple, object.__reduce_ex__(self, protocol))
    return (_new, type(self)._llmsys_rewrite, *state)


def _new(base: type, forward: Callable[..., Any]) -> nn.Module:
    cls = rewritten_class(base, forward)
    return cls.__new__(cls)
