"""The bucket plan alone: a pure function of sizes, the same on every rank."""

import pytest

from llmsys.ddp import plan_buckets

MIB = 2**20


def test_reverse_registration_order_under_the_cap():
    # Four parameters of 1 MiB under a 2 MiB cap: the last registered go first.
    assert plan_buckets([MIB] * 4, 2.0) == [[3, 2], [1, 0]]


def test_a_parameter_larger_than_the_cap_gets_its_own_bucket():
    sizes = [MIB, 5 * MIB, MIB, MIB]
    assert plan_buckets(sizes, 2.0) == [[3, 2], [1], [0]]


def test_every_parameter_exactly_once_and_no_bucket_over_the_cap():
    sizes = [(i * 7919) % 3001 + 1 for i in range(200)]  # ragged sizes, deterministic
    for cap_mb in (1e-9, 0.001, 0.01, 1.0):
        plan = plan_buckets(sizes, cap_mb)
        assert sorted(i for bucket in plan for i in bucket) == list(range(200))
        assert [i for bucket in plan for i in bucket] == list(reversed(range(200)))
        for bucket in plan:
            assert len(bucket) == 1 or sum(sizes[i] for i in bucket) <= cap_mb * MIB


def test_kinds_are_never_mixed():
    plan = plan_buckets([10, 10, 10, 10], 1.0, kinds=["f32", "f32", "bf16", "f32"])
    assert plan == [[3], [2], [1, 0]]


def test_one_bucket_when_everything_fits():
    assert plan_buckets([100] * 5, 1000.0) == [[4, 3, 2, 1, 0]]
    assert plan_buckets([], 25.0) == []


@pytest.mark.parametrize(
    ("args", "match"),
    [(([1], 0), r"bucket_size_mb must be > 0, got 0"),
     (([1, 2], 1.0, ["a"]), r"kinds must have one entry per parameter \(2\), got 1")],
)  # fmt: skip
def test_bad_plans_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        plan_buckets(*args)
