"""The distributed test launcher: results, failures with tracebacks, timeouts instead of hangs."""

import time

import pytest
import torch
import torch.distributed as dist

from llmsys_dev.ranks import RankFailure, run_in_turn, run_ranks


def sums_ranks(rank: int, world_size: int, scale: int) -> None:
    total = torch.tensor([float(rank * scale)])
    dist.all_reduce(total)
    assert total.item() == scale * sum(range(world_size))
    assert dist.get_backend() == "gloo"


def fails_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("planted failure on rank one")
    dist.barrier()  # rank 0 now waits for a peer that will never come


def sleeps(rank: int, world_size: int) -> None:
    time.sleep(60)


def test_every_rank_runs_the_function_in_the_process_group():
    run_ranks(sums_ranks, world_size=2, scale=3)


def test_a_failing_rank_fails_the_run_with_its_traceback_and_does_not_hang():
    started = time.monotonic()
    with pytest.raises(
        RankFailure, match=r"(?s)rank\(s\) \[(0, )?1\] failed.*planted failure on rank one"
    ):
        run_ranks(fails_on_rank_one, world_size=2, timeout=120)
    assert time.monotonic() - started < 60  # the stuck peer was killed, not waited for


def test_a_run_past_the_timeout_is_killed_and_fails():
    with pytest.raises(RankFailure, match=r"still running after the 8 s timeout; killed"):
        run_ranks(sleeps, world_size=2, timeout=8)


def test_only_module_level_functions():
    with pytest.raises(TypeError, match="module-level function"):
        run_ranks(lambda rank, world_size: None)


def keeps_its_start_then_changes_it(rank: int, world_size: int, folder: str) -> None:
    torch.save(torch.random.get_rng_state(), f"{folder}/start{rank}.pt")
    torch.set_default_dtype(torch.float64)
    torch.randn(100)


def starts_where_the_first_started(rank: int, world_size: int, folder: str) -> None:
    assert torch.get_default_dtype() == torch.float32
    assert torch.equal(torch.random.get_rng_state(), torch.load(f"{folder}/start{rank}.pt"))
    sums_ranks(rank, world_size, scale=2)


def test_checks_in_turn_each_start_from_a_fresh_state_and_fail_alone(tmp_path):
    folder = {"folder": str(tmp_path)}
    checks = {
        "changes state": (keeps_its_start_then_changes_it, folder),
        "fresh state": (starts_where_the_first_started, folder),
        "fails": (fails_on_rank_one, {}),
        "after the failure": (sums_ranks, {"scale": 5}),  # in a fresh group
    }
    results = run_in_turn(checks, world_size=2, timeout=120)
    for name in ("changes state", "fresh state", "after the failure"):
        results.check(name)  # passes: the failure stopped only its own check
    with pytest.raises(
        RankFailure,
        match=r"(?s)check 'fails' failed \(after \['changes state', 'fresh state'\].*planted",
    ):
        results.check("fails")
    with pytest.raises(KeyError, match="no check named 'other'"):
        results.check("other")
