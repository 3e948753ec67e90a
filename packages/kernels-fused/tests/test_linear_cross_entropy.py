"""Tests for linear_cross_entropy and causal_lm_loss (CPU: the Triton row kernel runs under
TRITON_INTERPRET=1, set by the root conftest.py).

Precision contract: against a float64 reference, our loss and gradients are within twice the
error of eager PyTorch in the same dtype (``linear_cross_entropy_reference``: the matmul in the
dtype, the loss in float32), plus a small floor for ties. Under the interpreter a float32 ->
bfloat16 cast truncates instead of rounding to nearest, which the bfloat16 floor allows for;
bit-level bfloat16 checks are GPU tests.
"""

import importlib

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from llmsys.kernels_fused import (
    causal_lm_loss,
    linear_cross_entropy,
    linear_cross_entropy_reference,
)

# The package's `linear_cross_entropy` attribute is the function; the module by its full name:
lce = importlib.import_module("llmsys.kernels_fused.linear_cross_entropy")

op = torch.ops.llmsys_fused.linear_cross_entropy_fwd

N, H = 13, 16  # tokens, hidden size: odd, so chunks of 4 leave a partial one
# Floors on the error for ties (eager exact by luck), relative to the reference's largest
# magnitude (at least 1): 1 ulp. In bfloat16 the interpreter truncates where eager rounds, which
# alone can double an error (measured ratios up to 2.9 with it, under 1.7 in float32).
FLOOR = {torch.float32: 2**-23, torch.bfloat16: 2**-8, torch.float64: 1e-12}


def make_inputs(n=N, h=H, v=37, dtype=torch.float32, bias=True, ignored=(2, 7), device="cpu"):
    hidden = torch.randn(n, h, device=device).to(dtype)
    weight = (torch.randn(v, h, device=device) / h**0.5).to(dtype)
    b = torch.randn(v, device=device).to(dtype) if bias else None
    target = torch.randint(0, v, (n,), device=device)
    target[[i for i in ignored if i < n]] = -100
    return hidden, weight, target, b


def loss_and_grads(fn, hidden, weight, target, bias, grad_out=3.0, **kwargs):
    """(loss, d hidden, d weight, d bias) of ``grad_out * fn(...)`` for fresh leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight)]
    if bias is not None:
        leaves.append(bias.detach().clone().requires_grad_())
    loss = fn(leaves[0], leaves[1], target, leaves[2] if bias is not None else None, **kwargs)
    grads = torch.autograd.grad(loss * grad_out, leaves) if leaves[0].numel() else ()
    return (loss.detach(), *grads)


def float64_reference(hidden, weight, target, bias, **kwargs):
    as64 = [None if t is None else t.double() for t in (hidden, weight, bias)]
    return loss_and_grads(
        linear_cross_entropy_reference, as64[0], as64[1], target, as64[2], **kwargs
    )


def error(actual, expected) -> float:
    return (actual.double() - expected).abs().max().item() if expected.numel() else 0.0


def assert_within_twice_eager(ours, eager, exact, dtype):
    names = ("loss", "hidden", "weight", "bias")
    for name, o, e, x in zip(names[: len(ours)], ours, eager, exact, strict=True):
        assert o.dtype == e.dtype and o.shape == e.shape, name
        floor = FLOOR[dtype] * max(1.0, x.abs().max().item() if x.numel() else 1.0)
        ours_error, eager_error = error(o, x), error(e, x)
        assert ours_error <= 2 * eager_error + floor, (name, ours_error, eager_error, floor)


def check_against_eager(dtype, v=37, bias=True, ignored=(2, 7), n=N, **kwargs):
    hidden, weight, target, b = make_inputs(n=n, v=v, dtype=dtype, bias=bias, ignored=ignored)
    ours = loss_and_grads(linear_cross_entropy, hidden, weight, target, b, **kwargs)
    kwargs.pop("chunk_size", None)
    eager = loss_and_grads(linear_cross_entropy_reference, hidden, weight, target, b, **kwargs)
    exact = float64_reference(hidden, weight, target, b, **kwargs)
    assert_within_twice_eager(ours, eager, exact, dtype)
    return ours, exact


# --- precision against float64, at each chunking -------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("chunk_size", [1, 4, N, 50, None])
def test_loss_and_grads_within_twice_eager(dtype, chunk_size, poisoned_allocations):
    check_against_eager(dtype, chunk_size=chunk_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_reductions_and_label_smoothing(dtype, reduction, label_smoothing, poisoned_allocations):
    check_against_eager(
        dtype, v=100, chunk_size=5, reduction=reduction, label_smoothing=label_smoothing
    )


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_float64_is_exact(bias):
    (loss, *grads), exact = check_against_eager(torch.float64, bias=bias, chunk_size=4)
    assert loss.dtype == torch.float64
    torch.testing.assert_close((loss, *grads), tuple(exact), rtol=1e-12, atol=1e-12)


def test_label_smoothing_one():
    check_against_eager(torch.float32, label_smoothing=1.0, chunk_size=4)


def test_one_row():
    check_against_eager(torch.float32, n=1, ignored=(), chunk_size=4)


def test_several_vocabulary_blocks_match_one(monkeypatch):
    hidden, weight, target, bias = make_inputs(v=100)
    one_block = loss_and_grads(linear_cross_entropy, hidden, weight, target, bias, chunk_size=4)
    monkeypatch.setattr(lce, "MAX_BLOCK_V", 16)  # 7 blocks, the last one partial
    for smoothing in (0.0, 0.1):
        several = loss_and_grads(
            linear_cross_entropy,
            hidden,
            weight,
            target,
            bias,
            chunk_size=4,
            label_smoothing=smoothing,
        )
        expected = loss_and_grads(
            linear_cross_entropy_reference,
            hidden,
            weight,
            target,
            bias,
            label_smoothing=smoothing,
        )
        torch.testing.assert_close(several, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        one_block,
        loss_and_grads(linear_cross_entropy, hidden, weight, target, bias, chunk_size=4),
        rtol=1e-6,
        atol=1e-7,
    )


def test_eager_fallback_without_interpreter_matches(monkeypatch):
    hidden, weight, target, bias = make_inputs(v=100)
    for smoothing in (0.0, 0.1):
        kwargs = {"label_smoothing": smoothing}
        monkeypatch.setattr(lce, "CPU_RUNS_TRITON", False)
        fallback = loss_and_grads(
            linear_cross_entropy, hidden, weight, target, bias, chunk_size=4, **kwargs
        )
        monkeypatch.undo()
        expected = loss_and_grads(
            linear_cross_entropy_reference, hidden, weight, target, bias, **kwargs
        )
        torch.testing.assert_close(fallback, expected, rtol=1e-5, atol=1e-6)


def test_leading_dimensions_are_flattened():
    hidden, weight, target, bias = make_inputs(n=12)
    flat = loss_and_grads(linear_cross_entropy, hidden, weight, target, bias, chunk_size=5)
    shaped = loss_and_grads(
        linear_cross_entropy,
        hidden.view(2, 3, 2, H),
        weight,
        target.view(2, 3, 2),
        bias,
        chunk_size=5,
    )
    assert shaped[1].shape == (2, 3, 2, H)
    torch.testing.assert_close(shaped[1].reshape(12, H), flat[1])
    torch.testing.assert_close(shaped[0], flat[0])
    torch.testing.assert_close(shaped[2:], flat[2:])


def test_non_contiguous_hidden_and_weight():
    hidden, weight, target, _ = make_inputs()
    got = linear_cross_entropy(hidden.t().contiguous().t(), weight.t().contiguous().t(), target)
    hidden_t = torch.randn(H, N).t()
    assert not hidden_t.is_contiguous()
    torch.testing.assert_close(
        linear_cross_entropy(hidden_t, weight, target, chunk_size=4),
        linear_cross_entropy_reference(hidden_t, weight, target),
    )
    torch.testing.assert_close(got, linear_cross_entropy_reference(hidden, weight, target))


# --- ignored targets, empty input ----------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_targets_ignored(reduction):
    hidden, weight, target, bias = make_inputs(ignored=range(N))
    loss, *grads = loss_and_grads(
        linear_cross_entropy, hidden, weight, target, bias, chunk_size=4, reduction=reduction
    )
    expected = linear_cross_entropy_reference(hidden, weight, target, bias, reduction=reduction)
    assert torch.isnan(expected) if reduction == "mean" else expected == 0
    torch.testing.assert_close(loss, expected, equal_nan=True)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_empty_input(reduction):
    hidden, weight, target, bias = make_inputs(n=0)
    hidden.requires_grad_()
    weight.requires_grad_()
    loss = linear_cross_entropy(hidden, weight, target, bias, reduction=reduction)
    expected = linear_cross_entropy_reference(hidden, weight, target, bias, reduction=reduction)
    torch.testing.assert_close(loss, expected, equal_nan=True)  # NaN for mean, as eager
    grad_hidden, grad_weight = torch.autograd.grad(loss, (hidden, weight))
    assert grad_hidden.shape == (0, H) and torch.equal(grad_weight, torch.zeros_like(weight))


def test_ignore_index_inside_the_vocabulary():
    hidden, weight, target, bias = make_inputs(ignored=())
    target[:4] = 0
    check = loss_and_grads(linear_cross_entropy, hidden, weight, target, bias, ignore_index=0)
    expected = loss_and_grads(
        linear_cross_entropy_reference, hidden, weight, target, bias, ignore_index=0
    )
    torch.testing.assert_close(check, expected, rtol=1e-5, atol=1e-6)


# --- autograd: which inputs, scaling, double backward, autocast ---------------------------------


@pytest.mark.parametrize("needs_grad", ["hidden", "weight", "bias"])
def test_gradient_for_one_input_only(needs_grad):
    hidden, weight, target, bias = make_inputs()
    inputs = {"hidden": hidden, "weight": weight, "bias": bias}
    inputs[needs_grad].requires_grad_()
    (linear_cross_entropy(hidden, weight, target, bias, chunk_size=4) * 2).backward()
    expected = loss_and_grads(linear_cross_entropy_reference, hidden, weight, target, bias, 2.0)
    index = ["hidden", "weight", "bias"].index(needs_grad)
    torch.testing.assert_close(inputs[needs_grad].grad, expected[1 + index])
    assert all(t.grad is None for name, t in inputs.items() if name != needs_grad)


def test_no_grad_returns_the_loss_only():
    hidden, weight, target, bias = make_inputs()
    with torch.no_grad():
        loss = linear_cross_entropy(hidden.requires_grad_(), weight, target, bias)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, linear_cross_entropy_reference(hidden, weight, target, bias))


def test_grad_output_tensor_scales_the_gradients():
    hidden, weight, target, bias = make_inputs()
    ours = loss_and_grads(linear_cross_entropy, hidden, weight, target, bias, grad_out=-0.25)
    eager = loss_and_grads(linear_cross_entropy_reference, hidden, weight, target, bias, -0.25)
    torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-6)


def test_second_backward_through_the_same_graph_raises():
    hidden, weight, target, bias = make_inputs()
    weight.requires_grad_()
    loss = linear_cross_entropy(hidden, weight, target, bias)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_double_backward_raises():
    hidden, weight, target, bias = make_inputs(dtype=torch.float64)
    hidden.requires_grad_()
    loss = linear_cross_entropy(hidden, weight, target, bias)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        torch.autograd.grad(loss, hidden, create_graph=True)


def test_inputs_are_not_modified():
    hidden, weight, target, bias = make_inputs()
    before = [t.clone() for t in (hidden, weight, target, bias)]
    loss_and_grads(linear_cross_entropy, hidden, weight, target, bias, chunk_size=4)
    assert all(
        torch.equal(t, c) for t, c in zip((hidden, weight, target, bias), before, strict=True)
    )


def test_autocast_matches_eager_autocast():
    # A Hugging Face model under autocast: float32 weights, the matmul in bfloat16.
    hidden, weight, target, bias = make_inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = loss_and_grads(linear_cross_entropy, hidden, weight, target, bias, chunk_size=4)
        eager = loss_and_grads(linear_cross_entropy_reference, hidden, weight, target, bias)
    exact = float64_reference(hidden, weight, target, bias)
    assert [g.dtype for g in ours] == [torch.float32] * 4
    assert_within_twice_eager(ours, eager, exact, torch.bfloat16)


# --- the registered op ---------------------------------------------------------------------------


def test_op_returns_loss_and_gradients():
    hidden, weight, target, bias = make_inputs()
    loss, grad_hidden, grad_weight, grad_bias = op(
        hidden, weight, target, bias, -100, 0.0, "mean", 4, True, True, True
    )
    expected = loss_and_grads(linear_cross_entropy_reference, hidden, weight, target, bias, 1.0)
    torch.testing.assert_close((loss, grad_hidden, grad_weight, grad_bias), expected)
    skipped = op(hidden, weight, target, None, -100, 0.0, "sum", 4, False, False, True)
    assert [t.numel() for t in skipped[1:]] == [0, 0, 0]


def test_op_by_name_is_differentiable_and_leaves_its_outputs_alone():
    hidden, weight, target, bias = make_inputs()
    hidden.requires_grad_()
    loss, grad_hidden, *_ = op(
        hidden, weight, target, bias, -100, 0.0, "mean", 4, True, False, False
    )
    before = grad_hidden.clone()
    (got,) = torch.autograd.grad(loss * 3, hidden)
    torch.testing.assert_close(got, 3 * before)
    assert torch.equal(grad_hidden, before)


def test_op_by_name_refuses_a_gradient_it_did_not_compute():
    hidden, weight, target, bias = make_inputs()
    weight.requires_grad_()
    loss, *_ = op(hidden, weight, target, bias, -100, 0.0, "mean", 4, True, False, False)
    with pytest.raises(RuntimeError, match="weight_grad=False"):
        loss.backward()


def test_opcheck():
    hidden, weight, target, bias = make_inputs(n=5, v=11)
    hidden.requires_grad_()
    torch.library.opcheck(
        op, (hidden, weight, target, bias, -100, 0.1, "mean", 2, True, True, True)
    )


def test_compile_fullgraph_forward_and_backward():
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(linear_cross_entropy, fullgraph=True, backend=counter)
    hidden, weight, target, bias = make_inputs()
    got = loss_and_grads(compiled, hidden, weight, target, bias, chunk_size=4)
    expected = loss_and_grads(linear_cross_entropy, hidden, weight, target, bias, chunk_size=4)
    torch.testing.assert_close(got, expected)
    assert counter.frame_count == 1


# --- targets out of range ------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, 37])
def test_target_out_of_range_raises_on_cpu(bad):
    hidden, weight, target, bias = make_inputs()
    target[3] = bad
    with pytest.raises(ValueError, match=rf"`target` must hold class indices in \[0, 37\).*{bad}"):
        linear_cross_entropy(hidden, weight, target, bias)


def test_kernel_marks_a_target_out_of_range_with_nan():
    # What the GPU does (it cannot raise without a sync): NaN loss and gradients for the row.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not lce.CPU_RUNS_TRITON:
        pytest.skip("the row kernel runs on a GPU or under TRITON_INTERPRET=1 only")
    logits = torch.randn(3, 37, device=device)
    target = torch.tensor([5, 40, -100], device=device)
    losses = torch.full((3,), 7.0, device=device)
    n_valid = torch.tensor(2, device=device)
    lce._rows(logits, target, losses, n_valid, -100, 0.0, True, True)
    assert torch.isnan(losses[1]) and torch.isnan(logits[1]).all()
    assert torch.isfinite(losses[0]) and losses[2] == 0
    assert torch.equal(logits[2], torch.zeros(37, device=device))


# --- causal_lm_loss against transformers' ForCausalLMLoss ----------------------------------------


@pytest.mark.parametrize("num_items", [None, 7, "tensor"])
def test_causal_lm_loss_matches_transformers(num_items):
    loss_utils = pytest.importorskip("transformers.loss.loss_utils")
    batch, length, v = 2, 7, 37
    hidden = torch.randn(batch, length, H, requires_grad=True)
    weight = (torch.randn(v, H) / H**0.5).requires_grad_()
    labels = torch.randint(0, v, (batch, length))
    labels[0, :2] = -100
    if num_items == "tensor":
        num_items = torch.tensor(9)
    ours = causal_lm_loss(hidden, weight, labels, num_items_in_batch=num_items, chunk_size=4)
    logits = hidden @ weight.T
    theirs = loss_utils.ForCausalLMLoss(logits, labels, v, num_items_in_batch=num_items)
    torch.testing.assert_close(ours, theirs)
    grads = torch.autograd.grad(ours, (hidden, weight))
    torch.testing.assert_close(grads, torch.autograd.grad(theirs, (hidden, weight)))


def test_causal_lm_loss_with_shift_labels():
    hidden, weight, target, _ = make_inputs()
    shifted = causal_lm_loss(hidden[None], weight, shift_labels=target[None], chunk_size=4)
    torch.testing.assert_close(shifted, linear_cross_entropy_reference(hidden, weight, target))


def test_causal_lm_loss_needs_labels():
    hidden, weight, _, _ = make_inputs()
    with pytest.raises(ValueError, match="`labels` or `shift_labels`"):
        causal_lm_loss(hidden[None], weight)


# name -> (the arguments changed, from the good ones; the error; its message after the op's name)
CAUSAL_LM_LOSS_BAD = {
    "labels_length": (lambda a: {"labels": a["labels"][:, :3]}, ValueError, r"`labels` must"),
    "labels_list": (lambda a: {"labels": [1]}, TypeError, r"`labels` must be a torch.Tensor"),
    "shift_labels_list": (
        lambda a: {"shift_labels": [1]},
        TypeError,
        r"`shift_labels` must be a torch.Tensor, got list",
    ),
    "shift_labels_int32": (
        lambda a: {"shift_labels": a["labels"].int()},
        TypeError,
        r"`shift_labels` must have dtype in \(int64\), got torch.int32",
    ),
    "shift_labels_shape": (
        lambda a: {"shift_labels": a["labels"][:1]},
        ValueError,
        r"`shift_labels` must have hidden_states' leading shape \(2, 5\), got \(1, 5\)",
    ),
    "hidden_states_list": (
        lambda a: {"hidden_states": [1.0]},
        TypeError,
        r"`hidden_states` must be a torch.Tensor, got list",
    ),
    "lm_head_weight_list": (
        lambda a: {"lm_head_weight": [1.0]},
        TypeError,
        r"`lm_head_weight` must be a torch.Tensor",
    ),
    "lm_head_bias_list": (
        lambda a: {"lm_head_bias": [1.0]},
        TypeError,
        r"`lm_head_bias` must be a torch.Tensor",
    ),
    "ignore_index_huge": (
        lambda a: {"ignore_index": 2**70},
        ValueError,
        r"`ignore_index` must be at most",
    ),
    "num_items_str": (
        lambda a: {"num_items_in_batch": "7"},
        TypeError,
        r"`num_items_in_batch` must be None, a number or a tensor, got str",
    ),
    "num_items_bool": (
        lambda a: {"num_items_in_batch": True},
        TypeError,
        r"`num_items_in_batch` must be None, a number or a tensor, got bool",
    ),
    "num_items_negative": (
        lambda a: {"num_items_in_batch": -1},
        ValueError,
        r"`num_items_in_batch` must be positive .*, got -1",
    ),
    "num_items_zero": (
        lambda a: {"num_items_in_batch": 0},
        ValueError,
        r"`num_items_in_batch` must be positive .*, got 0",
    ),
    "num_items_nan": (
        lambda a: {"num_items_in_batch": float("nan")},
        ValueError,
        r"`num_items_in_batch` must be positive .*, got nan",
    ),
    "num_items_two_elements": (
        lambda a: {"num_items_in_batch": torch.tensor([3, 4])},
        ValueError,
        r"`num_items_in_batch` must have one element, got shape \(2,\)",
    ),
}


@pytest.mark.parametrize("case", CAUSAL_LM_LOSS_BAD)
def test_causal_lm_loss_bad_input_names_the_argument(case, monkeypatch):
    changes, error, match = CAUSAL_LM_LOSS_BAD[case]
    good = {
        "hidden_states": torch.randn(2, 5, H),
        "lm_head_weight": torch.randn(37, H),
        "labels": torch.randint(0, 37, (2, 5)),
    }
    before = {name: t.clone() for name, t in good.items()}

    def forward(*args, **kwargs):
        raise AssertionError("the forward ran before the arguments were checked")

    monkeypatch.setattr(lce, "linear_cross_entropy", forward)
    with pytest.raises(error, match=rf"causal_lm_loss: {match}"):
        causal_lm_loss(**{**good, **changes(good)})
    assert all(torch.equal(good[name], t) for name, t in before.items())


@pytest.mark.parametrize("num_items", [5, 5.0, "tensor", "tensor1"])
def test_causal_lm_loss_num_items_as_transformers_allows(num_items):
    hidden, weight, target, _ = make_inputs()
    labels = target[None]
    if num_items == "tensor":
        num_items = torch.tensor(5)
    elif num_items == "tensor1":
        num_items = torch.tensor([5.0])  # one element (transformers' DataParallel gives (1,))
    loss = causal_lm_loss(hidden[None], weight, labels, num_items_in_batch=num_items)
    expected = causal_lm_loss(hidden[None], weight, labels) * (labels[:, 1:] != -100).sum() / 5
    torch.testing.assert_close(loss.reshape(()), expected)


# --- bad input -----------------------------------------------------------------------------------


def bad_call(**changes):
    hidden, weight, target, bias = make_inputs()
    args = {"hidden": hidden, "weight": weight, "target": target, "bias": bias, **changes}
    return lambda: linear_cross_entropy(**args)


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"target": torch.rand(N)}, TypeError, r"`target` must have dtype in \(int64\).*float32"),
        ({"target": torch.zeros(N, dtype=torch.int32)}, TypeError, r"`target`.*int32"),
        ({"target": torch.zeros(N + 1, dtype=torch.long)}, ValueError, r"`target` must have"),
        ({"weight": torch.randn(37, H + 1)}, ValueError, r"`weight` must have shape \(V, H\)"),
        ({"weight": torch.randn(37, H, dtype=torch.float64)}, TypeError, r"`weight`.*float64"),
        ({"bias": torch.randn(36)}, ValueError, r"`bias` must have shape \(37,\)"),
        ({"bias": torch.randn(37, dtype=torch.float64)}, TypeError, r"`bias`.*float64"),
        ({"hidden": [1.0]}, TypeError, r"`hidden` must be a torch.Tensor"),
        ({"reduction": "avg"}, ValueError, r"`reduction` must be 'mean' or 'sum'.*'avg'"),
        ({"reduction": "none"}, ValueError, r"`reduction`.*not supported.*'none'"),
        ({"label_smoothing": 1.5}, ValueError, r"`label_smoothing` must be in \[0, 1\]"),
        ({"label_smoothing": -0.1}, ValueError, r"`label_smoothing` must be in \[0, 1\]"),
        ({"chunk_size": 0}, ValueError, r"`chunk_size` must be at least 1, got 0"),
        ({"chunk_size": 2.0}, TypeError, r"`chunk_size` must be an int"),
        ({"ignore_index": 1.0}, TypeError, r"`ignore_index` must be an int"),
        # weight not 2-D, with the default chunk size (which reads weight's V)
        ({"weight": torch.randn(37, H)[0]}, ValueError, r"`weight` must have shape \(V, H\)"),
        ({"weight": torch.tensor(1.0)}, ValueError, r"`weight` must have shape \(V, H\).*\(\)"),
        ({"weight": torch.randn(2, 37, H)}, ValueError, r"`weight` must have shape \(V, H\)"),
        # ints the op's schema cannot hold (int64)
        (
            {"ignore_index": 2**70},
            ValueError,
            r"`ignore_index` must be at most 2\*\*63 - 1 \(int64\)",
        ),
        ({"ignore_index": -(2**70)}, ValueError, r"`ignore_index` must be at least"),
        ({"chunk_size": 2**63}, ValueError, r"`chunk_size` must be at most 2\*\*63 - 1"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_bad_input_names_the_argument(changes, error, match):
    with pytest.raises(error, match=match):
        bad_call(**changes)()


@pytest.mark.parametrize("requires_grad", [False, True])
def test_meta_tensors_give_a_meta_loss(requires_grad):
    hidden, weight, target, bias = (t.to("meta") for t in make_inputs())
    hidden.requires_grad_(requires_grad)
    loss = linear_cross_entropy(hidden[None], weight, target[None], bias)
    assert (loss.device.type, loss.shape, loss.dtype) == ("meta", (), torch.float32)
    if requires_grad:
        (grad,) = torch.autograd.grad(loss, hidden)
        assert (grad.device.type, grad.shape) == ("meta", hidden.shape)


def test_bad_device_names_the_argument():
    with pytest.raises(ValueError, match=r"`weight` must be on the device of `hidden`"):
        bad_call(weight=torch.randn(37, H, device="meta"))()


def test_failed_call_leaves_inputs_unchanged():
    hidden, weight, target, bias = make_inputs()
    before = [t.clone() for t in (hidden, weight, target, bias)]
    with pytest.raises(ValueError):
        linear_cross_entropy(hidden, weight, target, bias, reduction="avg")
    assert all(
        torch.equal(t, c) for t, c in zip((hidden, weight, target, bias), before, strict=True)
    )


def test_default_chunk_size():
    assert lce.default_chunk_size(8192, 128256, 2) == 4096  # 4096 x 128256 bf16 logits: 1 GiB
    assert lce.default_chunk_size(65536, 128256, 4) == 2048  # float32 logits: half the rows
    assert lce.default_chunk_size(10**7, 32000, 2) == 8192  # at most MAX_CHUNK rows
    assert lce.default_chunk_size(8192, 32000, 2) == 8192
    assert lce.default_chunk_size(5000, 32000, 2) == 8192  # the first power of two >= N
    assert lce.default_chunk_size(13, 37, 4) == 1024  # at least MIN_CHUNK: one chunk
    assert lce.default_chunk_size(8192, 10**6, 2) == 1024  # even where that is over 1 GiB


def test_a_hidden_size_of_zero_is_refused_naming_hidden():
    hidden, weight = torch.randn(3, 0), torch.randn(5, 0)
    with pytest.raises(ValueError, match=r"`hidden` must be \(\.\.\., H\) with H >= 1"):
        linear_cross_entropy(hidden, weight, torch.zeros(3, dtype=torch.long))
