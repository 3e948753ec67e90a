"""Tests for the shared argument checks: each error names the op, the argument, what was
expected and what came."""

import pytest

from llmsys.triton_launch import checks


def test_integer_refuses_what_an_op_schema_int_cannot_hold():
    checks.integer("op", "n", 2**63 - 1, 0)
    with pytest.raises(ValueError, match=r"op: `n` must be at most 2\*\*63 - 1 \(int64\), got"):
        checks.integer("op", "n", 2**63, 0)
    with pytest.raises(ValueError, match=r"op: `n` must be at most 5, got 6"):
        checks.integer("op", "n", 6, 0, 5)
    with pytest.raises(ValueError, match=r"op: `n` must be at least 1, got 0"):
        checks.integer("op", "n", 0, 1)
    with pytest.raises(TypeError, match=r"op: `n` must be an int, got bool"):
        checks.integer("op", "n", True, 0)


@pytest.mark.parametrize("value", ["no", None, 1, 0.0])
def test_flag_accepts_only_a_bool(value):
    checks.flag("op", "check", True)
    checks.flag("op", "check", False)
    with pytest.raises(TypeError, match=rf"op: `check` must be a bool, got {type(value).__name__}"):
        checks.flag("op", "check", value)


def test_as_called_names_the_public_function_and_its_arguments():
    error = checks.as_called(ValueError("some_op: `x` must be 2-D, got (3,)"), "public", x="w")
    assert type(error) is ValueError
    assert str(error) == "public: `w` must be 2-D, got (3,)"
    error = checks.as_called(TypeError("some_op: `xs` must be int8, got float"), "public", x="w")
    assert str(error) == "public: `xs` must be int8, got float"  # only whole argument names


@pytest.mark.parametrize(
    "error",
    [RuntimeError("op: a kernel failed"), ValueError("a message with no op"), KeyError("op: k")],
)
def test_as_called_leaves_other_errors_alone(error):
    assert checks.as_called(error, "public") is error
