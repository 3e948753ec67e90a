"""Rotary position embeddings on q and k in one Triton launch, forward and backward.

Hugging Face's ``apply_rotary_pos_emb`` (Llama, ``unsqueeze_dim=1``) computes, for ``x`` in
``(q, k)`` of shape ``(B, H, S, D)`` and ``cos, sin`` of shape ``(B or 1, S, D)``::

    out = x * cos + rotate_half(x) * sin,      rotate_half(x) = cat(-x2, x1)

that is, per half of the last dim::

    out1 = x1 * cos1 - x2 * sin1               out2 = x2 * cos2 + x1 * sin2

Eager launches five kernels per tensor (mul, neg, cat, mul, add), each a pass over memory, and
rounds three times in bfloat16. Here one program per (batch, position) loads that position's
``cos`` and ``sin`` once and rotates every head of q and then of k, in float32, rounding once:
q and k are read once and written once. The backward is the same kernel with the
transposed rotation (``reference.rotary_backward_reference``)::

    grad_x1 = g1 * cos1 + g2 * sin2            grad_x2 = g2 * cos2 - g1 * sin1

q and k are read through their strides (Hugging Face's q is ``q_proj(x).view(B, S, H, D)
.transpose(1, 2)``, not contiguous) and the outputs are ``torch.empty_like`` of the inputs: the
input's strides when it is dense, else dense strides in the input's order of dims (as eager's
elementwise ops lay out their outputs). The gradients likewise take the incoming gradients'.

Reading order: kernel -> launcher and checks -> registered ops and fakes -> autograd -> public.
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
    next_power_of_2,
    refuse_double_backward,
    runs_under_interpreter,
    wants_grad,
)

from .reference import rotary_backward_reference, rotary_reference

NAMESPACE = "llmsys_fused"
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# --- kernel --------------------------------------------------------------------------------------


@triton.jit
def _load_cos_sin(
    cos_ptr,  # cos[b, s, 0]
    sin_ptr,  # sin[b, s, 0]
    stride_cd,
    stride_sd,
    HALF: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """The halves of one position's cos and sin: four (1, BLOCK_HALF) tiles in COMPUTE_DTYPE."""
    offs_d = tl.arange(0, BLOCK_HALF)[None, :]
    mask_d = offs_d < HALF
    cos_ptrs = cos_ptr + offs_d * stride_cd
    sin_ptrs = sin_ptr + offs_d * stride_sd
    cos1 = tl.load(cos_ptrs, mask=mask_d, other=0.0).to(COMPUTE_DTYPE)
    cos2 = tl.load(cos_ptrs + HALF * stride_cd, mask=mask_d, other=0.0).to(COMPUTE_DTYPE)
    sin1 = tl.load(sin_ptrs, mask=mask_d, other=0.0).to(COMPUTE_DTYPE)
    sin2 = tl.load(sin_ptrs + HALF * stride_sd, mask=mask_d, other=0.0).to(COMPUTE_DTYPE)
    return cos1, cos2, sin1, sin2


@triton.jit
def _rotate_heads(
    x_ptr,  # x[b, 0, s, 0]
    out_ptr,  # out[b, 0, s, 0]
    n_heads,
    stride_xh,
    stride_xd,
    stride_oh,
    stride_od,
    cos1,  # (1, BLOCK_HALF) tiles in COMPUTE_DTYPE
    cos2,
    sin1,
    sin2,
    HALF: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    BACKWARD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    offs_d = tl.arange(0, BLOCK_HALF)[None, :]  # (1, BLOCK_HALF)
    for h0 in range(0, n_heads, BLOCK_H):
        offs_h = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)[:, None]  # (BLOCK_H, 1)
        mask = (offs_h < n_heads) & (offs_d < HALF)
        x1_ptrs = x_ptr + offs_h * stride_xh + offs_d * stride_xd
        x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(COMPUTE_DTYPE)
        x2 = tl.load(x1_ptrs + HALF * stride_xd, mask=mask, other=0.0).to(COMPUTE_DTYPE)
        if BACKWARD:
            out1 = x1 * cos1 + x2 * sin2
            out2 = x2 * cos2 - x1 * sin1
        else:
            out1 = x1 * cos1 - x2 * sin1
            out2 = x2 * cos2 + x1 * sin2
        out_dtype = out_ptr.dtype.element_ty
        o1_ptrs = out_ptr + offs_h * stride_oh + offs_d * stride_od
        tl.store(o1_ptrs, out1.to(out_dtype), mask=mask)
        tl.store(o1_ptrs + HALF * stride_od, out2.to(out_dtype), mask=mask)


@triton.jit
def rotary_kernel(
    # pointers
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    # sizes
    seq_len,
    n_q_heads,
    n_k_heads,
    # strides, (batch, head, position, dim) for the 4-D tensors, (batch, position, dim) for cos
    # and sin (batch stride 0 when they have one row for every batch)
    stride_qb,
    stride_qh,
    stride_qs,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    stride_qob,
    stride_qoh,
    stride_qos,
    stride_qod,
    stride_kob,
    stride_koh,
    stride_kos,
    stride_kod,
    stride_cb,
    stride_cs,
    stride_cd,
    stride_sb,
    stride_ss,
    stride_sd,
    # meta-parameters
    HALF: tl.constexpr,  # D // 2
    COMPUTE_DTYPE: tl.constexpr,
    BACKWARD: tl.constexpr,  # rotate by the transpose: the gradient
    BLOCK_HQ: tl.constexpr,  # q heads per step of the head loop
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,  # next_power_of_2(HALF)
):
    # One program per (b, s):
    #   c1, c2, s1, s2 = halves of cos[b, s], sin[b, s]      (loaded once, float32)
    #   for x, out in (q, q_out), (k, k_out):
    #       for each block of heads h: out[b, h, s] = rotate(x[b, h, s])
    pid = tl.program_id(0).to(tl.int64)
    b = pid // seq_len
    s = pid - b * seq_len

    cos1, cos2, sin1, sin2 = _load_cos_sin(
        cos_ptr + b * stride_cb + s * stride_cs,
        sin_ptr + b * stride_sb + s * stride_ss,
        stride_cd,
        stride_sd,
        HALF,
        COMPUTE_DTYPE,
        BLOCK_HALF,
    )

    _rotate_heads(
        q_ptr + b * stride_qb + s * stride_qs,
        q_out_ptr + b * stride_qob + s * stride_qos,
        n_q_heads,
        stride_qh,
        stride_qd,
        stride_qoh,
        stride_qod,
        cos1,
        cos2,
        sin1,
        sin2,
        HALF,
        COMPUTE_DTYPE,
        BACKWARD,
        BLOCK_HQ,
        BLOCK_HALF,
    )
    _rotate_heads(
        k_ptr + b * stride_kb + s * stride_ks,
        k_out_ptr + b * stride_kob + s * stride_kos,
        n_k_heads,
        stride_kh,
        stride_kd,
        stride_koh,
        stride_kod,
        cos1,
        cos2,
        sin1,
        sin2,
        HALF,
        COMPUTE_DTYPE,
        BACKWARD,
        BLOCK_HK,
        BLOCK_HALF,
    )


# --- launcher and checks -------------------------------------------------------------------------

# Under TRITON_INTERPRET=1 `triton.jit` returns an interpreter object that runs on CPU tensors.
CPU_RUNS_TRITON = runs_under_interpreter(rotary_kernel)

# Elements of one half-tile (BLOCK_H x BLOCK_HALF) per step of the head loop: 32 heads of
# D = 128 (Llama's q) in one step. Timed on an H100 at 4 x 2048 tokens, D = 128, 16 q / 4 kv and
# 24 q / 8 kv heads: 512 to 4096 elements were within 1%; 2 warps 36 / 53 us a call, 4 warps
# 38 / 54, 8 warps 40 / 57 (2.3-2.5 TB/s).
TILE_ELEMENTS = 2048
NUM_WARPS = 2


def check_inputs(
    op: str,
    names: tuple[str, str],
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument unless the four tensors fit.

    ``names`` are what the op calls ``q`` and ``k`` (``grad_q_out``, ``grad_k_out`` in the
    backward)."""
    q_name, k_name = names
    checks.tensor(op, q_name, q, SUPPORTED_DTYPES)
    checks.tensor(op, k_name, k)
    checks.tensor(op, "cos", cos)
    checks.tensor(op, "sin", sin)
    checks.same_dtype(op, k_name, k, q_name, q)
    if cos.dtype not in (q.dtype, torch.float32):
        raise TypeError(
            f"{op}: `cos` must have the dtype of `{q_name}` ({q.dtype}) or float32, got {cos.dtype}"
        )
    checks.same_dtype(op, "sin", sin, "cos", cos)
    for name, t in ((q_name, q), (k_name, k)):
        if t.dim() != 4:
            raise ValueError(
                f"{op}: `{name}` must be 4-D (batch, heads, seq_len, head_dim), "
                f"got shape {tuple(t.shape)}"
            )
    batch, _, seq_len, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"{op}: `{q_name}` must have an even head_dim (last dim), got {head_dim}")
    for i, what in ((0, "batch size"), (2, "seq_len"), (3, "head_dim")):
        if k.shape[i] != q.shape[i]:
            raise ValueError(
                f"{op}: `{k_name}` must have the {what} of `{q_name}` ({q.shape[i]}) in dim {i}, "
                f"got shape {tuple(k.shape)}"
            )
    if cos.dim() != 3 or cos.shape[0] not in (1, batch) or cos.shape[1:] != (seq_len, head_dim):
        raise ValueError(
            f"{op}: `cos` must have shape (1 or {batch}, {seq_len}, {head_dim}) "
            f"(batch or 1, seq_len, head_dim of `{q_name}`), got {tuple(cos.shape)}"
        )
    checks.same_shape(op, "sin", sin, "cos", cos)
    for name, t in ((k_name, k), ("cos", cos), ("sin", sin)):
        checks.same_device(op, name, t, q_name, q)


def launch_config(n_q_heads: int, n_k_heads: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_HQ, BLOCK_HK, BLOCK_HALF): whole heads per loop step, up to TILE_ELEMENTS."""
    block_half = next_power_of_2(head_dim // 2)
    most_heads = max(TILE_ELEMENTS // block_half, 1)
    return (
        min(next_power_of_2(n_q_heads), most_heads),
        min(next_power_of_2(n_k_heads), most_heads),
        block_half,
    )


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    backward: bool,
) -> None:
    batch, n_q_heads, seq_len, head_dim = q.shape
    n_k_heads = k.shape[1]
    cos_stride_b, *cos_strides = cos.stride()
    sin_stride_b, *sin_strides = sin.stride()
    if cos.shape[0] == 1:  # one row of cos and sin for every batch
        cos_stride_b = sin_stride_b = 0
    block_hq, block_hk, block_half = launch_config(n_q_heads, n_k_heads, head_dim)
    compute = tl.float64 if q.dtype == torch.float64 else tl.float32
    launch(
        rotary_kernel,
        batch * seq_len,
        (
            q,
            k,
            cos,
            sin,
            q_out,
            k_out,
            seq_len,
            n_q_heads,
            n_k_heads,
            *q.stride(),
            *k.stride(),
            *q_out.stride(),
            *k_out.stride(),
            cos_stride_b,
            *cos_strides,
            sin_stride_b,
            *sin_strides,
        ),
        {
            "HALF": head_dim // 2,
            "COMPUTE_DTYPE": compute,
            "BACKWARD": backward,
            "BLOCK_HQ": block_hq,
            "BLOCK_HK": block_hk,
            "BLOCK_HALF": block_half,
        },
        num_warps=NUM_WARPS,
    )


def _rotate(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    # empty_like keeps a dense input's layout (HF's transposed q stays (B, S, H, D) in memory).
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if not q.is_cuda and not CPU_RUNS_TRITON:  # plain CPU: the eager reference
        if backward:
            expected_q, expected_k = rotary_backward_reference(q, k, cos, sin)
        else:
            expected_q, expected_k = rotary_reference(q, k, cos, sin, upcast=True)
        return q_out.copy_(expected_q), k_out.copy_(expected_k)
    if q.numel() or k.numel():
        _launch(q, k, cos, sin, q_out, k_out, backward)
    return q_out, k_out


# --- registered ops and their fakes --------------------------------------------------------------


def _rotary_fwd(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    check_inputs("rotary_fwd", ("q", "k"), q, k, cos, sin)
    return _rotate(q, k, cos, sin, backward=False)


def _rotary_bwd(
    grad_q_out: torch.Tensor, grad_k_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    check_inputs("rotary_bwd", ("grad_q_out", "grad_k_out"), grad_q_out, grad_k_out, cos, sin)
    return _rotate(grad_q_out, grad_k_out, cos, sin, backward=True)


def _rotary_fwd_fake(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    check_inputs("rotary_fwd", ("q", "k"), q, k, cos, sin)
    return torch.empty_like(q), torch.empty_like(k)


def _rotary_bwd_fake(
    grad_q_out: torch.Tensor, grad_k_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    check_inputs("rotary_bwd", ("grad_q_out", "grad_k_out"), grad_q_out, grad_k_out, cos, sin)
    return torch.empty_like(grad_q_out), torch.empty_like(grad_k_out)


_lib = torch.library.Library(NAMESPACE, "FRAGMENT")
rotary_fwd = define_op(
    _lib,
    "rotary_fwd(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)",
    _rotary_fwd,
    _rotary_fwd_fake,
    replays=True,
)
rotary_bwd = define_op(
    _lib,
    "rotary_bwd(Tensor grad_q_out, Tensor grad_k_out, Tensor cos, Tensor sin) -> (Tensor, Tensor)",
    _rotary_bwd,
    _rotary_bwd_fake,
    replays=True,
)

# --- autograd ------------------------------------------------------------------------------------

_NO_COS_SIN_GRAD = (
    "no gradient is computed for `cos` and `sin` (Hugging Face's rotary embedding makes them "
    "without one); pass cos.detach() and sin.detach()"
)


def _setup_context(ctx: Any, inputs: tuple, output: tuple[torch.Tensor, torch.Tensor]) -> None:
    _, _, cos, sin = inputs
    ctx.save_for_backward(cos, sin)


def _backward(
    ctx: Any, grad_q_out: torch.Tensor, grad_k_out: torch.Tensor
) -> tuple[torch.Tensor | None, ...]:
    refuse_double_backward("rotary")
    if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
        raise RuntimeError(f"rotary: {_NO_COS_SIN_GRAD}")
    cos, sin = ctx.saved_tensors
    grad_q, grad_k = call_below_autograd(rotary_bwd, grad_q_out, grad_k_out, cos, sin)
    return grad_q, grad_k, None, None


class _RotaryFunction(torch.autograd.Function):
    """``rotary_fwd`` forward; both gradients from one ``rotary_bwd`` launch."""

    # forward takes ctx itself: with a separate setup_context, Function.apply binds every
    # call's arguments through inspect.signature (DECISIONS.md: host cost).
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        output = call_below_autograd(rotary_fwd, q, k, cos, sin)
        _setup_context(ctx, (q, k, cos, sin), output)
        return output

    backward = staticmethod(_backward)


# torch.ops.llmsys_fused.rotary_fwd called by name is differentiable the same way.
torch.library.register_autograd(rotary_fwd, _backward, setup_context=_setup_context)

# --- public functions ----------------------------------------------------------------------------


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embeddings on q and k in one Triton launch (Hugging Face's
    ``apply_rotary_pos_emb`` with ``unsqueeze_dim=1``): ``x * cos + rotate_half(x) * sin``.

    Args:
        q: queries ``(B, Hq, S, D)``, float16, bfloat16, float32 or float64, any strides (e.g.
            ``q_proj(x).view(B, S, Hq, D).transpose(1, 2)``), ``D`` even.
        k: keys ``(B, Hk, S, D)``, q's dtype and device; ``Hk`` may differ from ``Hq``
            (grouped-query attention).
        cos, sin: ``(B or 1, S, D)`` as Llama's rotary embedding makes them (one row per batch,
            or one row for every batch), in q's dtype or float32 (both the same), any strides.
            Their two halves need not be equal.

    Returns:
        ``(q_out, k_out)`` with the shapes and dtype of ``q`` and ``k`` (also when ``cos`` is
        float32, where eager would promote to float32), each laid out as ``torch.empty_like``
        of its input: the input's strides when dense (Hugging Face's transposed q gives an
        output laid out as ``(B, S, Hq, D)`` in memory, as eager's would be), else dense in the
        input's order of dims. Computed in float32 (float64 for float64) and rounded once: in
        bfloat16 more accurate than eager's three roundings.

    Raises:
        TypeError: an argument is not a tensor, the dtype is unsupported, ``k``'s dtype differs
            from ``q``'s, or ``cos``/``sin`` have another dtype than ``q``'s or float32.
        ValueError: a shape or device does not fit (``D`` odd, ``q`` and ``k`` differing in
            batch, seq_len or head_dim, ``cos`` not ``(B or 1, S, D)``, ``sin`` not ``cos``'s
            shape), or ``cos`` or ``sin`` requires grad where a gradient is wanted.

    On CPU without ``TRITON_INTERPRET=1`` it runs the eager reference. Both gradients come from
    one launch (``torch.ops.llmsys_fused.rotary_bwd``); no gradient for ``cos`` and ``sin``.
    Works under ``torch.compile(fullgraph=True)`` and in CUDA graphs. Double backward raises a
    ``RuntimeError``.
    """
    if not (
        isinstance(q, torch.Tensor)
        and isinstance(k, torch.Tensor)
        and isinstance(cos, torch.Tensor)
        and isinstance(sin, torch.Tensor)
    ):
        checks.tensors("rotary", q=q, k=k, cos=cos, sin=sin)  # a TypeError naming the argument
    try:
        if wants_grad(q, k, cos, sin):
            if cos.requires_grad or sin.requires_grad:
                raise ValueError(f"rotary: {_NO_COS_SIN_GRAD}")
            return _RotaryFunction.apply(q, k, cos, sin)
        return call_below_autograd(rotary_fwd, q, k, cos, sin)
    except (TypeError, ValueError) as error:  # named as the caller called it
        raise checks.as_called(error, "rotary") from None


def apply_rotary_pos_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int | torch.Tensor | None = 1,
    *,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A drop-in for ``transformers.models.llama.modeling_llama.apply_rotary_pos_emb``, with
    transformers 5's signature (``unsqueeze_dim`` the fifth argument), that also takes
    transformers 4's calls ``(q, k, cos, sin, position_ids)``.

    Args:
        q, k, cos, sin: as for ``rotary`` when ``unsqueeze_dim`` is 1 (or -3). With
            ``unsqueeze_dim`` 2 (or -2) q and k are ``(B, S, H, D)`` instead.
        unsqueeze_dim: the dim of q and k that ``cos`` and ``sin`` broadcast over: the heads.
            A tensor or None here is transformers 4's fifth argument, ``position_ids``: ignored,
            and the heads are dim 1 (that signature's ``unsqueeze_dim`` sixth cannot be given).
        position_ids: ignored, as transformers 4 ignored it (``cos`` and ``sin`` already are per
            position); keyword-only, for callers written for that signature.

    Returns:
        ``(q_embed, k_embed)``, laid out as ``rotary`` lays them out (the dtype of ``q`` even for
        float32 ``cos``).

    Raises:
        TypeError: ``unsqueeze_dim`` is not an int, a tensor or None.
        ValueError: ``unsqueeze_dim`` is not 1, -3, 2 or -2; and everything ``rotary`` raises.
    """
    if type(unsqueeze_dim) is not int:
        if unsqueeze_dim is not None and not isinstance(unsqueeze_dim, torch.Tensor):
            raise TypeError(
                "apply_rotary_pos_emb: `unsqueeze_dim` must be an int (or, in transformers 4's "
                f"order, `position_ids`: a tensor or None), got {type(unsqueeze_dim).__name__}"
            )
        unsqueeze_dim = 1  # that was transformers 4's position_ids
    if unsqueeze_dim == 1 or unsqueeze_dim == -3:
        return rotary(q, k, cos, sin)
    if unsqueeze_dim != 2 and unsqueeze_dim != -2:
        raise ValueError(
            "apply_rotary_pos_emb: `unsqueeze_dim` must be 1 (q, k as (batch, heads, seq_len, "
            f"head_dim)) or 2 (as (batch, seq_len, heads, head_dim)), got {unsqueeze_dim!r}"
        )
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)):
        checks.tensors("apply_rotary_pos_emb", q=q, k=k)
    if q.dim() != 4 or k.dim() != 4:
        return rotary(q, k, cos, sin)  # raises, naming the argument
    q_embed, k_embed = rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q_embed.transpose(1, 2), k_embed.transpose(1, 2)
