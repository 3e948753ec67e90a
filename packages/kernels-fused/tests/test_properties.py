"""Property tests (issue 49): for any input, ``rms_norm``, ``rotary``, ``linear_cross_entropy``
and ``causal_lm_loss`` return what an independent float64 reference computes, or raise a
``ValueError``/``TypeError`` naming one of their arguments, or a ``RuntimeError`` naming the
unsupported operation; nothing else, and the inputs are left as they were
(``llmsys_dev.properties.outcome``).

The inputs: tiny shapes (empty dims, one element, odd sizes), every dtype, transposed, sliced
and expanded views, NaN and Inf values; and, for one argument at a time, something broken on
purpose (not a tensor, a wrong dtype or shape, a scalar out of range), which must be refused.
The Triton kernels run under the interpreter on CPU: sizes stay at 16 and below, and the example
budgets (``property_settings``) keep this file near 30 s on two cores.

Tolerances are in units of the dtype's spacing (``ulp``): the kernels compute in float32 and
round once or twice; the loss's logits come out of a matmul in the inputs' dtype.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

from llmsys.kernels_fused import causal_lm_loss, linear_cross_entropy, rms_norm, rotary
from llmsys_dev.properties import (
    FLOATS,
    Refused,
    assert_close,
    bad_dtypes,
    broken_tensor,
    outcome,
    property_settings,
    shapes,
    tensor,
    ulp,
)

HALF_AND_SINGLE = (torch.float16, torch.bfloat16, torch.float32)


def finite(*values) -> bool:
    return all(not isinstance(v, torch.Tensor) or bool(v.detach().isfinite().all()) for v in values)


def assert_grads_match(fn, ref, inputs, rtol: float, seed: int, floor: float = 0.0) -> None:
    """The gradients of ``sum(fn(*inputs) * g)`` (over the tensor outputs, ``g`` random) for
    the tensors among ``inputs``, against those of ``ref`` on float64 copies: within ``rtol``,
    or 32 ``rtol`` (the reduction lengths) of the largest gradient magnitude (at least
    ``floor``)."""
    gen = torch.Generator().manual_seed(seed)
    leaves = [t.detach().requires_grad_() if isinstance(t, torch.Tensor) else t for t in inputs]
    leaves64 = [
        t.detach().double().requires_grad_() if isinstance(t, torch.Tensor) else t for t in inputs
    ]
    outs, outs64 = fn(*leaves), ref(*leaves64)
    outs = outs if isinstance(outs, tuple) else (outs,)
    outs64 = outs64 if isinstance(outs64, tuple) else (outs64,)
    weights = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in outs64]
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    tensors64 = [t for t in leaves64 if isinstance(t, torch.Tensor)]
    loss = sum((o.double() * w).sum() for o, w in zip(outs, weights, strict=True))
    loss64 = sum((o * w).sum() for o, w in zip(outs64, weights, strict=True))
    if not loss64.requires_grad:
        return
    grads = torch.autograd.grad(loss, tensors, allow_unused=True)
    grads64 = torch.autograd.grad(loss64, tensors64, allow_unused=True)
    # one scale for all: a gradient that is 0 analytically (float64 gives 1e-16) is off by
    # rounding errors of the size of the others
    scale = max(
        (float(g.abs().amax()) for g in grads64 if g is not None and g.numel()), default=0.0
    )
    for got, expected in zip(grads, grads64, strict=True):
        if expected is None or not bool(expected.isfinite().all()):
            continue
        assert got is not None
        tol = rtol + 2 * ulp(got.dtype)  # each gradient is rounded to its input's dtype
        assert_close(got, expected, tol, 32 * tol * (max(scale, floor) + 1e-30))


# --- rms_norm ------------------------------------------------------------------------------------


def rms_norm_64(x, weight, eps, residual):
    """``weight * s * rsqrt(mean(s**2) + eps)`` in float64, ``s = x (+ residual)`` rounded to
    x's dtype (the sum is an output of its own)."""
    s = x if residual is None else (x.double() + residual.double()).to(x.dtype)
    s64 = s.double()
    normalized = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + eps)
    return weight.double() * normalized, s


def rms_norm_eps(eps):
    return lambda x, weight, residual: rms_norm(x, weight, eps, residual)


@property_settings(80)
@given(data=st.data())
def test_rms_norm(data):
    draw = data.draw
    lead, n = draw(shapes(max_dims=2)), draw(st.sampled_from([1, 3, 8, 16, 0]))
    dtype = draw(st.sampled_from(HALF_AND_SINGLE))
    w_dtype = draw(st.sampled_from([dtype, dtype, torch.float32]))
    broken = draw(st.sampled_from([None, None, None, "x", "weight", "eps", "residual"]))
    bad = bad_dtypes(HALF_AND_SINGLE)
    if broken == "x":  # refused: any shape whose last dim is not weight's n (or a 0-d)
        x = draw(
            broken_tensor((*lead, n), dtype, bad_dtypes=bad, bad_shape=lambda s: s[-1:] != (n,))
        )
    else:
        x = draw(tensor((*lead, n), dtype))
    if broken == "weight":
        weight = draw(broken_tensor((n,), w_dtype, bad_dtypes=bad, bad_shape=lambda s: s != (n,)))
    else:
        weight = draw(tensor((n,), w_dtype))
    if broken == "eps":
        eps = draw(st.sampled_from([-1e-6, math.nan, math.inf, "1e-6", None, True, [1e-6]]))
    else:
        eps = draw(st.sampled_from([1e-6, 1e-5, 0.0, 0.5, 1, 0]))
    if broken == "residual":
        shape = (*lead, n)
        residual = draw(broken_tensor(shape, dtype, bad_dtypes=bad, bad_shape=lambda s: s != shape))
    else:
        residual = draw(st.none() | tensor((*lead, n), draw(st.sampled_from(HALF_AND_SINGLE))))

    result = outcome(rms_norm, x, weight, eps, residual)
    event("refused" if isinstance(result, Refused) else "returned")
    if broken is not None:
        assert isinstance(result, Refused), f"accepted a bad `{broken}`"
        return
    assert not isinstance(result, Refused), result
    y, s = (result, None) if residual is None else result
    expected_y, expected_s = rms_norm_64(x, weight, float(eps), residual)
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    assert y.dtype == out_dtype
    rtol = 2 * (ulp(dtype) + ulp(out_dtype))
    w_max = weight.double().abs().nan_to_num(0.0, 0.0, 0.0).max() if n else 1.0
    assert_close(y, expected_y, rtol, rtol * float(w_max))
    if residual is not None:
        assert s.dtype == dtype
        assert_close(s, expected_s.double(), ulp(dtype), 0.0)  # the interpreter truncates
    if finite(x, weight, residual, expected_y):

        def reference(x, weight, residual):  # float64 throughout, no rounding of the sum
            s = x if residual is None else x + residual
            y = weight * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + float(eps))
            return y if residual is None else (y, s)

        rtol = 8 * (ulp(dtype) + ulp(out_dtype))
        seed = draw(st.integers(0, 99))
        assert_grads_match(rms_norm_eps(eps), reference, (x, weight, residual), rtol, seed)


# --- rotary --------------------------------------------------------------------------------------


def rotary_64(q, k, cos, sin):
    """``x * cos + rotate_half(x) * sin`` in float64, cos and sin broadcast over the heads."""
    cos, sin = cos.double().unsqueeze(1), sin.double().unsqueeze(1)

    def embed(x):
        x = x.double()
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    return embed(q), embed(k)


@property_settings(80)
@given(data=st.data())
def test_rotary(data):
    draw = data.draw
    b, hq, hk, s = (draw(st.sampled_from([1, 2, 3, 0])) for _ in range(4))
    d = draw(st.sampled_from([2, 4, 6, 8, 16]))
    dtype = draw(st.sampled_from(FLOATS))
    cos_dtype = draw(st.sampled_from([dtype, torch.float32]))
    cos_b = draw(st.sampled_from([1, b]))
    broken = draw(st.sampled_from([None, None, None, "q", "k", "cos", "sin"]))
    bad = bad_dtypes(FLOATS)

    def q_shape_bad(shape):  # q fixes B, S and D for the others: refused if k, cos disagree
        return len(shape) != 4 or shape[3] % 2 or shape[0] != b or shape[2:] != (s, d)

    def k_shape_bad(shape):
        return len(shape) != 4 or (shape[0], shape[2], shape[3]) != (b, s, d)

    def cos_shape_bad(shape):
        return len(shape) != 3 or shape[0] not in (1, b) or shape[1:] != (s, d)

    q = (
        draw(broken_tensor((b, hq, s, d), dtype, bad_dtypes=bad, bad_shape=q_shape_bad))
        if broken == "q"
        else draw(tensor((b, hq, s, d), dtype))
    )
    k = (
        draw(broken_tensor((b, hk, s, d), dtype, bad_dtypes=bad, bad_shape=k_shape_bad))
        if broken == "k"
        else draw(tensor((b, hk, s, d), dtype))
    )
    cos, sin = (
        draw(broken_tensor((cos_b, s, d), cos_dtype, bad_dtypes=bad, bad_shape=cos_shape_bad))
        if broken == name
        else draw(tensor((cos_b, s, d), cos_dtype))
        for name in ("cos", "sin")
    )

    result = outcome(rotary, q, k, cos, sin)
    event("refused" if isinstance(result, Refused) else "returned")
    if broken is not None:
        assert isinstance(result, Refused), f"accepted a bad `{broken}`"
        return
    assert not isinstance(result, Refused), result
    q_out, k_out = result
    expected_q, expected_k = rotary_64(q, k, cos, sin)
    rtol = 2 * ulp(dtype) + (ulp(cos_dtype) if cos_dtype != dtype else 0.0)
    for got, expected, x in ((q_out, expected_q, q), (k_out, expected_k, k)):
        assert got.dtype == dtype
        scale = x.double().abs().nan_to_num(0.0, 0.0, 0.0).amax() if x.numel() else 1.0
        assert_close(got, expected, rtol, 2 * rtol * float(scale))
    if finite(q, k, cos, sin):
        rotate = lambda q, k: rotary(q, k, cos, sin)  # noqa: E731 (no gradient for cos, sin)
        reference = lambda q, k: rotary_64(q, k, cos, sin)  # noqa: E731
        assert_grads_match(rotate, reference, (q, k), 4 * rtol, draw(st.integers(0, 99)))


# --- linear_cross_entropy and causal_lm_loss ------------------------------------------------------


def cross_entropy_64(hidden, weight, target, bias, ignore_index, label_smoothing, reduction):
    """F.cross_entropy's loss of ``hidden @ weight.T + bias`` in float64, written out: per valid
    row ``(1 - e) (lse - z_t) + e (lse - mean z)``; ignored rows add nothing; "mean" divides
    by the count of valid rows (0 / 0 = NaN). None where the targets are out of range."""
    h = hidden.reshape(-1, hidden.shape[-1]).double()
    t = target.reshape(-1)
    vocab = weight.shape[0]
    valid = t != ignore_index
    if bool(((t[valid] < 0) | (t[valid] >= vocab)).any()):
        return None
    z = h[valid] @ weight.double().t()
    if bias is not None:
        z = z + bias.double()
    if z.shape[0]:
        lse = torch.logsumexp(z, dim=1)
        nll = lse - z.gather(1, t[valid][:, None])[:, 0]
        loss = (1 - label_smoothing) * nll + label_smoothing * (lse - z.mean(dim=1))
    else:
        loss = z.new_zeros(0)
    total = loss.sum()
    return total / valid.sum() if reduction == "mean" else total


def loss_tolerance(hidden, weight, bias) -> tuple[float, float] | None:
    """(rtol, atol) for a loss whose logits come from a matmul in hidden's dtype: each logit is
    off by about an ulp of the largest product sum, and a loss by twice that. None where the
    logits overflow the dtype (the reference in float64 has no such limit)."""
    h = hidden.reshape(-1, hidden.shape[-1]).double().nan_to_num(0.0, 0.0, 0.0)
    w = weight.double().nan_to_num(0.0, 0.0, 0.0)
    bound = float((h.abs() @ w.abs().t()).amax()) if h.numel() and w.numel() else 0.0
    if bias is not None and bias.numel():
        bound += float(bias.double().nan_to_num(0.0, 0.0, 0.0).abs().amax())
    dtype = hidden.dtype
    if bound > torch.finfo(dtype).max / 4:
        return None
    rtol = 4 * ulp(dtype) + 1e-6
    return rtol, rtol * (bound + 1.0) * (2 + hidden.shape[-1] * ulp(dtype) ** 0.5)


def good_target(vocab: int, ignore_index):
    if type(ignore_index) is not int or not -(2**63) <= ignore_index < 2**63:
        ignore_index = -100  # a bad one is refused before the targets matter
    classes = [st.integers(0, vocab - 1)] if vocab else []
    return st.one_of(*classes, st.just(ignore_index))


BAD_IGNORE_INDEX = [2**70, -(2**70), 1.0, "x", None, True]
GOOD_SMOOTHING, BAD_SMOOTHING = [0.0, 0.0, 0.1, 1.0, 0], [-0.1, 1.5, math.nan, "0.1", True, None]
BAD_REDUCTION = ["none", "MEAN", None, 1]
GOOD_CHUNK, BAD_CHUNK = [None, None, 1, 2, 3, 1000], [0, -1, 2.0, True, "4", 2**64]


@property_settings(80)
@given(data=st.data())
def test_linear_cross_entropy(data):
    draw = data.draw
    lead = draw(shapes(max_dims=2))
    h, v = draw(st.sampled_from([1, 3, 8, 16])), draw(st.sampled_from([1, 5, 17, 32]))
    dtype = draw(st.sampled_from(FLOATS))
    with_bias = draw(st.booleans())
    broken = draw(
        st.sampled_from(
            [None] * 5
            + ["hidden", "weight", "target", "bias", "out_of_vocab"]
            + ["ignore_index", "label_smoothing", "reduction", "chunk_size"]
        )
    )
    bad = bad_dtypes(FLOATS)
    ignore_index = (
        draw(st.sampled_from(BAD_IGNORE_INDEX))
        if broken == "ignore_index"
        else draw(st.sampled_from([-100, -100, 0, -1, v - 1]))
    )
    scale = 1 / h**0.5
    if broken == "hidden":
        hidden = draw(
            broken_tensor(
                (*lead, h), dtype, bad_dtypes=bad, bad_shape=lambda s: not s or s[-1] != h
            )
        )
    else:
        hidden = draw(tensor((*lead, h), dtype))
    if broken == "weight":
        weight = draw(
            broken_tensor(
                (v, h), dtype, bad_dtypes=bad, bad_shape=lambda s: len(s) != 2 or s[1] != h
            )
        )
    else:
        weight = draw(tensor((v, h), dtype, scale=scale))
    if broken == "bias":
        bias = draw(broken_tensor((v,), dtype, bad_dtypes=bad, bad_shape=lambda s: s != (v,)))
    else:
        bias = draw(tensor((v,), dtype)) if with_bias else None
    targets = [draw(good_target(v, ignore_index)) for _ in range(math.prod(lead))]
    target = torch.tensor(targets, dtype=torch.int64).reshape(lead)
    if broken == "target":
        target = draw(
            broken_tensor(
                lead,
                torch.int64,
                bad_dtypes=(*FLOATS, torch.int32, torch.bool),
                bad_shape=lambda s: s != lead,
            )
        )
    elif broken == "out_of_vocab" and target.numel():
        wrong = draw(st.sampled_from([v, v + 7, -1, -100, -(2**40)]))
        if wrong == ignore_index:
            wrong = v
        target.view(-1)[draw(st.integers(0, target.numel() - 1))] = wrong
    elif broken == "out_of_vocab":
        broken = None  # no token to put a bad target on
    label_smoothing = draw(
        st.sampled_from(BAD_SMOOTHING if broken == "label_smoothing" else GOOD_SMOOTHING)
    )
    reduction = draw(st.sampled_from(BAD_REDUCTION if broken == "reduction" else ["mean", "sum"]))
    chunk_size = draw(st.sampled_from(BAD_CHUNK if broken == "chunk_size" else GOOD_CHUNK))

    result = outcome(
        linear_cross_entropy,
        hidden,
        weight,
        target,
        bias,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        reduction=reduction,
        chunk_size=chunk_size,
    )
    event("refused" if isinstance(result, Refused) else "returned")
    if broken is not None:
        assert isinstance(result, Refused), f"accepted a bad `{broken}`"
        return
    assert not isinstance(result, Refused), result
    expected = cross_entropy_64(
        hidden, weight, target, bias, ignore_index, label_smoothing, reduction
    )
    assert result.shape == () and result.dtype == (
        torch.float64 if dtype == torch.float64 else torch.float32
    )
    tolerance = loss_tolerance(hidden, weight, bias)
    if expected is not None and tolerance is not None:
        assert_close(result, expected, *tolerance)
        if finite(hidden, weight, bias, expected):
            kwargs = dict(
                ignore_index=ignore_index,
                label_smoothing=label_smoothing,
                reduction=reduction,
            )

            def fused(hidden, weight, bias):
                return linear_cross_entropy(
                    hidden, weight, target, bias, chunk_size=chunk_size, **kwargs
                )

            def reference(hidden, weight, bias):
                return cross_entropy_64(hidden, weight, target, bias, *kwargs.values())

            seed = draw(st.integers(0, 99))
            inputs = (hidden, weight, bias)
            # a gradient's entries are sums of (softmax - target) times an input's: of the
            # inputs' size even where they cancel to 0 (label_smoothing 1, equal logits)
            floor = max(float(t.abs().amax()) for t in inputs if t is not None and t.numel())
            assert_grads_match(fused, reference, inputs, 4 * tolerance[0], seed, floor)


BAD_NUM_ITEMS = [0, -1, -2.5, math.nan, "7", True, [3], torch.ones(2)]
GOOD_NUM_ITEMS = [None, None, 7, 2.5, torch.tensor(3.0), torch.tensor([4.0]), torch.tensor(5)]


@property_settings(80)
@given(data=st.data())
def test_causal_lm_loss(data):
    draw = data.draw
    lead = tuple(draw(st.lists(st.integers(0, 5), min_size=1, max_size=2)))  # (..., T)
    h, v = draw(st.sampled_from([1, 3, 8])), draw(st.sampled_from([1, 5, 17]))
    dtype = draw(st.sampled_from(FLOATS))
    broken = draw(
        st.sampled_from(
            [None] * 4
            + ["hidden_states", "lm_head_weight", "labels", "shift_labels", "lm_head_bias"]
            + ["ignore_index", "num_items_in_batch", "no_labels"]
        )
    )
    bad = bad_dtypes(FLOATS)
    ignore_index = (
        draw(st.sampled_from(BAD_IGNORE_INDEX))
        if broken == "ignore_index"
        else draw(st.sampled_from([-100, -100, 0]))
    )
    if broken == "hidden_states":
        hidden = draw(
            broken_tensor((*lead, h), dtype, bad_dtypes=bad, bad_shape=lambda s: len(s) < 2)
        )
    else:
        hidden = draw(tensor((*lead, h), dtype))
    if broken == "lm_head_weight":
        weight = draw(
            broken_tensor(
                (v, h), dtype, bad_dtypes=bad, bad_shape=lambda s: len(s) != 2 or s[1] != h
            )
        )
    else:
        weight = draw(tensor((v, h), dtype, scale=1 / h**0.5))
    if broken == "lm_head_bias":
        bias = draw(broken_tensor((v,), dtype, bad_dtypes=bad, bad_shape=lambda s: s != (v,)))
    else:
        bias = draw(st.none() | tensor((v,), dtype))
    labels = torch.tensor(
        [draw(good_target(v, ignore_index)) for _ in range(math.prod(lead))], dtype=torch.int64
    ).reshape(lead)
    bad_labels = (*FLOATS, torch.int32)
    use_shift = (draw(st.booleans()) and broken != "labels") or broken == "shift_labels"
    shift_labels = None
    if use_shift:
        shift_labels = labels
        labels = draw(st.none() | st.just(labels))
        if broken == "shift_labels":
            shift_labels = draw(
                broken_tensor(
                    lead, torch.int64, bad_dtypes=bad_labels, bad_shape=lambda s: s != lead
                )
            )
    elif broken == "labels":
        labels = draw(
            broken_tensor(lead, torch.int64, bad_dtypes=bad_labels, bad_shape=lambda s: s != lead)
        )
    if broken == "no_labels":
        labels = shift_labels = None
    num_items = draw(
        st.sampled_from(BAD_NUM_ITEMS if broken == "num_items_in_batch" else GOOD_NUM_ITEMS)
    )
    label_smoothing = draw(st.sampled_from(GOOD_SMOOTHING))
    chunk_size = draw(st.sampled_from(GOOD_CHUNK))

    result = outcome(
        causal_lm_loss,
        hidden,
        weight,
        labels,
        ignore_index,
        num_items_in_batch=num_items,
        shift_labels=shift_labels,
        lm_head_bias=bias,
        label_smoothing=label_smoothing,
        chunk_size=chunk_size,
    )
    event("refused" if isinstance(result, Refused) else "returned")
    if broken is not None:
        assert isinstance(result, Refused), f"accepted a bad `{broken}`"
        return
    assert not isinstance(result, Refused), result
    if shift_labels is None:  # position t predicts token t + 1
        shift_labels = torch.cat(
            (labels[..., 1:], torch.full_like(labels[..., :1], ignore_index)), dim=-1
        )
    reduction = "mean" if num_items is None else "sum"
    expected = cross_entropy_64(
        hidden, weight, shift_labels, bias, ignore_index, label_smoothing, reduction
    )
    if num_items is not None:
        expected = expected / (
            num_items.double() if isinstance(num_items, torch.Tensor) else num_items
        )
    tolerance = loss_tolerance(hidden, weight, bias)
    if tolerance is not None:
        assert_close(result, expected, *tolerance)


# --- what the properties found (issue 49), as plain regression tests ------------------------------


def test_rms_norm_reads_a_strided_weight_through_its_strides():
    """A weight that is a view with a stride (every other element of a longer tensor) was read
    as if contiguous, forward and backward (both kernels take no weight stride)."""
    x = torch.randn(3, 8, dtype=torch.float32)
    weight = torch.randn(16)[::2]
    dense = weight.contiguous()
    torch.testing.assert_close(rms_norm(x, weight), rms_norm(x, dense))
    leaves = [t.clone().requires_grad_() for t in (x, weight, x, dense)]
    rms_norm(leaves[0], leaves[1]).sum().backward()
    rms_norm(leaves[2], leaves[3]).sum().backward()
    torch.testing.assert_close(leaves[0].grad, leaves[2].grad)
    torch.testing.assert_close(leaves[1].grad, leaves[3].grad)


@pytest.mark.parametrize(
    ("change", "error", "name"),
    [
        ({"lm_head_weight": torch.randn(())}, ValueError, "lm_head_weight"),
        ({"lm_head_weight": torch.randn(5, 3)}, ValueError, "lm_head_weight"),
        ({"lm_head_weight": torch.randn(5, 4).double()}, TypeError, "lm_head_weight"),
        ({"lm_head_bias": torch.randn(())}, ValueError, "lm_head_bias"),
        ({"lm_head_bias": torch.ones(5, dtype=torch.int64)}, TypeError, "lm_head_bias"),
        ({"hidden_states": torch.ones(2, 3, 4, dtype=torch.int64)}, TypeError, "hidden_states"),
    ],
)
def test_causal_lm_loss_names_its_own_arguments(change, error, name):
    """``causal_lm_loss``'s errors from ``linear_cross_entropy`` named that function's
    ``weight``, ``bias`` and ``hidden``, none of them an argument of ``causal_lm_loss``."""
    args = {
        "hidden_states": torch.randn(2, 3, 4),
        "lm_head_weight": torch.randn(5, 4),
        "labels": torch.randint(0, 5, (2, 3)),
        "lm_head_bias": None,
    } | change
    with pytest.raises(error, match=f"^causal_lm_loss: .*`{name}`"):
        causal_lm_loss(**args)
