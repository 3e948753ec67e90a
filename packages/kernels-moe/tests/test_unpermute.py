"""Tests for moe_unpermute: against a float64 reference, padding never read, dropped pairs,
gradients (padding rows get exact zeros), the round trip with the permute, every bad input."""

import pytest
import torch
from moe_helpers import rand, random_routing, set_switch

from llmsys.kernels_moe import (
    moe_unpermute,
    moe_unpermute_reference,
    padded_moe_permute,
)

# (num_tokens, hidden, topk, num_experts, align)
CASES = [(1, 1, 1, 1, 1), (13, 33, 2, 5, 8), (67, 17, 3, 7, 16), (7, 5, 8, 8, 1)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
# Relative to the float64 reference: the kernel sums in float32 and rounds once, like the
# reference does, so both land within a rounding of the output dtype.
TOL = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}


def case_id(case) -> str:
    return "T{}-H{}-k{}-E{}-a{}".format(*case)


def routed(case, dtype, device, *, duplicates=False):
    """(expert_out with NaN padding rows, row_index, weights) from a real permute's layout."""
    num_tokens, hidden, topk, num_experts, align = case
    top, counts = random_routing(num_tokens, topk, num_experts, device, duplicates=duplicates)
    x = torch.zeros(num_tokens, hidden, device=device)
    grouped, _, row_index = padded_moe_permute(
        x, top, counts, topk, num_experts, align=align, return_row_index=True
    )
    expert_out = rand(grouped.shape, dtype, device)
    padding = torch.ones(grouped.shape[0], dtype=torch.bool, device=device)
    padding[row_index.long().reshape(-1)] = False
    expert_out[padding] = float("nan")  # the unpermute must never read a padding row
    weights = torch.rand(num_tokens, topk, device=device)
    return expert_out, row_index, weights


def float64_reference(expert_out, row_index, weights):
    return moe_unpermute_reference(
        expert_out.double(), row_index, None if weights is None else weights.double()
    )


@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "unweighted"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_float64_reference(case, dtype, weighted, device, poisoned_allocations):
    expert_out, row_index, weights = routed(case, dtype, device)
    weights = weights if weighted else None
    y = moe_unpermute(expert_out, row_index, weights)
    assert y.dtype == dtype and y.shape == (case[0], case[1])
    expected = float64_reference(expert_out, row_index, weights)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(y.double(), expected, rtol=rtol, atol=atol)


def test_error_at_most_twice_eager_same_dtype(device):
    # Our bf16 error against float64 is at most twice that of eager bf16 arithmetic.
    expert_out, row_index, weights = routed((61, 129, 4, 9, 8), torch.bfloat16, device)
    weights = weights.bfloat16()
    expected = float64_reference(expert_out, row_index, weights)
    ours = moe_unpermute(expert_out, row_index, weights).double()
    eager = (expert_out[row_index.long()] * weights[..., None]).sum(1).double()
    mask = torch.isfinite(eager)
    our_err = (ours - expected)[mask].abs().max()
    eager_err = (eager - expected)[mask].abs().max()
    print(f"bf16 max error vs float64: ours {our_err:.3g}, eager {eager_err:.3g}")
    assert our_err <= 2 * eager_err


def test_weights_in_other_dtype_and_duplicates(device):
    expert_out, row_index, weights = routed(
        (23, 19, 4, 4, 4), torch.bfloat16, device, duplicates=True
    )
    y = moe_unpermute(expert_out, row_index, weights.double())
    torch.testing.assert_close(
        y.double(), float64_reference(expert_out, row_index, weights), rtol=1.6e-2, atol=1e-2
    )


def test_dropped_pairs_contribute_nothing(device):
    expert_out = rand((10, 6), torch.float32, device)
    row_index = torch.tensor([[3, -1], [-1, -1], [7, 2]], dtype=torch.int32, device=device)
    weights = torch.tensor([[2.0, float("inf")], [1.0, 1.0], [0.5, -1.0]], device=device)
    y = moe_unpermute(expert_out, row_index, weights)
    zeros = torch.zeros(6, device=device)
    expected = torch.stack([2 * expert_out[3], zeros, 0.5 * expert_out[7] - expert_out[2]])
    torch.testing.assert_close(y, expected)


def test_zero_tokens_and_zero_hidden(device):
    rows = torch.zeros(0, 2, dtype=torch.int32, device=device)
    assert moe_unpermute(rand((5, 4), torch.float32, device), rows).shape == (0, 4)
    rows = torch.zeros(3, 2, dtype=torch.int32, device=device)
    out = moe_unpermute(torch.empty(5, 0, device=device), rows, torch.ones(3, 2, device=device))
    assert out.shape == (3, 0)


def test_round_trip_with_permute(device):
    x = rand((37, 24), torch.float32, device)
    top, counts = random_routing(37, 3, 6, device, duplicates=True)
    weights = torch.rand(37, 3, device=device)
    grouped, _, row_index = padded_moe_permute(
        x, top, counts, 3, 6, align=16, return_row_index=True
    )
    y = moe_unpermute(grouped, row_index, weights)
    torch.testing.assert_close(y, x * weights.sum(1, keepdim=True))


@pytest.mark.parametrize("block_h", [4, 16, 256])
def test_every_copy_geometry_gives_the_same_result(block_h, device, monkeypatch):
    expert_out, row_index, weights = routed((29, 45, 3, 5, 8), torch.float32, device)
    expected = moe_unpermute(expert_out, row_index, weights)
    set_switch(monkeypatch, "copy_config", lambda hidden, size: (block_h, 1))
    assert torch.equal(moe_unpermute(expert_out, row_index, weights), expected)


# --- gradients -----------------------------------------------------------------------------------


def reference_grads(expert_out, row_index, weights, grad_y):
    leaves = [expert_out.double().requires_grad_(), weights.double().requires_grad_()]
    y = moe_unpermute_reference(leaves[0], row_index, leaves[1])
    return torch.autograd.grad(y, leaves, grad_y.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES[1:], ids=case_id)
def test_backward_matches_reference(case, dtype, device, poisoned_allocations):
    expert_out, row_index, weights = routed(case, dtype, device)
    expert_out = expert_out.nan_to_num(0.0).requires_grad_()  # the weights' gradient reads rows
    weights.requires_grad_()
    grad_y = rand((case[0], case[1]), dtype, device)
    grads = torch.autograd.grad(
        moe_unpermute(expert_out, row_index, weights), (expert_out, weights), grad_y
    )
    expected = reference_grads(expert_out, row_index, weights, grad_y)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(grads[0].double(), expected[0], rtol=rtol, atol=atol)
    torch.testing.assert_close(grads[1].double(), expected[1], rtol=rtol, atol=atol * case[1])
    used = torch.zeros(expert_out.shape[0], dtype=torch.bool, device=device)
    used[row_index.long().reshape(-1)] = True
    assert torch.equal(grads[0][~used], torch.zeros_like(grads[0][~used]))  # exact zeros


@pytest.mark.parametrize("needs", ["expert_out", "weights", "unweighted"])
def test_gradient_for_one_input_only(needs, device):
    expert_out, row_index, weights = routed((17, 12, 2, 4, 4), torch.float32, device)
    expert_out = expert_out.nan_to_num(0.0)
    grad_y = rand((17, 12), torch.float32, device)
    expected = reference_grads(expert_out, row_index, weights, grad_y)
    if needs == "weights":
        weights.requires_grad_()
        (grad,) = torch.autograd.grad(
            moe_unpermute(expert_out, row_index, weights), weights, grad_y
        )
        torch.testing.assert_close(grad.double(), expected[1], rtol=1e-5, atol=1e-5)
        return
    expert_out.requires_grad_()
    w = weights if needs == "expert_out" else None
    (grad,) = torch.autograd.grad(moe_unpermute(expert_out, row_index, w), expert_out, grad_y)
    if w is None:
        expected = reference_grads(expert_out, row_index, torch.ones_like(weights), grad_y)
    torch.testing.assert_close(grad.double(), expected[0], rtol=1e-5, atol=1e-5)


def test_gradcheck_float64(device):
    expert_out, row_index, weights = routed((5, 3, 2, 3, 2), torch.float64, device)
    expert_out = expert_out.nan_to_num(0.0).requires_grad_()
    weights = weights.double().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda e, w: moe_unpermute(e, row_index, w), (expert_out, weights)
    )


def test_end_to_end_gradient_through_permute(device):
    x = rand((5, 3), torch.float64, device).requires_grad_()
    top, counts = random_routing(5, 2, 3, device)
    weights = torch.rand(5, 2, dtype=torch.float64, device=device).requires_grad_()

    def f(x, weights):
        grouped, _, row_index = padded_moe_permute(
            x, top, counts, 2, 3, align=4, out_rows=20, return_row_index=True
        )
        return moe_unpermute(torch.tanh(grouped), row_index, weights)

    assert torch.autograd.gradcheck(f, (x, weights))


def test_eager_fallback_matches_kernels(monkeypatch):
    expert_out, row_index, weights = routed((9, 7, 2, 3, 4), torch.float32, "cpu")
    expert_out = expert_out.nan_to_num(0.0).requires_grad_()
    weights.requires_grad_()
    grad_y = torch.randn(9, 7)

    def run():
        y = moe_unpermute(expert_out, row_index, weights)
        return (y, *torch.autograd.grad(y, (expert_out, weights), grad_y))

    kernels = run()
    set_switch(monkeypatch, "CPU_RUNS_TRITON", False)
    for a, b in zip(run(), kernels, strict=True):
        torch.testing.assert_close(a, b)


# --- bad input -----------------------------------------------------------------------------------


I32 = torch.int32
BAD = {
    "out-not-tensor": ({"expert_out": 1.0}, TypeError, "`expert_out`"),
    "out-integer": ({"expert_out": torch.ones(8, 3, dtype=I32)}, TypeError, "`expert_out`"),
    "out-3d": ({"expert_out": torch.ones(8, 3, 1)}, ValueError, "`expert_out`"),
    "rows-float": ({"row_index": torch.zeros(4, 2)}, TypeError, "`row_index`"),
    "rows-1d": ({"row_index": torch.zeros(4, dtype=I32)}, ValueError, "`row_index`"),
    "weights-integer": (
        {"routing_weights": torch.ones(4, 2, dtype=I32)},
        TypeError,
        "`routing_weights`",
    ),
    "weights-shape": ({"routing_weights": torch.ones(4, 3)}, ValueError, "`routing_weights`"),
    "device": ({"row_index": torch.zeros(4, 2, dtype=I32, device="meta")}, ValueError, "device"),
}


@pytest.mark.parametrize("bad", BAD, ids=str)
@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
def test_bad_input_names_the_argument(bad, grad, device):
    args = {
        "expert_out": rand((8, 3), torch.float32, device).requires_grad_(grad),
        "row_index": torch.zeros(4, 2, dtype=torch.int32, device=device),
        "routing_weights": torch.ones(4, 2, device=device),
    }
    changes, error, match = BAD[bad]
    args.update({k: v.to(device) if isinstance(v, torch.Tensor) and v.device.type != "meta" else v
                 for k, v in changes.items()})  # fmt: skip
    with pytest.raises(error, match=match):
        moe_unpermute(**args)


# --- GPU only ------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_no_sync_and_cuda_graph():
    expert_out, row_index, weights = routed((300, 256, 4, 16, 128), torch.bfloat16, "cuda")
    expert_out = expert_out.nan_to_num(0.0).requires_grad_()
    weights.requires_grad_()
    grad_y = rand((300, 256), torch.bfloat16, "cuda")

    def step():
        y = moe_unpermute(expert_out, row_index, weights)
        return (y, *torch.autograd.grad(y, (expert_out, weights), grad_y))

    expected = step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with torch.no_grad():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = moe_unpermute(expert_out, row_index, weights)
        graph.replay()
    assert torch.equal(captured, expected[0])


def test_double_backward_raises_instead_of_dropping_second_order_terms(device):
    top, counts = random_routing(6, 2, 4, device)
    x = rand((6, 8), torch.float32, device).requires_grad_()
    permuted, _, row_index = padded_moe_permute(
        x, top, counts, 2, 4, align=4, return_row_index=True
    )
    weights = torch.rand(6, 2, device=device, requires_grad=True)
    with pytest.raises(RuntimeError, match="padded_moe_permute: double backward is not supported"):
        torch.autograd.grad(permuted.sum(), x, create_graph=True)
    y = moe_unpermute(permuted, row_index, weights)
    with pytest.raises(RuntimeError, match="moe_unpermute: double backward is not supported"):
        torch.autograd.grad(y.sum(), weights, create_graph=True)
    (grad_weights,) = torch.autograd.grad(y.sum(), weights)  # first order still works
    assert grad_weights.shape == weights.shape
