"""Fused linear cross-entropy: the lm_head matmul and the loss without the full (N, V) logits.

A causal LM's last step, ``F.cross_entropy((hidden @ weight.T).float(), target)``, materialises
logits of N tokens x V classes (N = 8192, V = 128256: 2 GiB in bfloat16, 4 GiB more for the
float32 upcast, as much again for their gradient). Here the tokens go in chunks of C rows:

    for each chunk of C tokens:
        logits_c = hidden_c @ weight.T (+ bias)           cuBLAS, in the inputs' dtype, (C, V)
        one Triton row kernel: loss of each row in float32, and the gradient of the logits
            written in place over logits_c                (softmax - (1 - eps) onehot - eps / V)
        grad_hidden_c  = logits_c @ weight                cuBLAS
        grad_weight   += logits_c.T @ hidden_c            cuBLAS, accumulated in float32
        grad_bias     += logits_c.sum(0)

so only one chunk of logits lives at a time and the gradients are ready when the forward ends;
the backward multiplies them by the incoming gradient (a scalar: reductions "mean" and "sum").

Reading order: the row kernel, the chunk loop (the op's implementation), the registered op and
its fake, the autograd, the public functions.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
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
from llmsys.triton_launch.precise import exp as _exp
from llmsys.triton_launch.precise import log as _log

from .reference import compute_dtype

NAMESPACE = "llmsys_fused"
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
REDUCTIONS = ("mean", "sum")
# The widest vocabulary block one loop iteration of the row kernel reads (a guess for the H100:
# 4096 bfloat16 logits are 16 per thread on 8 warps). Tests lower it to force several blocks.
MAX_BLOCK_V = 4096
# Bounds of the default chunk (rows of logits at a time), see default_chunk_size.
MIN_CHUNK, MAX_CHUNK = 1024, 8192
CHUNK_BYTES = 1 << 30  # a chunk's logits: vocab 32000 in bf16 at 8192 rows, 128256 at 4096


# --- the row kernel -------------------------------------------------------------------------------


@triton.jit
def cross_entropy_rows_kernel(
    # pointers
    logits_ptr,  # (rows, n_cols) in the matmul's dtype; overwritten by the gradient
    target_ptr,  # (rows,) int64
    loss_ptr,  # (rows,) float32 (float64): each row's loss
    n_valid_ptr,  # () int64: targets != ignore_index over all N rows (read for MEAN only)
    # sizes and strides
    n_cols,
    stride_row,
    ignore_index,
    # meta-parameters
    LABEL_SMOOTHING: tl.constexpr,  # a constexpr: exact in float64, and 0 compiles the term out
    MEAN: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    PRECISE: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One program per row, as F.cross_entropy defines it (eps = LABEL_SMOOTHING):

        lse  = logsumexp(z)                          online over blocks of BLOCK_V
        loss = (1 - eps) (lse - z[t]) + eps (lse - mean(z)),   0 where t == ignore_index
        dz   = scale (softmax(z) - (1 - eps) onehot(t) - eps / V),  scale = 1 / n_valid for mean

    An ignored row gets a zero loss and a zero gradient; a target outside [0, V) a NaN loss and
    a NaN gradient (a GPU kernel cannot raise; NaN makes the bad row visible).
    """
    row = tl.program_id(0)
    # Python floats would enter the arithmetic as float32: make eps a COMPUTE_DTYPE scalar.
    eps = tl.full([], LABEL_SMOOTHING, COMPUTE_DTYPE)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    cols = tl.arange(0, BLOCK_V)
    target = tl.load(target_ptr + row)
    if target == ignore_index:
        if WRITE_GRAD:
            zeros = tl.zeros([BLOCK_V], dtype=logits_ptr.dtype.element_ty)
            for start in range(0, n_cols, BLOCK_V):
                tl.store(row_ptr + start + cols, zeros, mask=start + cols < n_cols)
        tl.store(loss_ptr + row, tl.zeros([], dtype=loss_ptr.dtype.element_ty))
    else:
        # Pass 1: running max m and sum s of exp(z - m); every block holds one valid column at
        # least, so m is finite after the first block and exp(m - m_new) never sees -inf - -inf.
        m = tl.full([], float("-inf"), COMPUTE_DTYPE)
        s = tl.zeros([], dtype=COMPUTE_DTYPE)
        total = tl.zeros([], dtype=COMPUTE_DTYPE)
        for start in range(0, n_cols, BLOCK_V):
            mask = start + cols < n_cols
            z = tl.load(row_ptr + start + cols, mask=mask, other=float("-inf")).to(COMPUTE_DTYPE)
            m_new = tl.maximum(m, tl.max(z, axis=0))
            s = s * _exp(m - m_new, PRECISE) + tl.sum(_exp(z - m_new, PRECISE), axis=0)
            m = m_new
            if LABEL_SMOOTHING > 0:
                total += tl.sum(tl.where(mask, z, 0.0), axis=0)
        lse = m + _log(s, PRECISE)
        in_range = (target >= 0) & (target < n_cols)
        z_target = tl.load(row_ptr + tl.where(in_range, target, 0)).to(COMPUTE_DTYPE)
        loss = lse - z_target
        if LABEL_SMOOTHING > 0:
            # F.cross_entropy's smoothing term: eps / V * sum_j (lse - z_j)
            loss = (1.0 - eps) * loss + (eps / n_cols) * (n_cols * lse - total)
        loss = tl.where(in_range, loss, float("nan"))
        tl.store(loss_ptr + row, loss.to(loss_ptr.dtype.element_ty))
        if WRITE_GRAD:
            # Pass 2 reads each block again and overwrites it with its gradient.
            if MEAN:
                scale = 1.0 / tl.load(n_valid_ptr).to(COMPUTE_DTYPE)
            else:
                scale = tl.full([], 1.0, COMPUTE_DTYPE)
            scale = tl.where(in_range, scale, float("nan"))
            for start in range(0, n_cols, BLOCK_V):
                offsets = start + cols
                mask = offsets < n_cols
                z = tl.load(row_ptr + offsets, mask=mask, other=0.0).to(COMPUTE_DTYPE)
                grad = _exp(z - lse, PRECISE)
                grad -= tl.where(offsets == target, 1.0 - eps, 0.0)
                if LABEL_SMOOTHING > 0:
                    grad -= eps / n_cols
                grad *= scale
                tl.store(row_ptr + offsets, grad.to(logits_ptr.dtype.element_ty), mask=mask)


# Under TRITON_INTERPRET=1 `triton.jit` returns an interpreter object that runs on CPU tensors.
CPU_RUNS_TRITON = runs_under_interpreter(cross_entropy_rows_kernel)


def _rows(
    logits: torch.Tensor,
    target: torch.Tensor,
    losses: torch.Tensor,
    n_valid: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    mean: bool,
    write_grad: bool,
) -> None:
    """The row kernel's work on one chunk: ``losses`` and, if ``write_grad``, the gradient over
    ``logits``."""
    rows, n_cols = logits.shape
    if logits.is_cuda or CPU_RUNS_TRITON:
        block = min(next_power_of_2(n_cols), MAX_BLOCK_V)
        constexprs = {
            "LABEL_SMOOTHING": label_smoothing,
            "MEAN": mean,
            "WRITE_GRAD": write_grad,
            "PRECISE": logits.is_cuda,
            "COMPUTE_DTYPE": tl.float64 if logits.dtype == torch.float64 else tl.float32,
            "BLOCK_V": block,
        }
        args = (logits, target, losses, n_valid, n_cols, logits.stride(0), ignore_index)
        launch(
            cross_entropy_rows_kernel, rows, args, constexprs, num_warps=8 if block >= 2048 else 4
        )
        return
    # CPU without the interpreter: the same arithmetic in eager PyTorch.
    z = logits.to(losses.dtype)
    valid = target != ignore_index
    safe_target = torch.where(valid, target, 0)[:, None]
    lse = torch.logsumexp(z, dim=1)
    loss = lse - z.gather(1, safe_target)[:, 0]
    if label_smoothing > 0:
        loss = (1 - label_smoothing) * loss + label_smoothing * (lse - z.mean(dim=1))
    losses.copy_(torch.where(valid, loss, 0.0))
    if write_grad:
        grad = torch.exp(z - lse[:, None]) - label_smoothing / n_cols
        grad.scatter_add_(1, safe_target, grad.new_full(safe_target.shape, label_smoothing - 1))
        scale = 1 / n_valid.to(losses.dtype) if mean else 1.0  # not a float32 quotient
        logits.copy_(torch.where(valid[:, None], grad * scale, 0.0))


# --- the chunk loop: the op's implementation ------------------------------------------------------


def default_chunk_size(n_tokens: int, vocab_size: int, itemsize: int) -> int:
    """Rows of logits per chunk when ``chunk_size`` is None: the most rows (a power of two,
    from ``MIN_CHUNK`` to ``MAX_CHUNK``) whose logits fit ``CHUNK_BYTES``, and no more than the
    tokens need.

    Each chunk reads and writes the float32 weight-gradient accumulator once (8 V H bytes), so
    fewer, larger chunks are faster; each row of a chunk costs V logits of memory. Timed on an
    H100, forward and backward at 8192 tokens under bf16 autocast: vocab 32000 x hidden 2048
    took 6.99 / 6.98 / 5.90 / 5.57 ms at 1024 / 2048 / 4096 / 8192 rows (0.55 to 0.89 GiB above
    the inputs), vocab 128256 x hidden 3072 38.4 / 34.7 / 32.7 / 32.5 ms (3.0 to 4.2 GiB).
    """
    rows = MIN_CHUNK
    while rows < min(MAX_CHUNK, n_tokens) and 2 * rows * vocab_size * itemsize <= CHUNK_BYTES:
        rows *= 2
    return rows


_addmm_fp32_out: dict[int, bool] = {}  # device index -> whether cuBLAS adds 16-bit products to fp32


def _fp32_addmm_works(device: torch.device) -> bool:
    """Whether ``torch.addmm(fp32, bf16, bf16, out_dtype=fp32, out=fp32)`` is accepted here
    (torch versions differ on the dtype they allow for the added matrix). Probed once per device
    with 1x1 matrices: a refused call fails in its host-side argument checks, before any launch,
    and the probe never synchronizes (it may run inside a CUDA graph capture)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _addmm_fp32_out:
        acc = torch.ones(1, 1, device=device)
        one = torch.ones(1, 1, device=device, dtype=torch.bfloat16)
        try:
            torch.addmm(acc, one, one, out_dtype=torch.float32, out=acc)
            _addmm_fp32_out[index] = True
        except (RuntimeError, TypeError):
            _addmm_fp32_out[index] = False
    return _addmm_fp32_out[index]


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` possibly wider than ``a`` and ``b``."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    elif a.is_cuda and _fp32_addmm_works(a.device):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)  # fp32 sums, no 16-bit rounding
    elif a.is_cuda:
        acc += a @ b  # rounds each chunk's product to 16 bits; a (V, H) temporary
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))  # CPU: products of 16-bit values are exact


def _check(
    op: str,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    chunk_size: int,
) -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument unless the op's arguments fit."""
    checks.tensor(op, "hidden", hidden, FLOAT_DTYPES)
    checks.tensor(op, "weight", weight, FLOAT_DTYPES)
    checks.tensor(op, "target", target, (torch.int64,))
    if bias is not None:
        checks.tensor(op, "bias", bias, FLOAT_DTYPES)
        checks.same_dtype(op, "bias", bias, "weight", weight)
    if hidden.dim() != 2:
        raise ValueError(f"{op}: `hidden` must be 2-D (N, H), got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise _weight_shape_error(op, weight, hidden)
    if target.shape != hidden.shape[:1]:
        raise ValueError(
            f"{op}: `target` must have shape {tuple(hidden.shape[:1])} (hidden's leading "
            f"sizes), got {tuple(target.shape)}"
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(
            f"{op}: `bias` must have shape ({weight.shape[0]},) (weight's V), "
            f"got {tuple(bias.shape)}"
        )
    for name, t in (("weight", weight), ("target", target), ("bias", bias)):
        checks.same_device(op, name, t, "hidden", hidden)
    _check_scalars(op, ignore_index, label_smoothing, reduction, chunk_size)


def _weight_shape_error(op: str, weight: torch.Tensor, hidden: torch.Tensor) -> ValueError:
    return ValueError(
        f"{op}: `weight` must have shape (V, H) with H = {hidden.shape[-1]} "
        f"(hidden's last size), got {tuple(weight.shape)}"
    )


def _check_scalars(
    op: str, ignore_index: int, label_smoothing: float, reduction: str, chunk_size: int
) -> None:
    checks.integer(op, "ignore_index", ignore_index, -(2**63))
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, float | int):
        raise TypeError(
            f"{op}: `label_smoothing` must be a float, got {type(label_smoothing).__name__}"
        )
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{op}: `label_smoothing` must be in [0, 1], got {label_smoothing}")
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"{op}: `reduction` must be 'mean' or 'sum' (per-token losses, 'none', are not "
            f"supported), got {reduction!r}"
        )
    checks.integer(op, "chunk_size", chunk_size, 1)


def _check_targets_on_cpu(op: str, target: torch.Tensor, ignore_index: int, n_cols: int) -> None:
    # On the GPU this would be a host sync; the kernel marks such rows with NaN instead.
    bad = (target != ignore_index) & ((target < 0) | (target >= n_cols))
    if bool(bad.any()):
        raise ValueError(
            f"{op}: `target` must hold class indices in [0, {n_cols}) or ignore_index "
            f"({ignore_index}), got {target[bad][0].item()}"
        )


def _linear_cross_entropy_fwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    chunk_size: int,
    hidden_grad: bool,
    weight_grad: bool,
    bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    op = "linear_cross_entropy_fwd"
    _check(op, hidden, weight, target, bias, ignore_index, label_smoothing, reduction, chunk_size)
    if not hidden.is_cuda:
        _check_targets_on_cpu(op, target, ignore_index, weight.shape[0])
    args = (hidden, weight, target, bias, ignore_index, float(label_smoothing))
    flags = (
        reduction == "mean",
        chunk_size,
        hidden_grad,
        weight_grad,
        bias_grad and bias is not None,
    )
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):  # our matmuls run in hidden's dtype, as given
        with torch.autocast(device_type, enabled=False):
            return _chunks(*args, *flags)
    return _chunks(*args, *flags)


def _chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    mean: bool,
    chunk_size: int,
    hidden_grad: bool,
    weight_grad: bool,
    bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    n_tokens, vocab = hidden.shape[0], weight.shape[0]
    dtype = hidden.dtype
    # Under autocast weight (and bias) may be wider than hidden: cast once per call, as
    # autocast's F.linear does; the gradients come back in their own dtypes.
    w = weight.to(dtype)  # (V, H)
    b = None if bias is None else bias.to(dtype)  # (V,)
    target = target.contiguous()
    losses = torch.empty(n_tokens, device=hidden.device, dtype=compute_dtype(dtype))
    n_valid = (target != ignore_index).sum()  # () int64, on the device: no sync
    write_grad = hidden_grad or weight_grad or bias_grad
    acc_dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    # A gradient not wanted is an empty tensor (each its own: outputs of an op must not alias).
    grad_hidden = (
        torch.empty_like(hidden, memory_format=torch.contiguous_format)
        if hidden_grad
        else hidden.new_empty(0)
    )
    grad_weight = (
        torch.zeros(weight.shape, device=weight.device, dtype=acc_dtype)
        if weight_grad
        else hidden.new_empty(0)
    )
    grad_bias = (
        torch.zeros(vocab, device=weight.device, dtype=acc_dtype)
        if bias_grad
        else hidden.new_empty(0)
    )
    logits = torch.empty(min(chunk_size, n_tokens), vocab, device=hidden.device, dtype=dtype)
    for start in range(0, n_tokens, chunk_size):
        end = min(start + chunk_size, n_tokens)
        hidden_c = hidden[start:end]  # (C, H)
        logits_c = logits[: end - start]  # (C, V), contiguous rows
        if b is None:
            torch.mm(hidden_c, w.t(), out=logits_c)
        else:
            torch.addmm(b, hidden_c, w.t(), out=logits_c)
        _rows(
            logits_c,
            target[start:end],
            losses[start:end],
            n_valid,
            ignore_index,
            label_smoothing,
            mean,
            write_grad,
        )
        # logits_c now holds d loss / d logits_c
        if hidden_grad:
            torch.mm(logits_c, w, out=grad_hidden[start:end])
        if weight_grad:
            _accumulate(grad_weight, logits_c.t(), hidden_c)
        if bias_grad:
            grad_bias += logits_c.sum(dim=0, dtype=acc_dtype)
    loss = losses.sum()
    if mean:
        loss = loss / n_valid  # 0 / 0 = NaN when every target is ignored, as F.cross_entropy
    if weight_grad:
        grad_weight = grad_weight.to(weight.dtype)
    if bias_grad:
        assert bias is not None  # (the caller asks for a bias gradient only with a bias)
        grad_bias = grad_bias.to(bias.dtype)
    return loss, grad_hidden, grad_weight, grad_bias


# --- the registered op and its fake ---------------------------------------------------------------


def _linear_cross_entropy_fwd_fake(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    chunk_size: int,
    hidden_grad: bool,
    weight_grad: bool,
    bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check(
        "linear_cross_entropy_fwd",
        hidden,
        weight,
        target,
        bias,
        ignore_index,
        label_smoothing,
        reduction,
        chunk_size,
    )
    return (
        hidden.new_empty((), dtype=compute_dtype(hidden.dtype)),
        torch.empty_like(hidden, memory_format=torch.contiguous_format)
        if hidden_grad
        else hidden.new_empty(0),
        torch.empty_like(weight, memory_format=torch.contiguous_format)
        if weight_grad
        else hidden.new_empty(0),
        torch.empty_like(bias, memory_format=torch.contiguous_format)
        if bias_grad and bias is not None
        else hidden.new_empty(0),
    )


_lib = torch.library.Library(NAMESPACE, "FRAGMENT")
linear_cross_entropy_fwd = define_op(
    _lib,
    "linear_cross_entropy_fwd(Tensor hidden, Tensor weight, Tensor target, Tensor? bias, "
    "int ignore_index, float label_smoothing, str reduction, int chunk_size, bool hidden_grad, "
    "bool weight_grad, bool bias_grad) -> (Tensor, Tensor, Tensor, Tensor)",
    _linear_cross_entropy_fwd,
    _linear_cross_entropy_fwd_fake,
)


# --- autograd -------------------------------------------------------------------------------------

_INPUT_GRADS = {0: "hidden_grad", 1: "weight_grad", 3: "bias_grad"}  # input index -> its flag


def _setup_context(ctx: Any, inputs: tuple, output: tuple[torch.Tensor, ...]) -> None:
    _, grad_hidden, grad_weight, grad_bias = output
    ctx.mark_non_differentiable(grad_hidden, grad_weight, grad_bias)
    ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
    ctx.computed = (inputs[8], inputs[9], inputs[10] and inputs[3] is not None)


def _scaled_grads(ctx: Any, grad_loss: torch.Tensor, in_place: bool) -> tuple:
    refuse_double_backward("linear_cross_entropy")
    grads = [None] * 11
    for (index, flag), computed, grad in zip(
        _INPUT_GRADS.items(), ctx.computed, ctx.saved_tensors, strict=True
    ):
        if not ctx.needs_input_grad[index]:
            continue
        if not computed:  # the op was called by name with this flag False
            raise RuntimeError(
                f"linear_cross_entropy_fwd: a gradient for input {index} is needed but the "
                f"forward ran with {flag}=False"
            )
        # No host sync to test grad_loss == 1: always one multiply (a 0-d tensor, any value).
        grads[index] = grad.mul_(grad_loss) if in_place else grad * grad_loss
    return tuple(grads)


def _backward(ctx: Any, grad_loss: torch.Tensor, *_unused: object) -> tuple:
    # The op called by name: its gradient outputs are the caller's tensors; leave them alone.
    return _scaled_grads(ctx, grad_loss, in_place=False)


def _backward_in_place(ctx: Any, grad_loss: torch.Tensor, *_unused: object) -> tuple:
    # Only this Function holds the precomputed gradients: scale them in place instead of
    # allocating a second (V, H) weight gradient. A second backward through the same graph
    # (retain_graph=True) then fails autograd's saved-tensor version check instead of scaling
    # twice. Traced graphs take the out-of-place multiply (the compiler reuses the buffer).
    return _scaled_grads(ctx, grad_loss, in_place=not torch.compiler.is_compiling())


class _LinearCrossEntropyFunction(torch.autograd.Function):
    """``linear_cross_entropy_fwd``, whose outputs include the gradients; the backward scales
    them by the incoming gradient."""

    # forward takes ctx itself: with a separate setup_context, Function.apply binds every
    # call's arguments through inspect.signature (DECISIONS.md: host cost).
    @staticmethod
    def forward(ctx: Any, *args: Any) -> tuple[torch.Tensor, ...]:
        output = call_below_autograd(linear_cross_entropy_fwd, *args)
        _setup_context(ctx, args, output)
        return output

    backward = staticmethod(_backward_in_place)


# torch.ops.llmsys_fused.linear_cross_entropy_fwd called by name is differentiable the same way.
torch.library.register_autograd(linear_cross_entropy_fwd, _backward, setup_context=_setup_context)


# --- the public functions -------------------------------------------------------------------------


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``F.cross_entropy((hidden @ weight.T + bias).float(), target, ...)`` without the logits.

    What a Hugging Face causal LM computes from its last hidden states and lm_head, in chunks
    of ``chunk_size`` tokens, so that only one chunk's (chunk_size, V) logits exist at a time.
    The gradients of ``hidden``, ``weight`` and ``bias`` are computed during the forward (for
    the inputs that require grad); the backward only multiplies them by the incoming gradient.

    Args:
        hidden: (..., H) float16, bfloat16, float32 or float64, on CUDA (Triton kernel) or CPU
            (eager, or the Triton kernel under ``TRITON_INTERPRET=1``).
        weight: (V, H), the lm_head weight, hidden's dtype (under ``torch.autocast`` any
            floating dtype: the matmuls then run in the autocast dtype, as ``F.linear`` would,
            and the weight's gradient comes back in the weight's dtype).
        target: (...) int64, hidden's leading shape: class indices in [0, V) or
            ``ignore_index``.
        bias: optional (V,), weight's dtype.
        ignore_index: targets with this value add nothing to the loss or to the count that
            "mean" divides by. Default -100.
        label_smoothing: in [0, 1], as ``F.cross_entropy``. Default 0.0.
        reduction: "mean" (over the targets that are not ignored; NaN when there are none, as
            ``F.cross_entropy``) or "sum". Default "mean".
        chunk_size: tokens per chunk, at least 1; None: ``default_chunk_size`` (1024 to 8192
            rows, a chunk's logits at most 1 GiB where 1024 rows fit).

    Returns:
        The 0-d loss: float32 (float64 for float64 inputs).

    Raises:
        TypeError: an argument is not a tensor, or of the wrong dtype (``target`` not int64,
            ``weight`` not hidden's dtype outside autocast, ``bias`` not weight's).
        ValueError: shapes that do not fit, tensors on different devices, ``label_smoothing``
            outside [0, 1], ``reduction`` other than "mean" or "sum", ``chunk_size`` below 1,
            ``ignore_index`` or ``chunk_size`` outside int64, and on CPU a target outside
            [0, V) that is not ``ignore_index``. On the GPU such a target is not checked (that
            would synchronize): its row's loss and gradients are NaN, so the loss is NaN.

    Meta tensors give a meta loss (and meta gradients), as ``F.cross_entropy`` does.

    Memory: one chunk of logits in the matmul dtype (at most 1 GiB by default), the gradients,
    and for 16-bit weights a float32 accumulator of the weight gradient (4 V H bytes). Works under
    ``torch.compile(fullgraph=True)`` and in CUDA graphs (no host sync). Double backward is not
    supported, nor a second backward through the same graph. The gradients are computed in the
    forward whenever grad mode is on and an input requires grad (three matmuls instead of one):
    compute a validation loss under ``torch.no_grad()``.
    """
    op = "linear_cross_entropy"
    checks.tensors(op, optional=("bias",), hidden=hidden, weight=weight, target=target, bias=bias)
    if hidden.dim() < 1 or hidden.shape[-1] == 0:
        raise ValueError(f"{op}: `hidden` must be (..., H) with H >= 1, got {tuple(hidden.shape)}")
    if target.shape != hidden.shape[:-1]:
        raise ValueError(
            f"{op}: `target` must have hidden's leading shape {tuple(hidden.shape[:-1])}, "
            f"got {tuple(target.shape)}"
        )
    hidden = hidden.reshape(-1, hidden.shape[-1])  # (N, H)
    target = target.reshape(-1)  # (N,)
    device_type = hidden.device.type
    try:
        autocast = torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device autocast does not know, such as meta: nothing to cast
        autocast = False
    if autocast and hidden.dtype != torch.float64:
        hidden = hidden.to(torch.get_autocast_dtype(device_type))
    elif weight.dtype != hidden.dtype:
        checks.same_dtype(op, "weight", weight, "hidden", hidden)
    if chunk_size is None:
        if weight.dim() != 2:  # before reading V from it
            raise _weight_shape_error(op, weight, hidden)
        chunk_size = default_chunk_size(hidden.shape[0], weight.shape[0], hidden.element_size())
    # Before the dispatcher, whose own errors for the scalars name no argument.
    _check_scalars(op, ignore_index, label_smoothing, reduction, chunk_size)
    flags = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
    args = (hidden, weight, target, bias, ignore_index, label_smoothing, reduction, chunk_size)
    try:
        if wants_grad(hidden, weight, bias):
            return _LinearCrossEntropyFunction.apply(*args, *flags)[0]
        return call_below_autograd(linear_cross_entropy_fwd, *args, False, False, False)[0]
    except (TypeError, ValueError) as error:  # named as the caller called it
        raise checks.as_called(error, "linear_cross_entropy") from None


def _check_num_items(op: str, num_items: object) -> None:
    if num_items is None:
        return
    if isinstance(num_items, torch.Tensor):
        if num_items.numel() != 1:
            raise ValueError(
                f"{op}: `num_items_in_batch` must have one element, got shape "
                f"{tuple(num_items.shape)}"
            )
        return
    if isinstance(num_items, bool) or not isinstance(num_items, int | float):
        raise TypeError(
            f"{op}: `num_items_in_batch` must be None, a number or a tensor, got "
            f"{type(num_items).__name__}"
        )
    if not num_items > 0:  # (NaN too)
        raise ValueError(
            f"{op}: `num_items_in_batch` must be positive (the count of targets that are not "
            f"ignored), got {num_items}"
        )


def causal_lm_loss(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor | None = None,
    ignore_index: int = -100,
    *,
    num_items_in_batch: torch.Tensor | int | None = None,
    shift_labels: torch.Tensor | None = None,
    lm_head_bias: torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Hugging Face's ``ForCausalLMLoss`` on ``hidden_states @ lm_head_weight.T``, fused.

    Position t predicts token t + 1: the labels are padded on the right with ``ignore_index``
    and shifted left by one (``hidden_states`` is not sliced or copied), unless
    ``shift_labels`` gives the shifted labels. Then :func:`linear_cross_entropy`.

    Args:
        hidden_states: (B, T, H) (or any (..., T, H)), the model's last hidden states.
        lm_head_weight: (V, H).
        labels: (B, T) int64, the input ids with ``ignore_index`` where no loss is wanted.
        ignore_index: default -100.
        num_items_in_batch: None: the mean over the targets that are not ignored. Else the sum
            divided by it, as transformers does under gradient accumulation: a positive number
            (the count of targets not ignored over the accumulated batches, so 0 is refused
            rather than giving an inf or NaN loss), or a tensor of one element, whose value is
            not checked (reading it would synchronize with the GPU). A tensor of shape (1,)
            gives a loss of shape (1,), as in transformers.
        shift_labels: (B, T) labels already shifted; ``labels`` is then not used.
        lm_head_bias, label_smoothing, chunk_size: passed to ``linear_cross_entropy`` as
            ``bias``, ``label_smoothing``, ``chunk_size``.

    Returns:
        The 0-d float32 loss.

    Raises:
        TypeError, ValueError: as ``linear_cross_entropy``, under this function's names for the
            arguments, all before the forward: ``labels`` (or ``shift_labels``) not int64 or not
            of ``hidden_states``' leading shape, ``num_items_in_batch`` not None, a positive
            number or a one-element tensor; and a ``ValueError`` when neither ``labels`` nor
            ``shift_labels`` is given.
    """
    op = "causal_lm_loss"
    checks.tensors(
        op,
        optional=("lm_head_bias",),
        hidden_states=hidden_states,
        lm_head_weight=lm_head_weight,
        lm_head_bias=lm_head_bias,
    )
    _check_num_items(op, num_items_in_batch)
    if shift_labels is None:
        if labels is None:
            raise ValueError(f"{op}: `labels` or `shift_labels` must be given, got None")
        name, given = "labels", labels
    else:
        name, given = "shift_labels", shift_labels
    checks.tensor(op, name, given, (torch.int64,))
    if given.shape != hidden_states.shape[:-1]:
        raise ValueError(
            f"{op}: `{name}` must have hidden_states' leading shape "
            f"{tuple(hidden_states.shape[:-1])}, got {tuple(given.shape)}"
        )
    if shift_labels is None:
        checks.integer(op, "ignore_index", ignore_index, -(2**63))  # before F.pad takes it
        shift_labels = F.pad(given, (0, 1), value=ignore_index)[..., 1:]  # given: labels
    reduction = "mean" if num_items_in_batch is None else "sum"
    try:
        loss = linear_cross_entropy(
            hidden_states,
            lm_head_weight,
            shift_labels.to(hidden_states.device),
            lm_head_bias,
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            reduction=reduction,
            chunk_size=chunk_size,
        )
    except (TypeError, ValueError) as error:  # its errors, under this function's names
        raise checks.as_called(
            error, op, hidden="hidden_states", weight="lm_head_weight", bias="lm_head_bias",
            target=name,
        ) from None  # fmt: skip
    if num_items_in_batch is None:
        return loss
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch
