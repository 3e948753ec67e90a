"""Parameter ownership alone: a pure function of element counts and the world size."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import llmsys.sharded_optim as so
from llmsys.sharded_optim import Ownership, assign_owners


def test_version_is_exported():
    assert so.__version__ and "__version__" in so.__all__


def test_sorted_greedy_places_largest_first_on_least_loaded_rank():
    ownership = assign_owners([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], world_size=3)
    # 12, 11, 10 open the three ranks; 9 joins the 10 (lightest), 8 the 11, 7 the 12, ...
    assert ownership.owners == (0, 1, 2, 2, 1, 0, 0, 1, 2, 2, 1, 0)
    assert ownership.loads == (26, 26, 26)
    assert [ownership.params_of(r) for r in range(3)] == [
        [0, 5, 6, 11],
        [1, 4, 7, 10],
        [2, 3, 8, 9],
    ]


def test_ties_go_to_the_lower_index_and_the_lower_rank():
    assert assign_owners([5, 5, 5, 5], world_size=2).owners == (0, 1, 0, 1)
    assert assign_owners([0, 0, 3], world_size=2).owners == (1, 1, 0)  # 3 first, then the zeros


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7, 8])
def test_largest_load_is_within_the_bound(world_size):
    rng = random.Random(world_size)
    for _ in range(50):
        numels = [rng.choice([0, 1, 7, 64, 1000, 4096, 65537]) for _ in range(rng.randint(0, 40))]
        ownership = assign_owners(numels, world_size)
        assert sum(ownership.loads) == sum(numels) and len(ownership.owners) == len(numels)
        assert all(0 <= owner < world_size for owner in ownership.owners)
        bound = sum(numels) / world_size + max(numels, default=0)
        assert max(ownership.loads) <= bound, (numels, ownership.loads)
        for rank in range(world_size):  # loads agree with owners
            assert ownership.loads[rank] == sum(numels[i] for i in ownership.params_of(rank))


def test_a_transformer_like_model_is_balanced_within_one_percent():
    # Embedding and head 16M, 48 blocks of 7.7M + 2.6M + 3 x 10.2M, norms of 1600: the xl LM.
    numels = [16_000_000]
    for _ in range(48):
        numels += [1600, 7_680_000, 2_560_000, 1600, 10_240_000, 10_240_000, 10_240_000]
    numels += [1600, 16_000_000]
    for world_size in (2, 4, 8):
        loads = assign_owners(numels, world_size).loads
        assert max(loads) / (sum(numels) / world_size) < 1.01, loads


def test_the_owners_are_deterministic():
    numels = [random.Random(0).randint(0, 100) for _ in range(100)]
    assert assign_owners(numels, 4) == assign_owners(list(numels), 4)


def test_world_size_one_owns_everything():
    ownership = assign_owners([3, 1, 2], world_size=1)
    assert ownership.owners == (0, 0, 0) and ownership.loads == (6,)


def test_extend_places_new_parameters_around_the_current_loads():
    ownership = assign_owners([10, 4], world_size=2)  # loads (10, 4)
    extended = ownership.extend([5, 2])
    assert extended.owners == (0, 1, 1, 1)  # 5 to the 4 -> (10, 9), then 2 to the 9
    assert extended.loads == (10, 11)
    assert ownership.owners == (0, 1)  # frozen: the old ownership is unchanged


def test_extend_keeps_the_bound():
    rng = random.Random(1)
    ownership = Ownership(world_size=3)
    numels: list[int] = []
    for _ in range(10):
        new = [rng.randint(0, 500) for _ in range(rng.randint(0, 6))]
        ownership, numels = ownership.extend(new), numels + new
        assert max(ownership.loads) <= sum(numels) / 3 + max(numels, default=0)


@pytest.mark.parametrize("world_size", [0, -1, 1.0, True, "2"])
def test_world_size_must_be_a_positive_int(world_size):
    with pytest.raises(ValueError, match=r"`world_size` must be a positive int, got"):
        assign_owners([1], world_size)


@pytest.mark.parametrize("numel", [-1, 2.0, None, False])
def test_numels_must_be_non_negative_ints(numel):
    with pytest.raises(
        ValueError, match=r"`numels` must hold non-negative ints, got .* position 1"
    ):
        assign_owners([1, numel], 2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"owners": (0, 5)}, r"`owners` must hold ranks in 0..1 \(world_size=2\), got 5 at"),
        ({"owners": (0, -1)}, r"`owners` must hold ranks in 0..1 .* got -1"),
        ({"owners": (0, 1.0)}, r"`owners` must hold ranks in 0..1 .* got 1.0"),
        ({"owners": (0,), "loads": (1, 2, 3)}, r"`loads` must have one entry per rank \(2\)"),
        ({"loads": (1, -2)}, r"`loads` must hold non-negative ints, got -2 for rank 1"),
        ({"loads": (1, float("nan"))}, r"`loads` must hold non-negative ints, got nan"),
    ],
)  # fmt: skip
def test_an_ownership_holds_only_ranks_of_its_world(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Ownership(2, **kwargs)


def test_owners_and_loads_must_be_tuples():
    with pytest.raises(TypeError, match=r"`owners` must be a tuple of ints, got list"):
        Ownership(2, owners=[0, 1])


@pytest.mark.parametrize("rank", [2, -1, 0.0, "0", True])
def test_params_of_needs_a_rank_of_the_world(rank):
    with pytest.raises(ValueError, match=r"`rank` must be an int in 0..1, got"):
        assign_owners([3, 4], 2).params_of(rank)


@pytest.mark.parametrize("numels", [5, "12", None])
def test_numels_must_be_a_sequence(numels):
    with pytest.raises(TypeError, match=r"`numels` must be a sequence of ints"):
        assign_owners(numels, 2)


ANY_NUMBER = st.one_of(
    st.integers(-3, 10**6), st.floats(allow_nan=True, allow_infinity=True), st.booleans()
)


@settings(max_examples=50, deadline=None, database=None)
@given(numels=st.lists(ANY_NUMBER, max_size=8), world_size=st.one_of(ANY_NUMBER, st.none()))
def test_property_the_owners_are_valid_or_the_error_names_the_argument(numels, world_size):
    """Any input: owners that keep every invariant, or an error naming `numels`/`world_size`."""
    original = list(numels)
    try:
        ownership = assign_owners(numels, world_size)
    except (TypeError, ValueError) as error:
        assert "`numels`" in str(error) or "`world_size`" in str(error)
        return
    finally:
        assert numels == original  # never mutated
    assert len(ownership.owners) == len(numels)
    assert all(0 <= owner < world_size for owner in ownership.owners)
    assert sum(ownership.loads) == sum(numels)
    for rank in range(world_size):
        assert sum(numels[i] for i in ownership.params_of(rank)) == ownership.loads[rank]
    assert max(ownership.loads) <= sum(numels) / world_size + max(numels, default=0)


def test_the_old_names_still_import():
    from llmsys.sharded_optim import ShardPlan, plan_shards

    assert ShardPlan is Ownership and plan_shards is assign_owners
