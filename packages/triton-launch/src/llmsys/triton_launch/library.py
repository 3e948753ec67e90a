"""Registering a package's ops: one way for every kernel package.

Each op is defined on a ``torch.library.Library`` fragment with one Python implementation for
CPU and CUDA and a fake (meta) implementation, so ``torch.compile(fullgraph=True)`` keeps it as
one node and CUDA graphs capture its launches. An op that is differentiable by itself gets an
Autograd-key kernel built from an ``autograd.Function`` that lives in the package's
``functional.py``.

Why not ``torch.library.custom_op``, ``triton_op`` or ``register_autograd``: each adds a layer
of Python around every eager call; measured in DECISIONS.md.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

DEVICES = ("CPU", "CUDA")


def define_op(lib: torch.library.Library, schema: str, impl: Callable, fake: Callable):
    """Define ``lib.ns::schema``, implement it with ``impl`` on CPU and CUDA, and register
    ``fake`` for tracing; returns the op's default overload."""
    name = schema.split("(", 1)[0]
    lib.define(schema)
    for device in DEVICES:
        lib.impl(name, impl, device)
    torch.library.register_fake(f"{lib.ns}::{name}", fake, lib=lib)
    return getattr(getattr(torch.ops, lib.ns), name).default


def _wants_grad(args: tuple) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in args
    )


def call_below_autograd(op, *args):
    """Call ``op`` past its Autograd key (from an ``autograd.Function.forward``)."""
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


def register_autograd(
    lib: torch.library.Library,
    op,
    function: type[torch.autograd.Function] | None = None,
    refuse: Callable[[], Exception] | None = None,
) -> None:
    """Give ``op`` an Autograd-key kernel.

    When grad mode is on and a tensor argument requires grad: ``function.apply(*args)`` if a
    Function is given, else ``raise refuse()`` if given, else the op runs as below. Otherwise
    the op runs below autograd and its outputs do not require grad.

    This is what ``torch.library.register_autograd`` does, without its generic wrapper, which
    costs more host time than the op's launch (DECISIONS.md).
    """
    name = op._schema.name.split("::", 1)[1]

    def kernel(*args):
        if _wants_grad(args):
            if function is not None:
                return function.apply(*args)
            if refuse is not None:
                raise refuse()
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args)

    lib.impl(name, kernel, "Autograd")
