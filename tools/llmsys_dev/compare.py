"""Comparing with a reference: relative error, and a patched Hugging Face model against the stock
one (logits and every gradient), for the packages' tests."""

from __future__ import annotations

import torch


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64 (0 for two empty tensors)."""
    expected = expected.double()
    denominator = expected.norm().item() or 1.0
    return (actual.double() - expected).norm().item() / denominator


def logits_and_grads(model, ids: torch.Tensor, weight: torch.Tensor):
    """The model's logits for ``ids`` and every parameter's gradient of a random linear loss of
    them (``weight`` has the logits' shape)."""
    logits = model(ids).logits
    (logits * weight.to(logits.dtype)).sum().backward()
    return logits.detach(), {name: p.grad for name, p in model.named_parameters()}


def assert_matches_stock(ours, stock, tol: float) -> None:
    """``ours`` and ``stock`` are ``(logits, grads)`` pairs: finite, and each within ``tol``
    relative error of the stock model's, for the same parameter names."""
    (logits, grads), (want_logits, want_grads) = ours, stock
    assert torch.isfinite(logits).all() and relative_error(logits, want_logits) < tol
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        assert torch.isfinite(grad).all(), name
        assert relative_error(grad, want_grads[name]) < tol, name
