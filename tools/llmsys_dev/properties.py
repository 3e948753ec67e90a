"""Shared pieces of the kernels' Hypothesis property tests (issue 49).

The property every public kernel function keeps, for any input: it returns a result that matches
an independent reference, or raises a ``ValueError``/``TypeError`` whose message names one of
its arguments, or a ``RuntimeError`` that names the unsupported operation. Any other exception
fails, and so does an input that the call changed.

``outcome(fn, *args, **kwargs)`` makes the call and checks the exception side and the inputs;
the strategies here draw the arguments (``tensor_arg``: a valid tensor in some layout, or one
broken on purpose). Each test file compares the results with its own float64 reference.

The Triton kernels run under the interpreter on CPU, slowly: the sizes stay tiny, the example
budgets small, and ``SETTINGS`` derandomized with no database, so CI runs the same examples.
"""

from __future__ import annotations

import copy
import inspect
import math
import re

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st


def property_settings(max_examples: int):
    """The repo's Hypothesis settings (no deadline, no database) plus derandomize: the same
    examples on every run, so a CI failure reproduces and the run time is fixed."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# What a RuntimeError must say: which operation is not supported (inference-only kernels,
# double backward, gradients the kernels do not compute).
UNSUPPORTED = re.compile(
    r"not supported|unsupported|inference-only|double backward|no gradient", re.IGNORECASE
)


def names_an_argument(message: str, names) -> bool:
    """Whether ``message`` names one of ``names``: backticked, or (names of 3 characters or
    more) as a whole word not preceded by a dot (``lm_head.weight`` does not name ``weight``)."""
    for name in names:
        if f"`{name}`" in message:
            return True
        if len(name) >= 3 and re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", message):
            return True
    return False


class Refused:
    """What ``outcome`` returns for a call that raised as the property allows."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def __repr__(self) -> str:
        return f"Refused({self.error!r})"


def _snapshot(value):
    if isinstance(value, torch.Tensor):
        return (value.detach().clone(), value.shape, value.stride(), value.dtype)
    return copy.deepcopy(value)


def _assert_same(before, value, name: str) -> None:
    if isinstance(value, torch.Tensor):
        clone, shape, stride, dtype = before
        assert (value.shape, value.stride(), value.dtype) == (shape, stride, dtype), name
        assert torch.equal(value.isnan(), clone.isnan()) if value.is_floating_point() else True
        same = value.detach() == clone
        if value.is_floating_point():
            same |= value.detach().isnan() & clone.isnan()
        assert bool(same.all()), f"the call changed its input `{name}`"
    elif not isinstance(value, float) or not math.isnan(value):
        assert before == value, f"the call changed its input `{name}`"


def outcome(fn, *args, may_write=(), **kwargs):
    """Call ``fn(*args, **kwargs)``: its result, or ``Refused(error)`` for a ``ValueError`` or
    ``TypeError`` naming one of ``fn``'s parameters or a ``RuntimeError`` naming an unsupported
    operation. Any other exception propagates (the property fails). Every argument but those
    named in ``may_write`` must be left as it was."""
    names = list(inspect.signature(fn).parameters)
    bound = dict(zip(names, args, strict=False)) | kwargs
    before = {name: _snapshot(value) for name, value in bound.items() if name not in may_write}
    try:
        result = fn(*args, **kwargs)
    except (TypeError, ValueError) as error:
        assert names_an_argument(str(error), names), (
            f"{type(error).__name__} that names none of {names}: {error}"
        )
        result = Refused(error)
    except RuntimeError as error:
        assert UNSUPPORTED.search(str(error)), f"RuntimeError naming no unsupported op: {error}"
        result = Refused(error)
    for name, snapshot in before.items():
        _assert_same(snapshot, bound[name], name)
    return result


# --- strategies ----------------------------------------------------------------------------------

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
OTHER_DTYPES = (torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool, torch.complex64)
NOT_TENSORS = st.sampled_from([[1.0, 2.0], 3, 2.5, "x", (1,)])
LAYOUTS = ("contiguous", "contiguous", "transposed", "sliced", "expanded")
VALUES = ("normal", "normal", "normal", "nonfinite", "zeros", "large", "small")


def shapes(max_dims: int = 3, max_size: int = 5):
    return st.lists(st.integers(0, max_size), max_size=max_dims).map(tuple)


def _values(gen, shape, dtype, kind: str, scale: float, ints: tuple[int, int]):
    if not dtype.is_floating_point and not dtype.is_complex:
        if dtype == torch.bool:
            return torch.randint(0, 2, shape, generator=gen).bool()
        return torch.randint(*ints, shape, generator=gen, dtype=torch.int64).to(dtype)
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
    if kind == "zeros":
        x.zero_()
    elif kind == "large":
        x *= {torch.float16: 300.0, torch.bfloat16: 1e4}.get(dtype, 1e4)
    elif kind == "small":
        x *= 1e-4
    return x.to(dtype)


@st.composite
def tensor(draw, shape, dtype, *, scale: float = 1.0, ints=(-5, 6), plain: bool = False):
    """A tensor of ``shape`` and ``dtype`` with values of a drawn kind (normal, planted NaN or
    Inf, zeros, large, small) in a drawn layout (contiguous, transposed, sliced every other
    element of the last dim, or expanded along dim 0). ``plain``: contiguous normal values."""
    shape = tuple(shape)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    kind = "normal" if plain else draw(st.sampled_from(VALUES))
    layout = "contiguous" if plain or not shape else draw(st.sampled_from(LAYOUTS))
    if layout == "transposed" and len(shape) < 2:
        layout = "sliced"
    base_shape = {
        "contiguous": shape,
        "transposed": (*shape[:-2], shape[-1], shape[-2]) if len(shape) >= 2 else shape,
        "sliced": (*shape[:-1], 2 * shape[-1]) if shape else shape,
        "expanded": (1, *shape[1:]),
    }[layout]
    base = _values(gen, base_shape, dtype, kind, scale, ints)
    if kind == "nonfinite" and base.numel() and dtype.is_floating_point:
        bad = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        base.view(-1)[draw(st.integers(0, base.numel() - 1))] = bad
    if layout == "transposed":
        return base.transpose(-1, -2)
    if layout == "sliced":
        return base[..., ::2]
    if layout == "expanded":
        return base.expand(shape)
    return base


@st.composite
def broken_tensor(draw, shape, dtype, *, bad_dtypes, bad_shape=None):
    """Something wrong where a tensor of ``shape`` and ``dtype`` is wanted: not a tensor, a
    dtype from ``bad_dtypes``, or (when ``bad_shape`` is given: a predicate saying which shapes
    the function must refuse) a shape it refuses."""
    kinds = ["type", "dtype"] + (["shape"] if bad_shape is not None else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "type":
        return draw(NOT_TENSORS)
    if kind == "dtype":
        return draw(tensor(shape, draw(st.sampled_from(bad_dtypes)), plain=True))
    wrong = draw(shapes().filter(bad_shape))
    return draw(tensor(wrong, dtype))


def bad_dtypes(good) -> tuple[torch.dtype, ...]:
    return tuple(d for d in FLOATS + OTHER_DTYPES if d not in good)


def ulp(dtype: torch.dtype) -> float:
    """The relative spacing of ``dtype`` (bfloat16 doubled: the interpreter truncates a float32
    to bfloat16 where CUDA rounds to nearest)."""
    eps = torch.finfo(dtype).eps
    return 2 * eps if dtype == torch.bfloat16 else eps


def assert_close(got: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> None:
    """``got`` against a float64 ``expected``: same shape, NaN at the same places, equal
    infinities, else within ``atol + rtol * |expected|``."""
    assert got.shape == expected.shape, (got.shape, expected.shape)
    torch.testing.assert_close(
        got.double(), expected.double(), rtol=rtol, atol=atol, equal_nan=True
    )
