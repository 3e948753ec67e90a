"""Tests for the spec (attention_reference) and the plain-PyTorch FlashAttention2Torch."""

import pytest
import torch
import torch.nn.functional as F
from attn_helpers import (
    assert_matches_spec,
    check_assignment_case,
    make_qkv,
    reference_with_grads,
    run_with_grads,
)

from llmsys.flash_attn2 import FlashAttention2Torch, attention_reference, flash_torch

CAUSAL = [False, True]


def causal_id(causal: bool) -> str:
    return "causal" if causal else "full"


# --- the spec ------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", CAUSAL, ids=causal_id)
def test_reference_matches_sdpa_in_float64(causal):
    # The spec against PyTorch's own attention (square, so both causal alignments agree).
    q, k, v = (torch.randn(2, 3, 19, 8, dtype=torch.float64) for _ in range(3))
    out, lse = attention_reference(q, k, v, causal)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(out, expected)
    assert lse.shape == (2, 3, 19) and lse.dtype == torch.float32


def test_reference_causal_is_top_left_aligned():
    # 3 queries, 5 keys: query i sees keys 0..i, so row 0 is exactly v[0].
    q, k, v = (torch.randn(1, n, 4, dtype=torch.float64) for n in (3, 5, 5))
    out, _ = attention_reference(q, k, v, is_causal=True)
    torch.testing.assert_close(out[0, 0], v[0, 0])
    expected_row1 = torch.softmax(q[0, 1] @ k[0, :2].T / 2, dim=-1) @ v[0, :2]
    torch.testing.assert_close(out[0, 1], expected_row1)


def test_reference_gqa_equals_repeated_heads():
    q = torch.randn(1, 4, 6, 8, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 6, 8, dtype=torch.float64) for _ in range(2))
    out, _ = attention_reference(q, k, v)
    expanded, _ = attention_reference(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    torch.testing.assert_close(out, expanded)


# --- FlashAttention2Torch ------------------------------------------------------------------------


@pytest.mark.parametrize("causal", CAUSAL, ids=causal_id)
def test_assignment_case(causal):
    check_assignment_case(FlashAttention2Torch, causal)


@pytest.mark.parametrize("causal", CAUSAL, ids=causal_id)
@pytest.mark.parametrize(
    ("n_q", "n_k"), [(1, 1), (7, 7), (17, 15), (15, 129), (129, 70), (127, 127)], ids=str
)
def test_odd_lengths_match_spec(n_q, n_k, causal):
    q, k, v = make_qkv((2, 3, n_q, 24), (2, 3, n_k, 24))
    grad_out = torch.randn(2, 3, n_q, 24)
    got = run_with_grads(lambda *t: FlashAttention2Torch.apply(*t, causal), q, k, v, grad_out)
    ref_out, _, *ref_grads = reference_with_grads(q, k, v, grad_out, causal)
    assert_matches_spec(got, (ref_out, *ref_grads), torch.float32, "cpu")


@pytest.mark.parametrize("tiles", [(16, 16), (16, 48), (32, 16), (64, 64)], ids=str)
def test_tile_sizes_agree(tiles):
    # Only the geometry differs: the results agree to float32 rounding.
    q, k, v = (torch.randn(2, 45, 16) for _ in range(3))
    grad_out = torch.randn(2, 45, 16)
    results = []
    for q_tile, k_tile in [tiles, (64, 64)]:
        out, lse = flash_torch.flash_forward_torch(q, k, v, True, 0.25, q_tile, k_tile)
        grads = flash_torch.flash_backward_torch(
            grad_out, q, k, v, out, lse, True, 0.25, q_tile, k_tile
        )
        results.append((out, lse, *grads))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_low_precision_error_within_twice_eager(dtype):
    # FlashAttention's rule: our error against float64 <= 2x eager's error in the same dtype.
    q, k, v = make_qkv((2, 2, 67, 32), (2, 2, 67, 32), dtype)
    grad_out = torch.randn(2, 2, 67, 32).to(dtype)
    ours = run_with_grads(lambda *t: FlashAttention2Torch.apply(*t, True), q, k, v, grad_out)
    exact_out, _, *exact_grads = reference_with_grads(q, k, v, grad_out, True)
    eager_out, _, *eager_grads = reference_with_grads(q, k, v, grad_out, True, upcast=False)
    for got, eager, exact in zip(
        ours, (eager_out, *eager_grads), (exact_out, *exact_grads), strict=False
    ):
        ours_error = (got.double() - exact.double()).abs().max().item()
        eager_error = (eager.double() - exact.double()).abs().max().item()
        assert ours_error <= 2 * eager_error + 1e-6, (ours_error, eager_error)


@pytest.mark.parametrize("causal", CAUSAL, ids=causal_id)
def test_gradcheck_float64(causal):
    q, k, v = (torch.randn(1, 2, n, 5, dtype=torch.float64, requires_grad=True) for n in (9, 9, 9))
    assert torch.autograd.gradcheck(lambda *t: FlashAttention2Torch.apply(*t, causal), (q, k, v))


def test_explicit_scale_and_float64_lse():
    q, k, v = (torch.randn(3, 10, 8, dtype=torch.float64) for _ in range(3))
    out = FlashAttention2Torch.apply(q, k, v, False, 0.3)
    expected, _ = attention_reference(q, k, v, False, 0.3)
    torch.testing.assert_close(out, expected)
    assert out.grad_fn is None  # no input requires grad: no graph


def test_no_keys_gives_zeros_and_minus_inf_lse():
    q, k, v = make_qkv((2, 5, 8), (2, 0, 8))
    out = FlashAttention2Torch.apply(q, k, v, False)
    (lse,) = [t for t in out.grad_fn.saved_tensors if t.shape == (2, 5)]
    assert torch.equal(out, torch.zeros(2, 5, 8)) and bool((lse == float("-inf")).all())
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q)) and k.grad.shape == (2, 0, 8)


def test_inputs_are_not_modified():
    q, k, v = make_qkv((2, 33, 16), (2, 33, 16))
    before = [t.detach().clone() for t in (q, k, v)]
    FlashAttention2Torch.apply(q, k, v, True).sum().backward()
    assert all(torch.equal(t, c) for t, c in zip((q, k, v), before, strict=True))


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"q": "not a tensor"}, TypeError, r"`q` must be a torch.Tensor"),
        ({"k": torch.arange(8.0).int().view(1, 2, 4)}, TypeError, r"`k` must have dtype"),
        ({"v": torch.randn(1, 2, 4, dtype=torch.float64)}, TypeError, r"`v` must have the dtype"),
        ({"q": torch.randn(4)}, ValueError, r"`q` must be \(\.\.\., seq, head_dim\)"),
        ({"k": torch.randn(2, 2, 4)}, ValueError, r"`k` must be \(\.\.\., n_keys, d\)"),
        ({"k": torch.randn(1, 2, 5)}, ValueError, r"`k` must be \(\.\.\., n_keys, d\)"),
        ({"v": torch.randn(1, 3, 4)}, ValueError, r"`v` must have the shape of `k`"),
        ({"k": torch.randn(1, 2, 4, device="meta")}, ValueError, r"`k` must be on the device"),
        ({"is_causal": "yes"}, TypeError, r"`is_causal` must be a bool"),
        ({"scale": "0.5"}, TypeError, r"`scale` must be a float"),
        ({"scale": float("inf")}, ValueError, r"`scale` must be finite"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_bad_inputs_raise(change, error, match):
    args = {"q": torch.randn(1, 2, 4), "k": torch.randn(1, 2, 4), "v": torch.randn(1, 2, 4)}
    args |= {"is_causal": False, "scale": None} | change
    with pytest.raises(error, match=match):
        FlashAttention2Torch.apply(*args.values())
