"""Every distributed entry point checks its group, world and backend before anything changes
(issue 29): a wrong value is a TypeError / ValueError naming the argument, never a silent run as
rank 0 of 1."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from llmsys.ddp import (
    FSDP,
    DDPBucketed,
    DDPFlat,
    DDPIndividualParameters,
    DDPNaive,
    init_distributed,
    rank_and_world_size,
)

WRAPPERS = [DDPNaive, DDPFlat, DDPIndividualParameters, DDPBucketed, FSDP]


@pytest.fixture
def plain_run(monkeypatch):
    """A plain ``python`` run: no process group and none of torchrun's variables."""
    assert not dist.is_initialized()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("wrapper", WRAPPERS, ids=lambda w: w.__name__)
@pytest.mark.parametrize("group", ["not a group", 0, object()], ids=["str", "int", "object"])
def test_a_process_group_that_is_not_one_is_refused(wrapper, group, plain_run):
    model = nn.Linear(4, 6)
    weight = model.weight.detach().clone()
    with pytest.raises(TypeError, match=r"`process_group` must be None or a torch.distributed"):
        wrapper(model, process_group=group)
    assert torch.equal(model.weight, weight)  # FSDP did not shard it
    wrapper(model)  # and it can still be wrapped: nothing was registered


def test_rank_and_world_size(plain_run):
    assert rank_and_world_size() == (0, 1)
    with pytest.raises(TypeError, match=r"`process_group` must be None or .* got str"):
        rank_and_world_size("not a group")


@pytest.mark.parametrize("backend", ["ncll", "NCCL", "", 3])
def test_init_distributed_refuses_an_unknown_backend_even_in_a_plain_run(backend, plain_run):
    with pytest.raises(ValueError, match=r"`backend` must be None or one of \('nccl', 'gloo'\)"):
        init_distributed(backend)


def test_init_distributed_nccl_needs_cuda(plain_run, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"`backend` 'nccl' needs CUDA"):
        init_distributed("nccl")


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"RANK": "one", "WORLD_SIZE": "2"}, r"RANK must be an integer, got 'one'"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, r"0 <= RANK < WORLD_SIZE, got RANK=2 and WORLD_SIZE=2"),
    ],
)
def test_init_distributed_checks_torchruns_variables(env, match, plain_run, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        init_distributed("gloo")
    assert not dist.is_initialized()


def test_plain_run_is_still_rank_0_of_1(plain_run):
    assert init_distributed() == (0, 1)
    assert init_distributed("gloo") == (0, 1)


def group_membership_and_backend_are_checked(rank: int, world_size: int) -> None:
    only_rank_0 = dist.new_group([0])
    assert init_distributed("gloo") == (rank, world_size)
    with pytest.MonkeyPatch.context() as patch:  # a GPU host, to get past the CUDA check
        patch.setattr(torch.cuda, "is_available", lambda: True)
        with pytest.raises(ValueError, match=r"process group that already exists uses 'gloo'"):
            init_distributed("nccl")
    if rank == 0:
        assert rank_and_world_size(only_rank_0) == (0, 1)
    else:
        with pytest.raises(ValueError, match=r"`process_group` must contain this process"):
            DDPFlat(nn.Linear(2, 2), process_group=only_rank_0)


def test_a_group_without_this_rank_is_refused(run_ranks):
    run_ranks(group_membership_and_backend_are_checked)
