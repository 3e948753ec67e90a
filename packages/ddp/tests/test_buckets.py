"""The bucket grouping alone: a pure function of sizes, the same on every rank."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmsys.ddp import group_buckets

MIB = 2**20


def test_reverse_registration_order_under_the_cap():
    # Four parameters of 1 MiB under a 2 MiB cap: the last registered go first.
    assert group_buckets([MIB] * 4, 2.0) == [[3, 2], [1, 0]]


def test_a_parameter_larger_than_the_cap_gets_its_own_bucket():
    sizes = [MIB, 5 * MIB, MIB, MIB]
    assert group_buckets(sizes, 2.0) == [[3, 2], [1], [0]]


def test_every_parameter_exactly_once_and_no_bucket_over_the_cap():
    sizes = [(i * 7919) % 3001 + 1 for i in range(200)]  # ragged sizes, deterministic
    for cap_mb in (1e-9, 0.001, 0.01, 1.0):
        buckets = group_buckets(sizes, cap_mb)
        assert sorted(i for bucket in buckets for i in bucket) == list(range(200))
        assert [i for bucket in buckets for i in bucket] == list(reversed(range(200)))
        for bucket in buckets:
            assert len(bucket) == 1 or sum(sizes[i] for i in bucket) <= cap_mb * MIB


def test_kinds_are_never_mixed():
    buckets = group_buckets([10, 10, 10, 10], 1.0, kinds=["f32", "f32", "bf16", "f32"])
    assert buckets == [[3], [2], [1, 0]]


def test_one_bucket_when_everything_fits():
    assert group_buckets([100] * 5, 1000.0) == [[4, 3, 2, 1, 0]]
    assert group_buckets([], 25.0) == []


@pytest.mark.parametrize(
    ("args", "match"),
    [(([1], 0), r"`bucket_size_mb` must be a finite number > 0, got 0"),
     (([1], float("nan")), r"`bucket_size_mb` must be a finite number > 0, got nan"),
     (([1], float("inf")), r"`bucket_size_mb` must be a finite number > 0, got inf"),
     (([1, -5], 1.0), r"`nbytes` must hold non-negative ints, got -5 at position 1"),
     (([float("nan")], 1.0), r"`nbytes` must hold non-negative ints, got nan at position 0"),
     (([1.5], 1.0), r"`nbytes` must hold non-negative ints, got 1.5 at position 0"),
     (([1, 2], 1.0, ["a"]), r"kinds must have one entry per parameter \(2\), got 1")],
)  # fmt: skip
def test_bad_arguments_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        group_buckets(*args)


@pytest.mark.parametrize(
    ("args", "match"),
    [((5, 1.0), r"`nbytes` must be a sequence of ints, got 5"),
     (([1], "25"), r"`bucket_size_mb` must be a number, got str"),
     (([1], None), r"`bucket_size_mb` must be a number, got NoneType")],
)  # fmt: skip
def test_bad_types_are_refused(args, match):
    with pytest.raises(TypeError, match=match):
        group_buckets(*args)


ANY_NUMBER = st.one_of(
    st.integers(-3, 10**7), st.floats(allow_nan=True, allow_infinity=True), st.booleans()
)


@settings(max_examples=50, deadline=None, database=None)
@given(nbytes=st.lists(ANY_NUMBER, max_size=10), cap=ANY_NUMBER)
def test_property_the_buckets_are_valid_or_the_error_names_the_argument(nbytes, cap):
    """Any input: every parameter exactly once, no bucket over the cap unless alone, or an
    error naming `nbytes` / `bucket_size_mb`."""
    try:
        buckets = group_buckets(nbytes, cap)
    except (TypeError, ValueError) as error:
        assert "`nbytes`" in str(error) or "`bucket_size_mb`" in str(error)
        return
    assert sorted(i for bucket in buckets for i in bucket) == list(range(len(nbytes)))
    for bucket in buckets:
        assert len(bucket) == 1 or sum(nbytes[i] for i in bucket) <= cap * 2**20


def test_the_old_names_still_import():
    from llmsys.ddp import DataParallel, DataParallelBase, plan_buckets

    assert plan_buckets is group_buckets
    assert DataParallel is DataParallelBase
