"""Tests for MoEFeedForward against a dense eager mixture that never permutes."""

import pytest
import torch
import torch.nn.functional as F

from llmsys.kernels_moe import MoEFeedForward


def dense_moe(module: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """Every token through each of its experts, one expert at a time, no permute or padding."""
    tokens = x.reshape(-1, module.d_model)
    top_logits, top = module.router(tokens).topk(module.topk, dim=-1)
    weights = torch.softmax(top_logits.float(), dim=-1).to(x.dtype)
    y = torch.zeros_like(tokens)
    for e in range(module.num_experts):
        token, k = (top == e).nonzero(as_tuple=True)
        h = tokens[token]
        out = (F.silu(h @ module.w1[e].T) * (h @ module.w3[e].T)) @ module.w2[e].T
        y = y.index_add(0, token, out * weights[token, k, None])
    return y.reshape(x.shape)


@pytest.mark.parametrize(
    ("shape", "num_experts", "topk", "align"),
    [((2, 9, 16), 4, 2, 8), ((13, 16), 5, 1, 128), ((7, 16), 3, 3, 1)],
)
def test_matches_dense_mixture_forward_and_backward(shape, num_experts, topk, align, device):
    module = MoEFeedForward(
        16, 24, num_experts, topk, align=align, device=device, dtype=torch.float64
    )
    x = torch.randn(shape, device=device, dtype=torch.float64, requires_grad=True)
    grad_y = torch.randn(shape, device=device, dtype=torch.float64)
    params = [x, module.router.weight, module.w1, module.w2, module.w3]
    y = module(x)
    grads = torch.autograd.grad(y, params, grad_y)
    y_ref = dense_moe(module, x)
    grads_ref = torch.autograd.grad(y_ref, params, grad_y)
    torch.testing.assert_close(y, y_ref)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref)


def test_zero_tokens(device):
    module = MoEFeedForward(8, 8, 4, 2, device=device)
    x = torch.randn(0, 8, device=device, requires_grad=True)
    y = module(x)
    assert y.shape == (0, 8)
    y.sum().backward()


def test_repr_names_the_sizes():
    assert "num_experts=4, topk=2, align=128" in repr(MoEFeedForward(8, 8, 4, 2))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"d_model": 0}, "`d_model`"),
        ({"d_ff": 2.5}, "`d_ff`"),
        ({"num_experts": True}, "`num_experts`"),
        ({"topk": 5}, "`topk`"),
        ({"align": 0}, "`align`"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, match):
    args = {"d_model": 8, "d_ff": 8, "num_experts": 4, "topk": 2} | kwargs
    with pytest.raises(ValueError, match=match):
        MoEFeedForward(**args)
