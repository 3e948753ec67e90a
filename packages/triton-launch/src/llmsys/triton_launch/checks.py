"""Argument checks shared by the kernel packages: each raises a ``TypeError`` or ``ValueError``
that names the operation, the argument, what was expected and what came.

Every message reads ``"{op}: `{name}` must ..., got ..."``. The checks are plain Python on tensor
metadata (no device work, no synchronization), so they run on every call and under tracing.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable

import torch


def dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    """``"float16, bfloat16"`` for ``(torch.float16, torch.bfloat16)``."""
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def tensor(
    op: str,
    name: str,
    value: object,
    dtypes: Collection[torch.dtype] | None = None,
    kind: str | None = None,
) -> None:
    """A ``torch.Tensor`` whose dtype is in ``dtypes`` (if given), else ``TypeError``.

    The dtype message lists the allowed dtypes, or says ``must have {kind} dtype`` when ``kind``
    (e.g. ``"a floating"``) is given.

    Raises:
        TypeError: ``value`` is not a tensor, or its dtype is not in ``dtypes``.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: `{name}` must be a torch.Tensor, got {type(value).__name__}")
    if dtypes is not None and value.dtype not in dtypes:
        expected = f"{kind} dtype" if kind else f"dtype in ({dtype_names(dtypes)})"
        raise TypeError(f"{op}: `{name}` must have {expected}, got {value.dtype}")


def tensors(op: str, optional: Iterable[str] = (), **values: object) -> None:
    """Each value a ``torch.Tensor`` (or None, for the names in ``optional``), else ``TypeError``.

    For the public functions, before the dispatcher: its own schema error is a RuntimeError that
    names no argument.

    Raises:
        TypeError: a value is not a tensor (nor None where optional).
    """
    for name, value in values.items():
        if value is None and name in optional:
            continue
        tensor(op, name, value)


def same_dtype(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """``t`` of ``ref``'s dtype.

    Raises:
        TypeError: the dtypes differ.
    """
    if t.dtype != ref.dtype:
        raise TypeError(
            f"{op}: `{name}` must have the dtype of `{ref_name}` ({ref.dtype}), got {t.dtype}"
        )


def same_shape(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """``t`` of ``ref``'s shape.

    Raises:
        ValueError: the shapes differ.
    """
    if t.shape != ref.shape:
        raise ValueError(
            f"{op}: `{name}` must have the shape of `{ref_name}` ({tuple(ref.shape)}), "
            f"got {tuple(t.shape)}"
        )


def same_device(
    op: str, name: str, t: torch.Tensor | None, ref_name: str, ref: torch.Tensor
) -> None:
    """``t`` (skipped when None) on ``ref``'s device.

    Raises:
        ValueError: the devices differ.
    """
    if t is not None and t.device != ref.device:
        raise ValueError(
            f"{op}: `{name}` must be on the device of `{ref_name}` ({ref.device}), got {t.device}"
        )


INT64_MAX = 2**63 - 1  # the largest value an op schema's ``int`` holds


def integer(op: str, name: str, value: object, minimum: int, maximum: int = INT64_MAX) -> None:
    """An ``int`` (not a bool) in ``[minimum, maximum]``: ``TypeError``, then ``ValueError``.

    The default ``maximum`` is int64's: past it the dispatcher's own error ("Expected a value
    of type 'int' ... found type 'int'") names no argument.

    Raises:
        TypeError: ``value`` is not an int (a bool is not one).
        ValueError: ``value`` is below ``minimum`` or above ``maximum``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{op}: `{name}` must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{op}: `{name}` must be at least {minimum}, got {value}")
    if value > maximum:
        bound = "2**63 - 1 (int64)" if maximum == INT64_MAX else maximum
        raise ValueError(f"{op}: `{name}` must be at most {bound}, got {value}")


def flag(op: str, name: str, value: object) -> None:
    """A ``bool`` (not a truthy string or None).

    Raises:
        TypeError: ``value`` is not a bool.
    """
    if type(value) is not bool:
        raise TypeError(f"{op}: `{name}` must be a bool, got {type(value).__name__}")


def positive_int(owner: str, name: str, value: object) -> None:
    """A module size: an ``int`` (not a bool) of at least 1.

    Raises:
        ValueError: ``value`` is not one.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: `{name}` must be a positive int, got {value!r}")


_OP_PREFIX = re.compile(r"[A-Za-z_][A-Za-z0-9_]*: ")


def as_called(error: Exception, public: str, **renamed: str) -> Exception:
    """``error``, raised by an op's argument check, as the public function ``public`` raises it:
    the message names ``public`` instead of the op, and each op argument in ``renamed`` by its
    public name (``x="weight"``). Any other exception comes back as it is.

    For ``except (TypeError, ValueError) as error: raise checks.as_called(error, "swiglu") from
    None`` around the op call in a public function: a ``try`` costs nothing until something is
    raised, where a check in front of the op would cost every call.
    """
    message = str(error)
    prefix = _OP_PREFIX.match(message)
    if type(error) not in (TypeError, ValueError) or prefix is None:
        return error
    message = f"{public}: {message[prefix.end() :]}"
    for op_name, public_name in renamed.items():
        message = message.replace(f"`{op_name}`", f"`{public_name}`")
    return type(error)(message)
