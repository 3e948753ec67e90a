"""What works with what: each rewrite of a model beside each operation a user applies to one.

One table, ``COMPATIBILITY``, says for every (operation, rewrite) pair whether it works or how
it is refused; the tests below check every cell on tiny Llama, Mistral and Qwen2 models on the
CPU (the data-parallel wrappers on 2 gloo ranks, with the profiling ``TransformerLM`` beside
them), and the ``hf`` README shows the same table (``test_the_readme_shows_this_table``). A new
part adds one row (an operation) or one column (a rewrite).

"works" means: a model that trains (``apply_llmsys``) gives stock's loss and gradients, or the
same parameters after two steps under a data-parallel wrapper as one process on the whole batch;
a model that serves (the int8 rewrites) gives the logits (or tokens) of the same rewritten model
without the operation. A refusal is the error the table names, raised at the call.
"""

from __future__ import annotations

import copy
import io
import re
import warnings
from functools import partial
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from hf_models import FAMILIES, batch, build
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from llmsys.hf import apply_llmsys, generate, quantize_model
from llmsys.kernels_int8 import quantize_linears
from llmsys_dev.ranks import run_in_turn

REWRITES = {
    "apply_llmsys": apply_llmsys,
    "quantize_model": quantize_model,
    "quantize_linears": quantize_linears,
}
TRAINS = {"apply_llmsys"}  # the others serve (inference only)


class Refused(NamedTuple):
    error: type[Exception]
    match: str  # a regex of the message
    why: str  # the README's words


WORKS = None
INFERENCE_ONLY = Refused(RuntimeError, r"is inference-only", "refused: inference only")
QUANTIZED = Refused(ValueError, r"quantized already", "refused: quantized already")
NOTHING_TO_SWAP = Refused(
    ValueError, r"must select at least one nn\.Linear", "refused: no nn.Linear left"
)


def serving(cell=WORKS):
    return {"apply_llmsys": cell, "quantize_model": WORKS, "quantize_linears": WORKS}


def training(cell=WORKS):
    return {
        "apply_llmsys": cell,
        "quantize_model": INFERENCE_ONLY,
        "quantize_linears": INFERENCE_ONLY,
    }


# operation -> {rewrite: WORKS or Refused}
COMPATIBILITY = {
    "torch.compile": serving(),
    "torch.save / torch.load": serving(),
    "state_dict() into a fresh model": serving(),
    "copy.deepcopy": serving(),
    ".to(torch.bfloat16)": serving(),
    "generate": serving(),  # the static cache read by flash-attn2 after either rewrite
    "LoRA-style adapters on the linears, before": {
        "apply_llmsys": WORKS,
        "quantize_model": Refused(
            ValueError, r"q_proj is LoRALinear, not nn\.Linear", "refused: names the adapter"
        ),
        "quantize_linears": WORKS,  # the adapters' own linears become int8
    },
    "then apply_llmsys": {
        "apply_llmsys": WORKS,  # a second call: nothing left to replace, a warning
        "quantize_model": QUANTIZED,
        "quantize_linears": QUANTIZED,
    },
    "then quantize_model": {
        "apply_llmsys": Refused(ValueError, r"rewritten by apply_llmsys", "refused: trained model"),
        "quantize_model": QUANTIZED,
        "quantize_linears": QUANTIZED,
    },
    "then quantize_linears": {
        "apply_llmsys": WORKS,  # serves: the int8 linears, the rest of apply_llmsys's kernels
        "quantize_model": NOTHING_TO_SWAP,
        "quantize_linears": NOTHING_TO_SWAP,
    },
    "gradient checkpointing (full)": training(),
    "gradient checkpointing (selective)": training(),
    "DDPBucketed, 2 ranks": training(),
    "DDPBucketed + ShardedOptimizer, 2 ranks": training(),
    "FSDP, 2 ranks": training(),
}
DISTRIBUTED = [op for op in COMPATIBILITY if op.endswith("2 ranks")]


# --- the models and what is compared ---------------------------------------------------------


def tiny(family: str = "llama") -> nn.Module:
    """The hf tests' tiny model with one decoder layer: the kernels run under Triton's
    interpreter, and every pair builds a few."""
    return build(family, num_hidden_layers=1)


def rewritten(rewrite: str, family: str = "llama") -> nn.Module:
    model = tiny(family)
    REWRITES[rewrite](model)
    return model


def logits(model: nn.Module) -> torch.Tensor:
    tokens, _ = batch()
    with torch.no_grad():
        return model(tokens, use_cache=False).logits.float()


def loss_and_grads(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    tokens, labels = batch()
    model.zero_grad()
    loss = model(tokens, labels=labels, use_cache=False).loss
    loss.backward()
    grads = {n.removeprefix("_orig_mod."): p.grad for n, p in model.named_parameters()}
    return loss.detach(), {n: g for n, g in grads.items() if g is not None}


def assert_same_training(got: nn.Module, expected: nn.Module) -> None:
    loss, grads = loss_and_grads(got)
    want_loss, want_grads = loss_and_grads(expected)
    torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=1e-5)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def assert_same(got: nn.Module, expected: nn.Module, rewrite: str, atol: float = 1e-5) -> None:
    """``got`` behaves as ``expected``: for a training rewrite the loss and gradients, for a
    serving one the logits."""
    if rewrite in TRAINS:
        assert_same_training(got, expected)
    else:
        torch.testing.assert_close(logits(got), logits(expected), atol=atol, rtol=1e-4)


def reference(rewrite: str, family: str) -> nn.Module:
    """What a pair must match: stock for a training rewrite, the same rewrite for serving."""
    return tiny(family) if rewrite in TRAINS else rewritten(rewrite, family)


# --- one check per operation ------------------------------------------------------------------


def check_compile(rewrite, family):
    model = rewritten(rewrite, family)
    assert_same(torch.compile(model, backend="aot_eager"), reference(rewrite, family), rewrite)


def check_save_load(rewrite, family):
    model = rewritten(rewrite, family)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded.model.layers[0]) is type(model.model.layers[0])
    assert_same(loaded, reference(rewrite, family), rewrite)


def check_state_dict(rewrite, family):
    model = rewritten(rewrite, family)
    fresh = [rewritten(rewrite, family)] + ([tiny(family)] if rewrite in TRAINS else [])
    for target in fresh:  # a model rewritten the same way; stock too for a training rewrite
        with torch.no_grad():  # what the state dict holds, zeroed (rotary's table stays)
            for tensor in target.state_dict().values():
                if tensor.is_floating_point():
                    tensor.zero_()
        target.load_state_dict(model.state_dict())
        assert_same(target, reference(rewrite, family), rewrite)


def check_deepcopy(rewrite, family):
    assert_same(copy.deepcopy(rewritten(rewrite, family)), reference(rewrite, family), rewrite)


def check_to_bfloat16(rewrite, family):
    model = rewritten(rewrite, family).to(torch.bfloat16)
    expected = reference(rewrite, family)
    if rewrite in TRAINS:
        expected = expected.to(torch.bfloat16)
        loss, _ = loss_and_grads(model)
        torch.testing.assert_close(loss, loss_and_grads(expected)[0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(logits(model), logits(expected), atol=5e-2, rtol=5e-2)


def greedy(model: nn.Module, prompt: torch.Tensor, new: int) -> torch.Tensor:
    ids = prompt
    for _ in range(new):
        ids = torch.cat([ids, logits_of(model, ids)[:, -1:].argmax(-1)], dim=1)
    return ids


def logits_of(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def check_generate(rewrite, family):
    model = rewritten(rewrite, family).eval()
    prompt = batch()[0][:, :4]
    assert torch.equal(generate(model, prompt, 3), greedy(reference(rewrite, family), prompt, 3))


class LoRALinear(nn.Module):
    """A PEFT-style adapter: the frozen linear plus a low-rank update."""

    def __init__(self, base: nn.Linear, rank: int = 2):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.up.weight, std=0.1)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


def with_adapters(model: nn.Module) -> nn.Module:
    torch.manual_seed(3)
    for layer in model.model.layers:
        layer.self_attn.q_proj = LoRALinear(layer.self_attn.q_proj)
        layer.self_attn.v_proj = LoRALinear(layer.self_attn.v_proj)
    return model


def check_adapters(rewrite, family):
    model = with_adapters(tiny(family))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantize_model warns it swaps those layers' linears
        REWRITES[rewrite](model)
    if rewrite in TRAINS:
        assert_same(model, with_adapters(tiny(family)), rewrite)
    else:  # int8 weights: within quantization's error of the float model
        expected = with_adapters(tiny(family))
        torch.testing.assert_close(logits(model), logits(expected), atol=0.15, rtol=0.1)


def check_then(second: str, rewrite, family):
    model = rewritten(rewrite, family)
    if second == rewrite == "apply_llmsys":
        with pytest.warns(UserWarning, match="nothing left to replace"):
            assert not any(apply_llmsys(model).values())
        assert_same(model, reference(rewrite, family), rewrite)
        return
    before = logits(model)
    REWRITES[second](model)
    after_stock = rewritten(second, family)  # the int8 linears alone, stock's layers
    torch.testing.assert_close(logits(model), logits(after_stock), atol=1e-4, rtol=1e-4)
    assert not torch.equal(logits(model), before)


class CountedForward:
    """Counts the calls of each decoder layer's MLP (its class's forward, which a checkpoint's
    recomputation calls again)."""

    def __init__(self, monkeypatch, model):
        self.calls = 0
        cls = type(model.model.layers[0].mlp)
        forward = cls.forward

        def counted(module, *args, **kwargs):
            self.calls += 1
            return forward(module, *args, **kwargs)

        monkeypatch.setattr(cls, "forward", counted)


def check_checkpointing(selective: bool, rewrite, family, monkeypatch):
    model = rewritten(rewrite, family).train()
    options = {"use_reentrant": False}
    if selective:  # keep the matmuls' outputs, recompute the rest

        def policy(ctx, op, *args, **kwargs):
            if op is torch.ops.aten.mm.default:
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        options["context_fn"] = partial(create_selective_checkpoint_contexts, policy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers: the method's new name, use_cache off
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
    counter = CountedForward(monkeypatch, model)
    expected = reference(rewrite, family).train()
    assert_same_training(model, expected)
    layers = len(model.model.layers)
    assert counter.calls == 2 * layers, f"{counter.calls} MLP calls: no layer was recomputed"


CHECKS = {
    "torch.compile": check_compile,
    "torch.save / torch.load": check_save_load,
    "state_dict() into a fresh model": check_state_dict,
    "copy.deepcopy": check_deepcopy,
    ".to(torch.bfloat16)": check_to_bfloat16,
    "generate": check_generate,
    "LoRA-style adapters on the linears, before": check_adapters,
    "then apply_llmsys": partial(check_then, "apply_llmsys"),
    "then quantize_model": partial(check_then, "quantize_model"),
    "then quantize_linears": partial(check_then, "quantize_linears"),
    "gradient checkpointing (full)": partial(check_checkpointing, False),
    "gradient checkpointing (selective)": partial(check_checkpointing, True),
}
SINGLE = [(op, rw) for op in CHECKS for rw in REWRITES]
# Every pair on Llama; on Mistral (a sliding window) and Qwen2 (biases) the pairs that rebuild
# or re-run the rewritten classes.
EVERY_FAMILY = ("torch.save / torch.load", "gradient checkpointing (full)")
CASES = [(op, rw, "llama") for op, rw in SINGLE] + [
    (op, rw, family)
    for op, rw in SINGLE
    if op in EVERY_FAMILY
    for family in FAMILIES
    if family != "llama"
]


def outcome_of(operation: str, rewrite: str, run) -> None:
    cell = COMPATIBILITY[operation][rewrite]
    if cell is WORKS:
        run()
    else:
        with pytest.raises(cell.error, match=cell.match):
            run()


@pytest.mark.parametrize(("operation", "rewrite", "family"), CASES)
def test_pair(operation, rewrite, family, monkeypatch):
    check = CHECKS[operation]
    if operation.startswith("gradient checkpointing"):
        check = partial(check, monkeypatch=monkeypatch)
    outcome_of(operation, rewrite, lambda: check(rewrite, family))


# --- the data-parallel wrappers, 2 gloo ranks ------------------------------------------------

STEPS = 2


def train_steps(model, optimizer, tokens, labels, finish=None):
    for _ in range(STEPS):
        optimizer.zero_grad()
        model(tokens, labels=labels).loss.backward()
        if finish is not None:
            finish()
        optimizer.step()


def check_wrapper(rank, world_size, operation, rewrite, device="cpu"):
    from llmsys.ddp import FSDP, DDPBucketed
    from llmsys.sharded_optim import ShardedOptimizer

    tokens, labels = (t.to(device) for t in batch(ignored=False))  # as many labels per rank
    mine = slice(rank * len(tokens) // world_size, (rank + 1) * len(tokens) // world_size)
    expected = tiny("llama").to(device)
    train_steps(expected, torch.optim.SGD(expected.parameters(), lr=0.1), tokens, labels)

    def run():
        model = rewritten(rewrite).to(device)
        if operation.startswith("FSDP"):
            wrapped = FSDP(model)
            optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        else:
            wrapped = DDPBucketed(model)
            params = wrapped.parameters()
            optimizer = (
                ShardedOptimizer(params, torch.optim.SGD, lr=0.1)
                if "ShardedOptimizer" in operation
                else torch.optim.SGD(params, lr=0.1)
            )
        finish = wrapped.finish_gradient_synchronization
        train_steps(wrapped, optimizer, tokens[mine], labels[mine], finish)
        full = wrapped.gather_full_params() if operation.startswith("FSDP") else None
        for name, param in expected.named_parameters():
            got = full[name] if full is not None else model.get_parameter(name)
            torch.testing.assert_close(got, param, atol=1e-5, rtol=1e-4, msg=name)

    outcome_of(operation, rewrite, run)


def check_profiling_model(rank, world_size, operation, device="cpu"):
    """The profiling TransformerLM with its fused loss (which reads the output layer's weight
    in the model's forward) under each wrapper trains as one process."""
    from llmsys.ddp import FSDP, DDPBucketed
    from llmsys.profiling.config import ModelConfig
    from llmsys.profiling.model import TransformerLM
    from llmsys.sharded_optim import ShardedOptimizer

    config = ModelConfig(
        vocab_size=61, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=64,
        loss="fused",
    )  # fmt: skip
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 61, (4, 16), generator=generator).to(device)
    targets = torch.randint(0, 61, (4, 16), generator=generator).to(device)
    mine = slice(rank * 2, rank * 2 + 2)
    torch.manual_seed(0)
    expected = TransformerLM(config).to(device)
    optimizer = torch.optim.SGD(expected.parameters(), lr=0.1)
    for _ in range(STEPS):
        optimizer.zero_grad()
        expected(tokens, targets).backward()
        optimizer.step()
    torch.manual_seed(0)
    model = TransformerLM(config).to(device)
    wrapped = FSDP(model) if operation.startswith("FSDP") else DDPBucketed(model)
    optimizer = (
        ShardedOptimizer(wrapped.parameters(), torch.optim.SGD, lr=0.1)
        if "ShardedOptimizer" in operation
        else torch.optim.SGD(wrapped.parameters(), lr=0.1)
    )
    for _ in range(STEPS):
        optimizer.zero_grad()
        wrapped(tokens[mine], targets[mine]).backward()
        wrapped.finish_gradient_synchronization()
        optimizer.step()
    full = wrapped.gather_full_params() if operation.startswith("FSDP") else None
    for name, param in expected.named_parameters():
        got = full[name] if full is not None else model.get_parameter(name)
        torch.testing.assert_close(got, param, atol=1e-5, rtol=1e-4, msg=name)


def test_the_wrapper_pairs_on_two_gloo_ranks():
    """Every wrapper pair in one process group (one spawn: xdist would start a group per
    worker); a failed check names its pair with every rank's traceback."""
    checks = {
        f"{op} | {rw}": (check_wrapper, {"operation": op, "rewrite": rw})
        for op in DISTRIBUTED
        for rw in REWRITES
    }
    checks |= {
        f"{op} | profiling": (check_profiling_model, {"operation": op}) for op in DISTRIBUTED
    }
    ranks = run_in_turn(checks, world_size=2, timeout=600)
    failures = []
    for name in checks:
        try:
            ranks.check(name)
        except AssertionError as failure:
            failures.append(str(failure))
    assert not failures, "\n\n".join(failures)


@pytest.mark.gpu
def test_training_pairs_under_nccl_on_two_gpus():
    """The wrappers' training pairs (``apply_llmsys`` and the profiling model) with NCCL, one
    GPU per rank, the kernels compiled by Triton."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs for one NCCL rank each")
    checks = {}
    for op in DISTRIBUTED:
        checks[f"{op} | apply_llmsys"] = (
            check_wrapper, {"operation": op, "rewrite": "apply_llmsys", "device": "cuda"}
        )  # fmt: skip
        checks[f"{op} | profiling"] = (check_profiling_model, {"operation": op, "device": "cuda"})
    ranks = run_in_turn(checks, world_size=2, timeout=600, backend="nccl")
    for name in checks:
        ranks.check(name)


@pytest.mark.gpu
@pytest.mark.parametrize("rewrite", ["quantize_model", "quantize_linears"])
def test_generate_replays_a_cuda_graph_after_the_int8_rewrites(rewrite):
    """``generate``'s CUDA-graph decode over each serving rewrite: the tokens of the same model
    decoding eagerly without a cache."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = tiny("llama").to("cuda", torch.float16).eval()
    REWRITES[rewrite](model)
    prompt = batch()[0][:, :4].cuda()
    got = generate(model, prompt, 4, cuda_graph=True)
    assert torch.equal(got, greedy(model, prompt, 4))


# --- the README ---------------------------------------------------------------------------------


def rendered_table() -> str:
    header = ["", *REWRITES]
    rows = [header, ["---"] + ["---"] * len(REWRITES)]
    for operation, cells in COMPATIBILITY.items():
        rows.append([operation] + ["works" if c is WORKS else c.why for c in cells.values()])
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def test_the_readme_shows_this_table():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    found = re.search(r"<!-- compatibility -->\n(.*?)\n<!-- /compatibility -->", readme, re.S)
    assert found, "the hf README has no <!-- compatibility --> table"
    assert found.group(1) == rendered_table(), "regenerate it: print(rendered_table())"
