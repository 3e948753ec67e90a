"""Each wrapper against single-process training on the whole batch (2 gloo ranks, float64).

Every rank function below runs in its own process (the ``run_ranks`` fixture); every rank
computes the single-process reference itself, so the comparison needs no communication.
"""

from __future__ import annotations

import gc
import itertools
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from llmsys.ddp import DDPBucketed, DDPFlat, DDPIndividualParameters, DDPNaive, group_buckets
from llmsys_dev.ranks import run_in_turn

STEPS, BATCH, LR = 5, 12, 0.1  # a batch of 12 splits evenly over 1, 2 or 3 ranks


class FrozenLayer(nn.Module):
    """A frozen middle layer and a buffer: broadcast from rank 0, never reduced."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(6, 16)
        self.frozen = nn.Linear(16, 16).requires_grad_(False)
        self.last = nn.Linear(16, 3)
        self.register_buffer("scale", torch.rand(16))

    def forward(self, x):
        return self.last(torch.tanh(self.frozen(torch.tanh(self.first(x)) * self.scale)))


class TiedWeights(nn.Module):
    """The output head shares the embedding's weight: one tensor, reduced once."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


class Checkpointed(nn.Module):
    """Middle layers under activation checkpointing, one block in each mode."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(6, 16)
        self.reentrant = nn.Linear(16, 16)
        self.non_reentrant = nn.Linear(16, 16)
        self.last = nn.Linear(16, 3)

    def forward(self, x):
        h = torch.tanh(self.first(x))
        h = checkpoint(lambda t: torch.tanh(self.reentrant(t)), h, use_reentrant=True)
        h = checkpoint(lambda t: torch.tanh(self.non_reentrant(t)), h, use_reentrant=False)
        return self.last(h)


class ReusedMixedCompiled(nn.Module):
    """One layer called twice per forward (one gradient, accumulated from both uses), a float32
    layer among float64 ones (two dtypes: flat and bucketed keep them apart) and a compiled
    inner block (its parameters' hooks fire outside the compiled graph)."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(6, 6)
        self.single = nn.Linear(6, 6, dtype=torch.float32)
        self.block = torch.compile(nn.Sequential(nn.Linear(6, 8), nn.Tanh()), backend="aot_eager")
        self.last = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.shared(torch.tanh(self.shared(x))))
        h = self.single(h.float()).to(x.dtype)
        return self.last(self.block(h))


def regression_batch(generator):
    return torch.randn(BATCH, 6, generator=generator), torch.randn(BATCH, 3, generator=generator)


def token_batch(generator):
    tokens = torch.randint(0, 11, (BATCH, 5), generator=generator)
    return tokens, torch.randint(0, 11, (BATCH, 5), generator=generator)


def token_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


MODELS = {  # name: (constructor, batch maker, loss)
    "frozen": (FrozenLayer, regression_batch, F.mse_loss),
    "tied": (TiedWeights, token_batch, token_loss),
    "checkpointed": (Checkpointed, regression_batch, F.mse_loss),
    "reused, mixed dtypes, compiled": (ReusedMixedCompiled, regression_batch, F.mse_loss),
}

WRAPPERS = {
    "naive": DDPNaive,
    "flat": DDPFlat,
    "individual": DDPIndividualParameters,
    "bucketed, one per parameter": lambda m: DDPBucketed(m, bucket_size_mb=1e-9),
    "bucketed, two buckets": lambda m: DDPBucketed(m, bucket_size_mb=two_bucket_size(m)),
    "bucketed, one bucket": lambda m: DDPBucketed(m, bucket_size_mb=1000.0),
}


def two_bucket_size(model: nn.Module) -> float:
    """A cap (MiB) giving one bucket more than the dtypes force: two for a one-dtype model."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    nbytes = [p.numel() * p.element_size() for p in trainable]
    kinds = [p.dtype for p in trainable]
    fewest = len(group_buckets(nbytes, 1e6, kinds))
    for tenth in range(1, 10):
        size = sum(nbytes) * tenth / 10 / 2**20
        if len(group_buckets(nbytes, size, kinds)) == fewest + 1:
            return size
    raise AssertionError("no cap gives one bucket more than the dtypes force")


def batches(kind: str, steps: int = STEPS):
    generator = torch.Generator().manual_seed(1234)
    return [MODELS[kind][1](generator) for _ in range(steps)]


def train_single_process(kind: str, steps: int = STEPS, device="cpu") -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    make, _, loss_fn = MODELS[kind]
    model = make().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for inputs, targets in batches(kind, steps):
        optimizer.zero_grad()
        loss_fn(model(inputs.to(device)), targets.to(device)).backward()
        optimizer.step()
    return model.state_dict()


def train_data_parallel(kind, wrap, rank, world_size, steps: int = STEPS, device="cpu"):
    torch.manual_seed(rank)  # each rank initializes differently: rank 0's weights must win
    make, _, loss_fn = MODELS[kind]
    model = wrap(make().to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    mine = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    losses = []
    for inputs, targets in batches(kind, steps):
        optimizer.zero_grad()
        loss = loss_fn(model(inputs[mine].to(device)), targets[mine].to(device))
        loss.backward()
        model.finish_gradient_synchronization()
        optimizer.step()
        losses.append(loss.item())
    return model, losses


def assert_same_weights(expected, got: nn.Module, label: str, atol: float = 1e-9) -> None:
    actual = got.state_dict()
    assert actual.keys() == expected.keys(), label
    for name, value in expected.items():
        error = (actual[name] - value).abs().max().item()
        assert error <= atol, f"{label}: {name} differs from single-process training by {error}"


def check_every_wrapper(rank: int, world_size: int, kind: str, device: str = "cpu") -> None:
    torch.set_default_dtype(torch.float64)
    expected = train_single_process(kind, device=device)
    for name, wrap in WRAPPERS.items():
        model, _ = train_data_parallel(kind, wrap, rank, world_size, device=device)
        # float32 parameters carry float32 rounding of the same arithmetic
        atol = 1e-6 if any(p.dtype == torch.float32 for p in model.params) else 1e-9
        assert_same_weights(expected, model.module, f"{name} on {kind}", atol=atol)
        if name.startswith("bucketed"):
            dtypes = [p.dtype for p in model.params]
            dtype_runs = 1 + sum(a != b for a, b in itertools.pairwise(dtypes))
            planned = {"one per parameter": len(model.params), "two": dtype_runs + 1,
                       "one bucket": dtype_runs}  # fmt: skip
            count = next(n for key, n in planned.items() if key in name)
            assert len(model.buckets) == count, (name, [b.indices for b in model.buckets])


@pytest.fixture(scope="module")
def two_ranks():
    """This module's 2-rank checks, in turn in one process group (one spawn instead of 7)."""
    checks = {kind: (check_every_wrapper, {"kind": kind}) for kind in MODELS}
    checks["no_sync"] = (check_no_sync_and_unused, {})
    checks["misuse"] = (check_misuse_is_named, {})
    checks["bf16 wire"] = (check_bf16_wire, {})
    return run_in_turn(checks, world_size=2, timeout=500)


@pytest.mark.parametrize("kind", list(MODELS))
def test_matches_single_process_training(two_ranks, kind):
    two_ranks.check(kind)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(MODELS))
def test_nccl_on_two_gpus_matches_single_process_training(run_ranks, kind):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs for one NCCL rank each")
    run_ranks(check_every_wrapper, backend="nccl", kind=kind, device="cuda")


def test_three_ranks(run_ranks):
    run_ranks(check_every_wrapper, world_size=3, kind="tied", timeout=180)


def test_world_size_one_process_group(run_ranks):
    run_ranks(check_every_wrapper, world_size=1, kind="frozen")


def test_without_a_process_group_is_plain_training():
    torch.set_default_dtype(torch.float64)
    try:
        expected = train_single_process("tied")
        for name, wrap in WRAPPERS.items():
            model, _ = train_data_parallel("tied", wrap, rank=0, world_size=1)
            assert model.world_size == 1
            assert_same_weights(expected, model.module, name, atol=0.0)
    finally:
        torch.set_default_dtype(torch.float32)


class Branches(nn.Module):
    """Which of two layers runs is chosen per call; a third layer is never used."""

    def __init__(self, with_unused_layer: bool = True):
        super().__init__()
        self.a = nn.Linear(6, 3)
        self.b = nn.Linear(6, 3)
        self.never = nn.Linear(6, 3) if with_unused_layer else None

    def forward(self, x, branch: str):
        return sum(getattr(self, layer)(x) for layer in branch)  # branch "a", "b" or "ab"


# Micro-batch branches per step: the used set changes between micro-batches and steps, and in
# the last step `b` is used by no micro-batch at all.
ACCUMULATION = [("a", "b"), ("b", "a"), ("a", "a")]


def accumulate_single_process() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Branches()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    generator = torch.Generator().manual_seed(7)
    for micro_batches in ACCUMULATION:
        optimizer.zero_grad()
        for branch in micro_batches:
            x, y = regression_batch(generator)
            F.mse_loss(model(x, branch), y).backward()
        optimizer.step()
    return model.state_dict()


def check_no_sync_and_unused(rank: int, world_size: int) -> None:
    torch.set_default_dtype(torch.float64)
    expected = accumulate_single_process()
    mine = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    for name, wrap in WRAPPERS.items():
        torch.manual_seed(0)
        model = wrap(Branches())
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        generator = torch.Generator().manual_seed(7)
        for *early, last in ACCUMULATION:
            optimizer.zero_grad()
            with model.no_sync():
                for branch in early:
                    x, y = regression_batch(generator)
                    F.mse_loss(model(x[mine], branch), y[mine]).backward()
                model.finish_gradient_synchronization()  # inside no_sync: does nothing
            x, y = regression_batch(generator)
            F.mse_loss(model(x[mine], last), y[mine]).backward()
            model.finish_gradient_synchronization()
            assert model.module.never.weight.grad is None, name
            optimizer.step()
        assert_same_weights(expected, model.module, name)


def test_no_sync_accumulation_with_changing_and_unused_parameters(two_ranks):
    two_ranks.check("no_sync")


def check_misuse_is_named(rank: int, world_size: int) -> None:
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    for name, wrap in WRAPPERS.items():
        model = wrap(Branches())
        # Ranks take different branches: the error names both layers and who had what.
        F.mse_loss(model(x, "a" if rank == 0 else "b"), y).backward()
        with pytest.raises(RuntimeError, match=r"disagree") as error:
            model.finish_gradient_synchronization()
        message = str(error.value)
        assert "'a.weight': gradient on ranks [0], none on ranks [1]" in message, (name, message)
        assert "'b.bias': gradient on ranks [1], none on ranks [0]" in message, (name, message)
        # Rank 0 uses every parameter and does not wait for the others' flags: it raises at
        # its next call. Rank 1, missing some, learns at once that rank 0 had them.
        both = wrap(Branches(with_unused_layer=False))
        F.mse_loss(both(x, "ab" if rank == 0 else "a"), y).backward()
        disagreement = r"'b.weight': gradient on ranks \[0\], none on ranks \[1\]"
        if rank == 1:
            with pytest.raises(RuntimeError, match=disagreement):
                both.finish_gradient_synchronization()
        else:
            both.finish_gradient_synchronization()
            with pytest.raises(RuntimeError, match=disagreement):
                both.on_train_batch_start()
        # Wrapping a wrapped module again would reduce every gradient twice.
        with pytest.raises(ValueError, match=r"already wrapped by a .*remove_hooks"):
            wrap(both.module)
        both.remove_hooks()
        again = wrap(both.module)
        # A layer unfrozen after wrapping has no hook: named instead of silently not averaged.
        frozen = Branches(with_unused_layer=False)
        frozen.b.requires_grad_(False)
        late = wrap(frozen)
        frozen.b.requires_grad_(True)
        F.mse_loss(late(x, "ab"), y).backward()
        with pytest.raises(RuntimeError, match=r"\['b.weight', 'b.bias'\] have gradients but"):
            late.finish_gradient_synchronization()
        again.remove_hooks()
        # A wrapper and its model, dropped, are freed (the registry of wrapped modules holds
        # neither).
        dropped = wrap(Branches(with_unused_layer=False))
        inner, wrapper = weakref.ref(dropped.module), weakref.ref(dropped)
        del dropped
        gc.collect()
        assert inner() is None and wrapper() is None, name
        # Two backwards in one synchronized step (no no_sync): named, no hang.
        model.zero_grad(set_to_none=True)
        model.on_train_batch_start()
        F.mse_loss(model(x, "a"), y).backward()
        with pytest.raises(RuntimeError, match=r"'a\.(weight|bias)' received a second gradient"):
            F.mse_loss(model(x, "a"), y).backward()
        # The wrapper recovers for the next step.
        model.zero_grad(set_to_none=True)
        model.on_train_batch_start()
        F.mse_loss(model(x, "b"), y).backward()
        model.finish_gradient_synchronization()
        assert model.module.b.weight.grad is not None, name
    with pytest.raises(ValueError, match=r"same model.*rank 1"):
        DDPNaive(nn.Linear(6, 3 if rank == 0 else 4))


def test_misuse_gets_errors_naming_parameters_not_hangs(two_ranks):
    two_ranks.check("misuse")


def check_bf16_wire(rank: int, world_size: int) -> None:
    steps = 20
    reference, reference_losses = train_data_parallel(
        "frozen", DDPBucketed, rank, world_size, steps=steps
    )
    compressed, losses = train_data_parallel(
        "frozen", lambda m: DDPBucketed(m, grad_dtype=torch.bfloat16), rank, world_size, steps
    )
    expected_losses = torch.tensor(reference_losses)
    # bf16 keeps 8 bits of mantissa: the loss curve follows the float32 one within 1%.
    assert torch.allclose(torch.tensor(losses), expected_losses, rtol=1e-2), (
        losses,
        expected_losses,
    )
    for (name, a), b in zip(
        reference.module.state_dict().items(), compressed.module.state_dict().values(), strict=True
    ):
        assert torch.allclose(a, b, rtol=2e-2, atol=2e-3), name
        assert b.dtype == torch.float32, name
    # bf16 on the wire, the mean written back in the gradients' dtype.
    assert {b.buffer.dtype for b in compressed.buckets} == {torch.bfloat16}
    assert all(p.grad.dtype == torch.float32 for p in compressed.params)


def test_bf16_gradients_on_the_wire_follow_the_float32_loss_curve(two_ranks):
    two_ranks.check("bf16 wire")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(bucket_size_mb=0), ValueError, r"bucket_size_mb must be a finite number > 0, got 0"),
        (dict(bucket_size_mb=float("nan")), ValueError, r"bucket_size_mb must be a finite .*nan"),
        (dict(bucket_size_mb=float("inf")), ValueError, r"bucket_size_mb must be a finite .*inf"),
        (dict(bucket_size_mb="25"), TypeError, r"bucket_size_mb must be a number, got str"),
        (dict(grad_dtype=torch.int8), TypeError, r"grad_dtype must be None or a floating"),
    ],
)
def test_bucketed_arguments_are_checked(kwargs, error, match):
    with pytest.raises(error, match=match):
        DDPBucketed(nn.Linear(2, 2), **kwargs)


@pytest.mark.parametrize("wrapper", [DDPNaive, DDPFlat, DDPIndividualParameters, DDPBucketed])
def test_module_must_be_a_module(wrapper):
    with pytest.raises(TypeError, match=r"module must be a torch.nn.Module, got function"):
        wrapper(lambda x: x)
