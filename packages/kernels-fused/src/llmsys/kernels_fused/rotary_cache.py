"""Rotary embeddings on q and k with the KV cache's append, in one Triton launch (issue 46).

A decode step over a static KV cache rotates q and k (``rotary``), then writes the new keys and
values into the cache at each sequence's length (transformers' ``StaticLayer.update``: an
``arange``, an add, the length's ``add_`` and two ``index_copy_``). Here one kernel does both:
q is rotated into a new tensor, k is rotated straight into its cache rows, v is copied into its
own, so the rotated keys never exist outside the cache.

Layout: ``q`` ``(B, Hq, N_NEW, D)``, ``k`` and ``v`` ``(B, H_KV, N_NEW, D)``, any strides
(Hugging Face's ``proj(x).view(B, N_NEW, H, D).transpose(1, 2)`` is read in place); ``cos``,
``sin`` ``(B or 1, N_NEW, D)`` as for ``rotary``; ``k_cache``, ``v_cache``
``(B, H_KV, CAPACITY, D)`` in k's dtype, any strides, written in place; ``cache_seqlens``
``(B,)`` the rows each sequence holds before the append (any strides: transformers' one 0-d
length expanded to ``(B,)`` has stride 0). New token ``i`` of sequence ``b`` goes to row
``cache_seqlens[b] + i``. The lengths are not advanced: that is the caller's
(``decode_attention`` then reads the cache with ``cache_seqlens + N_NEW``).

One program per (sequence, new token), as ``rotary``'s: it loads that position's ``cos`` and
``sin`` once, rotates every q head into ``q_out``, and, where the token's row lies in
``[0, CAPACITY)``, every k head into the cache and every v head after it. The row is read on the
device, so nothing goes back to the host and a CUDA graph replays the launch for any lengths;
rows outside the cache are not written (a CUDA call's lengths are not checked on the host).

Reading order: kernel -> checks -> launcher -> registered op and its fake -> autograd -> public.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from llmsys.triton_launch import (
    call_below_autograd,
    checks,
    define_op,
    launch,
    runs_under_interpreter,
    wants_grad,
)

from .reference import rotary_reference
from .rotary import (
    NAMESPACE,
    NUM_WARPS,
    _load_cos_sin,
    _rotate_heads,
    check_inputs,
    launch_config,
)

OP = "rotary_into_cache"
SEQLEN_DTYPES = (torch.int32, torch.int64)

# --- kernel --------------------------------------------------------------------------------------


@triton.jit
def _copy_heads(
    x_ptr,  # x[b, 0, s, 0]
    out_ptr,  # out[b, 0, row, 0]
    n_heads,
    stride_xh,
    stride_xd,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    offs_d = tl.arange(0, BLOCK_D)[None, :]  # (1, BLOCK_D)
    for h0 in range(0, n_heads, BLOCK_H):
        offs_h = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)[:, None]  # (BLOCK_H, 1)
        mask = (offs_h < n_heads) & (offs_d < HEAD_DIM)
        x = tl.load(x_ptr + offs_h * stride_xh + offs_d * stride_xd, mask=mask)
        tl.store(out_ptr + offs_h * stride_oh + offs_d * stride_od, x, mask=mask)


@triton.jit(do_not_specialize=["seq_len", "capacity"])
def rotary_into_cache_kernel(
    # pointers
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    seqlens_ptr,  # (B,) int32 / int64: rows before the append
    # sizes
    seq_len,  # new tokens
    n_q_heads,
    n_kv_heads,
    capacity,
    # strides, (batch, head, position or row, dim) for the 4-D tensors, (batch, position, dim)
    # for cos and sin (batch stride 0 when they have one row for every batch)
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_qob, stride_qoh, stride_qos, stride_qod,
    stride_kcb, stride_kch, stride_kcn, stride_kcd,
    stride_vcb, stride_vch, stride_vcn, stride_vcd,
    stride_cb, stride_cs, stride_cd,
    stride_sb, stride_ss, stride_sd,
    stride_lens,
    # meta-parameters
    HALF: tl.constexpr,  # D // 2
    COMPUTE_DTYPE: tl.constexpr,
    BLOCK_HQ: tl.constexpr,  # q heads per step of the head loop
    BLOCK_HK: tl.constexpr,  # k and v heads per step
    BLOCK_HALF: tl.constexpr,  # next_power_of_2(HALF)
):  # fmt: skip
    # One program per (b, s):
    #   c1, c2, s1, s2 = halves of cos[b, s], sin[b, s]       (loaded once, float32)
    #   q_out[b, :, s] = rotate(q[b, :, s])
    #   row = cache_seqlens[b] + s
    #   if 0 <= row < capacity:
    #       k_cache[b, :, row] = rotate(k[b, :, s]);  v_cache[b, :, row] = v[b, :, s]
    pid = tl.program_id(0).to(tl.int64)
    b = pid // seq_len
    s = pid - b * seq_len

    cos1, cos2, sin1, sin2 = _load_cos_sin(
        cos_ptr + b * stride_cb + s * stride_cs, sin_ptr + b * stride_sb + s * stride_ss,
        stride_cd, stride_sd, HALF, COMPUTE_DTYPE, BLOCK_HALF,
    )  # fmt: skip

    _rotate_heads(
        q_ptr + b * stride_qb + s * stride_qs, q_out_ptr + b * stride_qob + s * stride_qos,
        n_q_heads, stride_qh, stride_qd, stride_qoh, stride_qod, cos1, cos2, sin1, sin2,
        HALF, COMPUTE_DTYPE, False, BLOCK_HQ, BLOCK_HALF,
    )  # fmt: skip
    row = tl.load(seqlens_ptr + b * stride_lens).to(tl.int64) + s
    if (row >= 0) & (row < capacity):  # one branch for the whole program: its token's row
        _rotate_heads(
            k_ptr + b * stride_kb + s * stride_ks, k_cache_ptr + b * stride_kcb + row * stride_kcn,
            n_kv_heads, stride_kh, stride_kd, stride_kch, stride_kcd, cos1, cos2, sin1, sin2,
            HALF, COMPUTE_DTYPE, False, BLOCK_HK, BLOCK_HALF,
        )  # fmt: skip
        _copy_heads(
            v_ptr + b * stride_vb + s * stride_vs, v_cache_ptr + b * stride_vcb + row * stride_vcn,
            n_kv_heads, stride_vh, stride_vd, stride_vch, stride_vcd,
            2 * HALF, BLOCK_HK, 2 * BLOCK_HALF,
        )  # fmt: skip


# --- checks --------------------------------------------------------------------------------------


def check_cache_inputs(
    op: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    values: bool = True,
) -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument unless the inputs fit the op.
    ``rotary``'s checks for q, k, cos and sin, then v, the caches and the lengths. Only metadata
    is read, except on CPU, where the lengths' values are checked too when ``values`` (a fake
    implementation, under tracing, has none to read)."""
    check_inputs(op, ("q", "k"), q, k, cos, sin)
    checks.tensor(op, "v", v)
    checks.tensor(op, "k_cache", k_cache)
    checks.tensor(op, "v_cache", v_cache)
    checks.tensor(op, "cache_seqlens", cache_seqlens, SEQLEN_DTYPES)
    for name, t in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        checks.same_dtype(op, name, t, "k", k)
    for name, t in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("cache_seqlens", cache_seqlens)):  # fmt: skip
        checks.same_device(op, name, t, "q", q)
    checks.same_shape(op, "v", v, "k", k)
    batch, kv_heads, new_tokens, head_dim = k.shape
    if k_cache.dim() != 4 or k_cache.shape[:2] != (batch, kv_heads) or k_cache.shape[3] != head_dim:
        raise ValueError(
            f"{op}: `k_cache` must be (batch, kv_heads, capacity, head_dim) with the batch, "
            f"kv_heads and head_dim of `k` {tuple(k.shape)}, got {tuple(k_cache.shape)}"
        )
    checks.same_shape(op, "v_cache", v_cache, "k_cache", k_cache)
    if cache_seqlens.shape != (batch,):
        raise ValueError(
            f"{op}: `cache_seqlens` must have shape ({batch},) (one length per sequence), got "
            f"{tuple(cache_seqlens.shape)}"
        )
    capacity = k_cache.shape[2]
    if values and cache_seqlens.device.type == "cpu" and batch:  # a GPU's stay on the GPU
        low, high = int(cache_seqlens.min()), int(cache_seqlens.max())
        if low < 0 or high + new_tokens > capacity:
            raise ValueError(
                f"{op}: `cache_seqlens` must be between 0 and the capacity {capacity} less the "
                f"{new_tokens} new tokens, got values from {low} to {high}"
            )


# --- launcher ------------------------------------------------------------------------------------

# Under TRITON_INTERPRET=1 `triton.jit` returns an interpreter object that runs on CPU tensors.
CPU_RUNS_TRITON = runs_under_interpreter(rotary_into_cache_kernel)


def _fallback(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
) -> None:
    """Plain PyTorch, any device: the eager reference and an indexed copy per sequence. (Only
    CPU takes it, where the lengths were checked.)"""
    q_rotated, k_rotated = rotary_reference(q, k, cos, sin, upcast=True)
    q_out.copy_(q_rotated)
    new_tokens = k.shape[2]
    for b, start in enumerate(cache_seqlens.tolist()):
        k_cache[b, :, start : start + new_tokens] = k_rotated[b]
        v_cache[b, :, start : start + new_tokens] = v[b]


def rotary_into_cache_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
) -> torch.Tensor:
    """Rotated q in a new tensor; rotated k and v written into the cache: see the module
    docstring."""
    check_cache_inputs(OP, q, k, v, cos, sin, k_cache, v_cache, cache_seqlens)
    # empty_like keeps a dense input's layout (HF's transposed q stays (B, S, H, D) in memory).
    q_out = torch.empty_like(q)
    if not q.is_cuda and not CPU_RUNS_TRITON:  # plain CPU: the eager reference
        _fallback(q, k, v, cos, sin, q_out, k_cache, v_cache, cache_seqlens)
        return q_out
    if not (q.numel() or k.numel()):
        return q_out
    batch, n_q_heads, seq_len, head_dim = q.shape
    cos_stride_b, *cos_strides = cos.stride()
    sin_stride_b, *sin_strides = sin.stride()
    if cos.shape[0] == 1:  # one row of cos and sin for every batch
        cos_stride_b = sin_stride_b = 0
    block_hq, block_hk, block_half = launch_config(n_q_heads, k.shape[1], head_dim)
    pointers = (q, k, v, cos, sin, q_out, k_cache, v_cache, cache_seqlens)
    sizes = (seq_len, n_q_heads, k.shape[1], k_cache.shape[2])
    strides = (
        *q.stride(), *k.stride(), *v.stride(), *q_out.stride(), *k_cache.stride(),
        *v_cache.stride(), cos_stride_b, *cos_strides, sin_stride_b, *sin_strides,
        cache_seqlens.stride(0),
    )  # fmt: skip
    constexprs = {
        "HALF": head_dim // 2,
        "COMPUTE_DTYPE": tl.float64 if q.dtype == torch.float64 else tl.float32,
        "BLOCK_HQ": block_hq,
        "BLOCK_HK": block_hk,
        "BLOCK_HALF": block_half,
    }
    launch(
        rotary_into_cache_kernel,
        batch * seq_len,
        (*pointers, *sizes, *strides),
        constexprs,
        num_warps=NUM_WARPS,
    )
    return q_out


# --- registration --------------------------------------------------------------------------------


def _rotary_into_cache_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
) -> torch.Tensor:
    check_cache_inputs(OP, q, k, v, cos, sin, k_cache, v_cache, cache_seqlens, values=False)
    return torch.empty_like(q)


_lib = torch.library.Library(NAMESPACE, "FRAGMENT")
rotary_into_cache_op = define_op(
    _lib,
    "rotary_into_cache(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
    "Tensor(b!) v_cache, Tensor cache_seqlens) -> Tensor",
    rotary_into_cache_impl,
    _rotary_into_cache_fake,
    replays=True,
)


def _inference_only(what: str) -> RuntimeError:
    return RuntimeError(
        f"{what} is inference-only: it has no backward. Run it under torch.no_grad() or "
        "torch.inference_mode(), or pass detached tensors."
    )


# torch.library.register_autograd takes only functional ops: this in-place op gets a plain
# Autograd kernel that refuses a call autograd would record, and otherwise runs below autograd.
def _rotary_into_cache_autograd(*args: Any) -> torch.Tensor:
    if wants_grad(*args):
        raise _inference_only(f"torch.ops.{NAMESPACE}.{OP}")
    with torch._C._AutoDispatchBelowAutograd():
        return rotary_into_cache_op(*args)


torch.library.impl(f"{NAMESPACE}::{OP}", "Autograd", _rotary_into_cache_autograd, lib=_lib)


# --- public --------------------------------------------------------------------------------------


def rotary_into_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
) -> torch.Tensor:
    """Rotary embeddings on q and k, with k and v appended to a KV cache in place: one launch.

    What ``rotary(q, k, cos, sin)`` then a static cache's append computes: ``q`` rotated into a
    new tensor, and for new token ``i`` of sequence ``b``, its rotated key written to
    ``k_cache[b, :, cache_seqlens[b] + i]`` and its value to ``v_cache[b, :, cache_seqlens[b] +
    i]`` (every head). ``cache_seqlens`` is not changed: after the append, the lengths for
    ``decode_attention`` are ``cache_seqlens + N_NEW``.

    Args:
        q: queries ``(B, Hq, N_NEW, D)``, float16, bfloat16, float32 or float64, any strides
            (e.g. ``q_proj(x).view(B, N_NEW, Hq, D).transpose(1, 2)``), ``D`` even.
        k: the new keys ``(B, H_KV, N_NEW, D)``, q's dtype and device, any strides; ``H_KV`` may
            differ from ``Hq`` (grouped-query attention).
        v: the new values, the shape, dtype and device of ``k``, any strides.
        cos, sin: ``(B or 1, N_NEW, D)`` as for ``rotary``: in q's dtype or float32 (both the
            same), any strides.
        k_cache: ``(B, H_KV, CAPACITY, D)`` in k's dtype on q's device, any strides (one
            layer's keys); written in place.
        v_cache: the shape, dtype and device of ``k_cache``; written in place.
        cache_seqlens: ``(B,)`` int32 or int64 on q's device, any strides (an expanded 0-d
            length has stride 0): the rows each sequence holds before the append, from 0 to
            ``CAPACITY - N_NEW``. Checked on CPU only (a CUDA check would wait for the GPU); on
            CUDA, rows that would fall outside the cache are not written.

    Returns:
        ``q_out``: the rotated queries, the shape and dtype of ``q``, laid out as ``rotary``
        lays it out (``torch.empty_like(q)``). The cache rows of the new tokens hold the rotated
        keys (computed in float32, float64 for float64, rounded once, as ``rotary``'s) and the
        values as they came; other rows are not touched. No host synchronisation: a CUDA graph
        captured once replays for any lengths. Inference only.

    Raises:
        TypeError: an argument is not a tensor, a dtype is unsupported, ``k``, ``v`` or a cache
            has another dtype than ``q``'s, ``cos``/``sin`` have another dtype than ``q``'s or
            float32, or ``cache_seqlens`` is not int32 or int64.
        ValueError: a shape or device does not fit (``rotary``'s, ``v`` not ``k``'s shape, a
            cache not ``(B, H_KV, CAPACITY, D)``, ``cache_seqlens`` not ``(B,)``), or, on CPU, a
            length is negative or leaves no room for the new tokens.
        RuntimeError: a gradient is wanted (grad mode on and an argument requires grad).

    On CPU without ``TRITON_INTERPRET=1`` it runs the eager reference and indexed copies. Works
    under ``torch.compile(fullgraph=True)`` (the op mutates ``k_cache`` and ``v_cache``) and in
    CUDA graphs.
    """
    checks.tensors(
        OP, q=q, k=k, v=v, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache,
        cache_seqlens=cache_seqlens,
    )  # fmt: skip
    if wants_grad(q, k, v, cos, sin, k_cache, v_cache):
        raise _inference_only(OP)
    try:
        return call_below_autograd(
            rotary_into_cache_op, q, k, v, cos, sin, k_cache, v_cache, cache_seqlens
        )
    except (TypeError, ValueError) as error:  # named as the caller called it
        raise checks.as_called(error, OP) from None
