"""The sharding plan alone: a pure function of element counts and the world size."""

import random

import pytest

import llmsys.sharded_optim as so
from llmsys.sharded_optim import ShardPlan, plan_shards


def test_version_is_exported():
    assert so.__version__ and "__version__" in so.__all__


def test_sorted_greedy_places_largest_first_on_least_loaded_rank():
    plan = plan_shards([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], world_size=3)
    # 12, 11, 10 open the three ranks; 9 joins the 10 (lightest), 8 the 11, 7 the 12, ...
    assert plan.owners == (0, 1, 2, 2, 1, 0, 0, 1, 2, 2, 1, 0)
    assert plan.loads == (26, 26, 26)
    assert [plan.params_of(r) for r in range(3)] == [[0, 5, 6, 11], [1, 4, 7, 10], [2, 3, 8, 9]]


def test_ties_go_to_the_lower_index_and_the_lower_rank():
    assert plan_shards([5, 5, 5, 5], world_size=2).owners == (0, 1, 0, 1)
    assert plan_shards([0, 0, 3], world_size=2).owners == (1, 1, 0)  # 3 first, then the zeros


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7, 8])
def test_largest_load_is_within_the_bound(world_size):
    rng = random.Random(world_size)
    for _ in range(50):
        numels = [rng.choice([0, 1, 7, 64, 1000, 4096, 65537]) for _ in range(rng.randint(0, 40))]
        plan = plan_shards(numels, world_size)
        assert sum(plan.loads) == sum(numels) and len(plan.owners) == len(numels)
        assert all(0 <= owner < world_size for owner in plan.owners)
        bound = sum(numels) / world_size + max(numels, default=0)
        assert max(plan.loads) <= bound, (numels, plan.loads)
        for rank in range(world_size):  # loads agree with owners
            assert plan.loads[rank] == sum(numels[i] for i in plan.params_of(rank))


def test_a_transformer_like_model_is_balanced_within_one_percent():
    # Embedding and head 16M, 48 blocks of 7.7M + 2.6M + 3 x 10.2M, norms of 1600: the xl LM.
    numels = [16_000_000]
    for _ in range(48):
        numels += [1600, 7_680_000, 2_560_000, 1600, 10_240_000, 10_240_000, 10_240_000]
    numels += [1600, 16_000_000]
    for world_size in (2, 4, 8):
        loads = plan_shards(numels, world_size).loads
        assert max(loads) / (sum(numels) / world_size) < 1.01, loads


def test_the_plan_is_deterministic():
    numels = [random.Random(0).randint(0, 100) for _ in range(100)]
    assert plan_shards(numels, 4) == plan_shards(list(numels), 4)


def test_world_size_one_owns_everything():
    plan = plan_shards([3, 1, 2], world_size=1)
    assert plan.owners == (0, 0, 0) and plan.loads == (6,)


def test_extend_places_new_parameters_around_the_current_loads():
    plan = plan_shards([10, 4], world_size=2)  # loads (10, 4)
    extended = plan.extend([5, 2])
    assert extended.owners == (0, 1, 1, 1)  # 5 to the 4 -> (10, 9), then 2 to the 9
    assert extended.loads == (10, 11)
    assert plan.owners == (0, 1)  # frozen: the old plan is unchanged


def test_extend_keeps_the_bound():
    rng = random.Random(1)
    plan = ShardPlan(world_size=3)
    numels: list[int] = []
    for _ in range(10):
        new = [rng.randint(0, 500) for _ in range(rng.randint(0, 6))]
        plan, numels = plan.extend(new), numels + new
        assert max(plan.loads) <= sum(numels) / 3 + max(numels, default=0)


@pytest.mark.parametrize("world_size", [0, -1, 1.0, True, "2"])
def test_world_size_must_be_a_positive_int(world_size):
    with pytest.raises(ValueError, match=r"`world_size` must be a positive int, got"):
        plan_shards([1], world_size)


@pytest.mark.parametrize("numel", [-1, 2.0, None, False])
def test_numels_must_be_non_negative_ints(numel):
    with pytest.raises(
        ValueError, match=r"`numels` must hold non-negative ints, got .* position 1"
    ):
        plan_shards([1, numel], 2)
