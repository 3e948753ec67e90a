"""Shared helpers for the flash-attn2 tests: inputs, gradients, tolerances."""

from __future__ import annotations

import torch

from llmsys.flash_attn2 import attention_reference, ops
from llmsys.triton_launch import forget
from llmsys_dev.compare import relative_error


def set_switch(monkeypatch, name: str, value) -> None:
    """``ops.<name> = value`` (a module switch the ops' impls read) until ``monkeypatch`` undoes
    it, and the ops' recorded replays forgotten, as they were recorded with the old value. (The
    root conftest forgets them again before the next test.)"""
    monkeypatch.setattr(ops, name, value)
    forget(ops.flash_attn2_fwd, ops.flash_attn2_bwd)


def spy_on_launches(monkeypatch) -> list[tuple]:
    """From now on, (kernel, constexprs) of every launch of the ops' impls, in order."""
    launched, launch = [], ops.launch

    def spy(kernel, grid, args, constexprs, *rest, **options):
        launched.append((kernel, constexprs))
        launch(kernel, grid, args, constexprs, *rest, **options)

    monkeypatch.setattr(ops, "launch", spy)
    return launched


def make_qkv(q_shape, kv_shape, dtype=torch.float32, device="cpu", scale=1.0):
    """Fresh random (q, k, v) leaves that require grad; values ~ N(0, scale^2)."""
    q = (scale * torch.randn(q_shape, device=device)).to(dtype).requires_grad_()
    k = (scale * torch.randn(kv_shape, device=device)).to(dtype).requires_grad_()
    v = (scale * torch.randn(kv_shape, device=device)).to(dtype).requires_grad_()
    return q, k, v


def run_with_grads(fn, q, k, v, grad_out):
    """(out, dq, dk, dv) of ``fn(q, k, v)`` for fresh leaves holding the values of q, k, v."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out)
    return out.detach(), dq, dk, dv


def reference_with_grads(q, k, v, grad_out, causal, scale=None, upcast=True):
    """(out, lse, dq, dk, dv) of the materialized-softmax spec (float64 when ``upcast``)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = attention_reference(q, k, v, causal, scale, upcast=upcast)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out)
    return out.detach(), lse, dq, dk, dv


# Relative (norm-wise) error bound against the float64 spec, by dtype and device. On CPU the
# interpreter computes float32 dots exactly; on a GPU float32 runs TF32 dots (10-bit mantissa).
REL_TOL = {
    ("cpu", torch.float32): 2e-5,
    ("cuda", torch.float32): 5e-3,
    ("cpu", torch.float16): 5e-3,
    ("cuda", torch.float16): 5e-3,
    ("cpu", torch.bfloat16): 3e-2,  # the interpreter truncates float32 -> bfloat16 casts
    ("cuda", torch.bfloat16): 2e-2,
}


def assert_matches_spec(results, spec, dtype, device, names=("out", "dq", "dk", "dv")) -> None:
    """Every tensor of ``results`` is finite and within REL_TOL of its ``spec`` counterpart."""
    tol = REL_TOL[(torch.device(device).type, dtype)]
    for name, got, want in zip(names, results, spec, strict=True):
        assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.isfinite(got).all(), f"{name} has non-finite values"
        error = relative_error(got, want)
        assert error <= tol, f"{name}: relative error {error:.2e} > {tol:.0e}"


def check_assignment_case(function, causal: bool, device: str = "cpu") -> None:
    """The CS336 assignment's check through ``function.apply(q, k, v, is_causal)``: batch 4, 128
    queries and keys, d 64; O, the one saved L of shape q.shape[:-1], dQ, dK and dV within
    atol = rtol = 1e-2 of the materialized-softmax spec."""
    q, k, v = make_qkv((4, 128, 64), (4, 128, 64), device=device)
    grad_out = torch.randn(4, 128, 64, device=device)
    out = function.apply(q, k, v, causal)
    saved = [t for t in out.grad_fn.saved_tensors if t.shape == (4, 128)]
    assert len(saved) == 1, "exactly one log-sum-exp tensor of shape q.shape[:-1]"
    out.backward(grad_out)
    ref_out, ref_lse, *ref_grads = reference_with_grads(q, k, v, grad_out, causal)
    tol = {"atol": 1e-2, "rtol": 1e-2, "check_dtype": False}
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(saved[0], ref_lse, **tol)
    for got, want in zip((q.grad, k.grad, v.grad), ref_grads, strict=True):
        torch.testing.assert_close(got, want, **tol)
