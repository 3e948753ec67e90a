"""The int8 KV cache's append: new keys and values quantized into the cache, one scale per token
and head, at each sequence's length read on the device (issue 46).

Layout: ``k_new``, ``v_new`` ``(B, H_KV, N_NEW, D)`` float16 / bfloat16 / float32, any strides
(a projection transposed from ``(B, N_NEW, H_KV, D)`` is read in place); ``k_cache``,
``v_cache`` ``(B, H_KV, CAPACITY, D)`` int8 and ``k_scale``, ``v_scale`` ``(B, H_KV, CAPACITY)``
float32, any strides, written in place; ``cache_seqlens`` ``(B,)`` the rows each sequence holds
before the append: new token ``i`` of sequence ``b`` goes to row ``cache_seqlens[b] + i``.
``decode_attention(..., k_scale=, v_scale=)`` reads the cache back.

The quantizer is ``quantize_kv_int8_reference``'s: symmetric, ``scale = max|row| / 127``.

Why float32 scales, not the input's dtype: a float16 scale is subnormal below 6.1e-5, so a
token whose largest value is under 7.8e-3 would lose the scale's precision (and under 7.6e-6,
the whole token), which is avoidable at 4 bytes per token and head: 3% of an int8 row at
D = 128. The decode kernel multiplies scores in float32 anyway.

One kernel, grid ``(B * H_KV * ceil(N_NEW / BLOCK_T),)``, a program per block of new tokens of
one (sequence, kv head), keys and values both: one launch per layer and step, nothing read back
to the host, so a CUDA graph replays it for any lengths. Rows that would land outside
``[0, CAPACITY)`` are not written (a CUDA call's lengths are not checked on the host).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from llmsys.triton_launch import (
    call_below_autograd,
    cdiv,
    checks,
    define_op,
    launch,
    next_power_of_2,
    wants_grad,
)
from llmsys.triton_launch.precise import round_half_even

from . import ops
from .decode import SEQLEN_DTYPES, inference_only_error
from .reference import INT8_MAX, quantize_kv_int8_reference
from .tuning import block_d

OP = "flash_attn2_append_kv_int8"
BLOCK_T = 16  # new tokens per program (fewer, padded to a power of two, when fewer are appended)
_QMAX = tl.constexpr(float(INT8_MAX))  # Triton reads module globals only when they are constexpr


# --- kernel --------------------------------------------------------------------------------------


@triton.jit
def _quantize_rows(src, dst, scale_ptr, rows, pos, ok, stride_sn, stride_sd, stride_dn, stride_dd,
                   stride_scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   PRECISE: tl.constexpr):  # fmt: skip
    """Rows ``rows`` of ``src`` (one head's new tokens) quantized into rows ``pos`` of ``dst``
    (one head of the cache) and ``scale_ptr``, where ``ok``."""
    offs_d = tl.arange(0, BLOCK_D)
    mask = ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    x_ptrs = src + rows[:, None] * stride_sn + offs_d[None, :] * stride_sd
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)  # (BLOCK_T, BLOCK_D)
    amax = tl.max(tl.where(x == x, tl.abs(x), float("inf")), axis=1)  # NaN counts as inf
    scale = tl.div_rn(amax, tl.full(amax.shape, _QMAX, tl.float32))  # IEEE, as the reference
    scale = tl.where(amax < float("inf"), scale, float("nan"))
    nonzero = scale > 0  # a zero row (scale 0) and a non-finite one (NaN) store q = 0
    y = tl.div_rn(x, tl.broadcast_to(tl.where(nonzero, scale, 1.0)[:, None], x.shape))
    y = round_half_even(tl.minimum(tl.maximum(y, -_QMAX), _QMAX), PRECISE)  # clamped first
    q = tl.where(nonzero[:, None], y, 0.0).to(tl.int8)
    tl.store(dst + pos[:, None] * stride_dn + offs_d[None, :] * stride_dd, q, mask=mask)
    tl.store(scale_ptr + pos * stride_scale, scale, mask=ok)


@triton.jit(do_not_specialize=["N_NEW", "CAPACITY"])
def append_kv_int8_kernel(
    # pointers
    K_NEW,  # (B, H_KV, N_NEW, HEAD_DIM) float16 / bfloat16 / float32, any strides
    V_NEW,  # (B, H_KV, N_NEW, HEAD_DIM) k_new's dtype, any strides
    K_CACHE,  # (B, H_KV, CAPACITY, HEAD_DIM) int8, any strides
    V_CACHE,  # (B, H_KV, CAPACITY, HEAD_DIM) int8, any strides
    K_SCALE,  # (B, H_KV, CAPACITY) float32, any strides
    V_SCALE,  # (B, H_KV, CAPACITY) float32, any strides
    SEQLENS,  # (B,) int32 / int64: rows before the append
    # sizes
    N_KV_HEADS,
    N_NEW,
    CAPACITY,
    # strides (batch, head, row, dim)
    stride_knb, stride_knh, stride_knn, stride_knd,
    stride_vnb, stride_vnh, stride_vnn, stride_vnd,
    stride_kcb, stride_kch, stride_kcn, stride_kcd,
    stride_vcb, stride_vch, stride_vcn, stride_vcd,
    stride_ksb, stride_ksh, stride_ksn,
    stride_vsb, stride_vsh, stride_vsn,
    stride_lens,
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two
    BLOCK_T: tl.constexpr,  # new tokens per program
    PRECISE: tl.constexpr,  # libdevice's rint; False under the interpreter
):  # fmt: skip
    n_tiles = tl.cdiv(N_NEW, BLOCK_T)
    tile = tl.program_id(0) % n_tiles
    bh = (tl.program_id(0) // n_tiles).to(tl.int64)
    b = bh // N_KV_HEADS
    h = bh % N_KV_HEADS
    rows = tile * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,) new tokens
    pos = tl.load(SEQLENS + b * stride_lens).to(tl.int64) + rows  # their cache rows
    ok = (rows < N_NEW) & (pos >= 0) & (pos < CAPACITY)
    _quantize_rows(
        K_NEW + b * stride_knb + h * stride_knh, K_CACHE + b * stride_kcb + h * stride_kch,
        K_SCALE + b * stride_ksb + h * stride_ksh, rows, pos, ok, stride_knn, stride_knd,
        stride_kcn, stride_kcd, stride_ksn, HEAD_DIM, BLOCK_D, PRECISE,
    )  # fmt: skip
    _quantize_rows(
        V_NEW + b * stride_vnb + h * stride_vnh, V_CACHE + b * stride_vcb + h * stride_vch,
        V_SCALE + b * stride_vsb + h * stride_vsh, rows, pos, ok, stride_vnn, stride_vnd,
        stride_vcn, stride_vcd, stride_vsn, HEAD_DIM, BLOCK_D, PRECISE,
    )  # fmt: skip


# --- checks --------------------------------------------------------------------------------------


def check_append_inputs(
    op: str,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    cache_seqlens: torch.Tensor,
    values: bool = True,
) -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument unless the inputs fit the op.
    Only metadata is read, except on CPU, where the lengths' values are checked too when
    ``values`` (a fake implementation, under tracing, has none to read)."""
    checks.tensor(op, "k_new", k_new, ops.SUPPORTED_DTYPES)
    checks.tensor(op, "v_new", v_new, ops.SUPPORTED_DTYPES)
    checks.same_dtype(op, "v_new", v_new, "k_new", k_new)
    for name, t, dtype in (
        ("k_cache", k_cache, torch.int8),
        ("v_cache", v_cache, torch.int8),
        ("k_scale", k_scale, torch.float32),
        ("v_scale", v_scale, torch.float32),
    ):
        checks.tensor(op, name, t, (dtype,))
    for name, t in (("v_new", v_new), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("k_scale", k_scale), ("v_scale", v_scale)):  # fmt: skip
        checks.same_device(op, name, t, "k_new", k_new)
    checks.tensor(op, "cache_seqlens", cache_seqlens, SEQLEN_DTYPES)
    checks.same_device(op, "cache_seqlens", cache_seqlens, "k_new", k_new)
    if k_new.dim() != 4:
        raise ValueError(
            f"{op}: `k_new` must be 4-D (batch, kv_heads, new_tokens, head_dim), got shape "
            f"{tuple(k_new.shape)}"
        )
    checks.same_shape(op, "v_new", v_new, "k_new", k_new)
    batch, kv_heads, _, head_dim = k_new.shape
    if k_cache.dim() != 4 or k_cache.shape[:2] != (batch, kv_heads) or k_cache.shape[3] != head_dim:
        raise ValueError(
            f"{op}: `k_cache` must be (batch, kv_heads, capacity, head_dim) with the batch, "
            f"kv_heads and head_dim of `k_new` {tuple(k_new.shape)}, got {tuple(k_cache.shape)}"
        )
    checks.same_shape(op, "v_cache", v_cache, "k_cache", k_cache)
    capacity = k_cache.shape[2]
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale.shape != k_cache.shape[:3]:
            raise ValueError(
                f"{op}: `{name}` must have shape {tuple(k_cache.shape[:3])} (batch, kv_heads, "
                f"capacity: one scale per cached token and head), got {tuple(scale.shape)}"
            )
    if not 1 <= head_dim <= ops.MAX_HEAD_DIM:
        raise ValueError(
            f"{op}: `k_new` head_dim must be between 1 and {ops.MAX_HEAD_DIM}, got {head_dim}"
        )
    if cache_seqlens.shape != (batch,):
        raise ValueError(
            f"{op}: `cache_seqlens` must have shape ({batch},) (one length per sequence), got "
            f"{tuple(cache_seqlens.shape)}"
        )
    new_tokens = k_new.shape[2]
    if values and cache_seqlens.device.type == "cpu" and batch:  # a GPU's stay on the GPU
        low, high = int(cache_seqlens.min()), int(cache_seqlens.max())
        if low < 0 or high + new_tokens > capacity:
            raise ValueError(
                f"{op}: `cache_seqlens` must be between 0 and the capacity {capacity} less the "
                f"{new_tokens} new tokens, got values from {low} to {high}"
            )


# --- launcher ------------------------------------------------------------------------------------


def _append_fallback(
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    cache_seqlens: torch.Tensor,
) -> None:
    """Plain PyTorch, any device: the reference quantizer and an indexed copy per sequence.
    (Only CPU takes it, where the lengths were checked.)"""
    new_tokens = k_new.shape[2]
    for new, cache, scale in ((k_new, k_cache, k_scale), (v_new, v_cache, v_scale)):
        q, s = quantize_kv_int8_reference(new)  # (B, H_KV, N_NEW, D), (B, H_KV, N_NEW)
        for b, start in enumerate(cache_seqlens.tolist()):
            cache[b, :, start : start + new_tokens] = q[b]
            scale[b, :, start : start + new_tokens] = s[b]


def flash_attn2_append_kv_int8_impl(
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    cache_seqlens: torch.Tensor,
) -> None:
    """Writes the quantized ``k_new``, ``v_new`` into the cache: see the module docstring."""
    args = (k_new, v_new, k_cache, v_cache, k_scale, v_scale, cache_seqlens)
    check_append_inputs(OP, *args)
    batch, kv_heads, new_tokens, d = k_new.shape
    if batch * new_tokens == 0:
        return
    if not k_new.is_cuda and not ops.CPU_RUNS_TRITON:
        _append_fallback(*args)
        return
    block_t = min(BLOCK_T, next_power_of_2(new_tokens))
    n_tiles = cdiv(new_tokens, block_t)
    sizes = (kv_heads, new_tokens, k_cache.shape[2])
    strides = (
        *k_new.stride(), *v_new.stride(), *k_cache.stride(), *v_cache.stride(),
        *k_scale.stride(), *v_scale.stride(), cache_seqlens.stride(0),
    )  # fmt: skip
    constexprs = {
        "HEAD_DIM": d,
        "BLOCK_D": block_d(d),
        "BLOCK_T": block_t,
        "PRECISE": k_new.is_cuda,
    }
    grid = (batch * kv_heads * n_tiles,)
    launch(append_kv_int8_kernel, grid, (*args, *sizes, *strides), constexprs, num_warps=4)


# --- registration --------------------------------------------------------------------------------


def _append_fake(
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    cache_seqlens: torch.Tensor,
) -> None:
    args = (k_new, v_new, k_cache, v_cache, k_scale, v_scale, cache_seqlens)
    check_append_inputs(OP, *args, values=False)


_lib = torch.library.Library(ops.NAMESPACE, "FRAGMENT")
flash_attn2_append_kv_int8 = define_op(
    _lib,
    "flash_attn2_append_kv_int8(Tensor k_new, Tensor v_new, Tensor(a!) k_cache, "
    "Tensor(b!) v_cache, Tensor(c!) k_scale, Tensor(d!) v_scale, Tensor cache_seqlens) -> ()",
    flash_attn2_append_kv_int8_impl,
    _append_fake,
    replays=True,  # a non-empty append
)


# torch.library.register_autograd takes only functional ops: this in-place op gets a plain
# Autograd kernel that refuses a call autograd would record, and otherwise runs below autograd.
def _append_autograd(*args: Any) -> None:
    if wants_grad(*args):
        raise inference_only_error(f"torch.ops.llmsys.{OP}")
    with torch._C._AutoDispatchBelowAutograd():
        return flash_attn2_append_kv_int8(*args)


torch.library.impl(f"{ops.NAMESPACE}::{OP}", "Autograd", _append_autograd, lib=_lib)


# --- public --------------------------------------------------------------------------------------


def append_kv_int8(
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    cache_seqlens: torch.Tensor,
) -> None:
    """Quantize new keys and values into an int8 KV cache, in place, one scale per token and head.

    Token ``i`` of sequence ``b`` goes to row ``cache_seqlens[b] + i`` of every head: its int8
    values to ``k_cache`` / ``v_cache``, its float32 scale to ``k_scale`` / ``v_scale``, with
    ``scale = max|x| / 127`` and ``q = round(x / scale)`` over the head dim
    (``quantize_kv_int8_reference``). ``cache_seqlens`` is not changed: after the append, the
    caller's lengths for ``decode_attention`` are ``cache_seqlens + N_NEW``.

    Args:
        k_new: the new tokens' keys, ``(B, H_KV, N_NEW, D)``, float16, bfloat16 or float32, any
            strides; any number of tokens (a decode step, or a whole prompt into an empty cache).
        v_new: the new values, the shape, dtype and device of ``k_new``.
        k_cache: ``(B, H_KV, CAPACITY, D)`` int8 (one layer), on k_new's device, any strides.
        v_cache: the shape, dtype and device of ``k_cache``.
        k_scale: ``(B, H_KV, CAPACITY)`` float32 on k_new's device, any strides: the keys'
            scales, one per cached token and head.
        v_scale: the values' scales, as ``k_scale``.
        cache_seqlens: ``(B,)`` int32 or int64 on k_new's device: the rows each sequence holds
            before the append, from 0 to ``CAPACITY - N_NEW``. Checked on CPU only (a CUDA check
            would wait for the GPU); on CUDA rows that would fall outside the cache are dropped.

    Returns:
        None: the cache and scale tensors are written in place (rows outside the new tokens'
        are not touched). No host synchronisation: a CUDA graph captured once replays for any
        lengths. Inference only.

    Raises:
        TypeError: an argument is not a tensor, or a dtype is unsupported or mismatched.
        ValueError: shapes, devices or (CPU) lengths do not fit.
        RuntimeError: grad mode is on and ``k_new`` or ``v_new`` requires grad.
    """
    checks.tensors(
        "append_kv_int8", k_new=k_new, v_new=v_new, k_cache=k_cache, v_cache=v_cache,
        k_scale=k_scale, v_scale=v_scale, cache_seqlens=cache_seqlens,
    )  # fmt: skip
    if wants_grad(k_new, v_new):
        raise inference_only_error("append_kv_int8")
    try:
        call_below_autograd(
            flash_attn2_append_kv_int8, k_new, v_new, k_cache, v_cache, k_scale, v_scale,
            cache_seqlens,
        )  # fmt: skip
    except (TypeError, ValueError) as error:  # named as the caller called it
        raise checks.as_called(error, "append_kv_int8") from None
