"""kernels-fused sweep: RMSNorm, rotary and linear cross-entropy at Llama shapes, against eager,
torch.compile and Liger-Kernel; forward and forward+backward, peak memory, host cost.

Shapes are those a Llama training step at 4 x 2048 tokens calls: the 0.85B config (hidden 2048,
16 q / 4 kv heads of 128, vocab 32000) and Llama-3.2-3B's (hidden 3072, 24 q / 8 kv heads of 128,
vocab 128256). ``eager`` is what transformers runs (its RMSNorm and ``apply_rotary_pos_emb``;
logits, ``.float()`` and ``F.cross_entropy``), ``compile`` the same under ``torch.compile``,
``liger`` Liger-Kernel's modules (when installed) and ``ours`` this package's functions.

Writes ``results/<gpu>.csv`` and ``results/<gpu>.png``. Run ``python benchmarks/sweep.py --help``;
the ``bench`` main job calls :func:`run`.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import llmsys.bench_harness as harness
import llmsys.kernels_fused as kf

RESULTS = Path(__file__).parent / "results"
TOKENS = 4 * 2048
# (hidden, vocab, q heads, kv heads, head dim) of the two Llama shapes
MODELS = {"0.85B": (2048, 32000, 16, 4, 128), "3B": (3072, 128256, 24, 8, 128)}
CPU_MODELS = {"tiny": (64, 97, 4, 2, 16)}
CPU_TOKENS = 33


def rms_norm_eager(x, weight, eps=1e-6):
    """transformers' LlamaRMSNorm.forward."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_eager(x, residual, weight, eps=1e-6):
    """A decoder layer's residual add, then its RMSNorm: ``(norm(x + residual), x + residual)``."""
    s = x + residual
    return rms_norm_eager(s, weight, eps), s


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_eager(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb (unsqueeze_dim=1)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def loss_eager(hidden, weight, target):
    """A causal LM's head and loss: logits, upcast, cross-entropy."""
    return F.cross_entropy((hidden @ weight.t()).float(), target)


def _liger():
    try:
        import liger_kernel.transformers as liger
    except ImportError:
        print("liger-kernel is not installed: its rows are skipped", file=sys.stderr)
        return None
    return liger


def providers(op: str, device: str, hidden: int) -> dict:
    eager = {
        "rms_norm": rms_norm_eager,
        "add_rms_norm": add_rms_norm_eager,
        "rotary": rotary_eager,
        "loss": loss_eager,
    }[op]
    ours = {
        "rms_norm": lambda x, w: kf.rms_norm(x, w, 1e-6),
        "add_rms_norm": lambda x, r, w: kf.rms_norm(x, w, 1e-6, residual=r),
        "rotary": kf.rotary,
        "loss": kf.linear_cross_entropy,
    }[op]
    found = {"eager": eager, "ours": ours}
    if device != "cuda":
        return found
    found["compile"] = torch.compile(eager, dynamic=False)
    liger = _liger()
    if liger is not None:
        if op in ("rms_norm", "add_rms_norm"):
            module = liger.LigerRMSNorm(hidden, eps=1e-6).to(device)

            def liger_norm(x, w, module=module):
                module.weight = torch.nn.Parameter(w, requires_grad=w.requires_grad)
                return module(x)

            if op == "rms_norm":
                found["liger"] = liger_norm
            else:  # Liger has no fused add: the add in eager, then its norm

                def liger_add_norm(x, r, w, norm=liger_norm):
                    s = x + r
                    return norm(s, w), s

                found["liger"] = liger_add_norm
        elif op == "rotary":
            found["liger"] = liger.liger_rotary_pos_emb
        else:
            loss = liger.LigerFusedLinearCrossEntropyLoss()
            found["liger"] = lambda h, w, t, loss=loss: loss(w, h, t)
    return found


def inputs(op: str, shape: tuple, tokens: int, device: str, dtype, grad: bool):
    hidden, vocab, q_heads, kv_heads, head_dim = shape
    make = dict(device=device, dtype=dtype)
    if op in ("rms_norm", "add_rms_norm"):
        x = torch.randn(tokens, hidden, **make, requires_grad=grad)
        w = (1 + 0.1 * torch.randn(hidden, **make)).requires_grad_(grad)
        if op == "rms_norm":  # fwd: x, y; fwd_bwd: also g, x again, dx
            return (x, w), (x, w), x.numel() * dtype.itemsize * (2 if not grad else 5)
        r = torch.randn(tokens, hidden, **make, requires_grad=grad)
        # fwd: x, r, y, s; fwd_bwd: also g_y, g_s, s again, dx (the same for r)
        return (x, r, w), (x, r, w), x.numel() * dtype.itemsize * (4 if not grad else 8)
    if op == "rotary":
        batch, seq = (4, tokens // 4) if tokens % 4 == 0 else (1, tokens)
        # q and k as transformers makes them: projections viewed as heads and transposed
        q = torch.randn(batch, seq, q_heads, head_dim, **make).transpose(1, 2).requires_grad_(grad)
        k = torch.randn(batch, seq, kv_heads, head_dim, **make).transpose(1, 2).requires_grad_(grad)
        angles = torch.randn(1, seq, head_dim // 2, device=device).repeat(1, 1, 2)
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        moved = 2 * (q.numel() + k.numel()) * dtype.itemsize * (2 if grad else 1)
        return (q, k, cos, sin), (q, k), moved
    h = torch.randn(tokens, hidden, **make, requires_grad=grad)
    w = (torch.randn(vocab, hidden, **make) / hidden**0.5).requires_grad_(grad)
    t = torch.randint(0, vocab, (tokens,), device=device)
    flops = 2 * tokens * hidden * vocab * (3 if grad else 1)
    return (h, w, t), (h, w), flops


def _as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def _gradients_like(out) -> tuple:
    """Random gradients for an op's outputs (a tensor or a tuple); a scalar loss gets 1."""
    return tuple(torch.randn_like(o) if o.dim() else torch.ones_like(o) for o in _as_tuple(out))


def run(device: str = "cuda", *, quick: bool = False, progress=None) -> list[harness.Row]:
    """Time every provider on every case; returns the rows (speed-up: eager time / time)."""
    models = MODELS if device == "cuda" else CPU_MODELS
    tokens = TOKENS if device == "cuda" else CPU_TOKENS
    if quick:
        models = dict(list(models.items())[:1])
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gpu, stamp = harness.device_name(device), harness.timestamp()
    rows = []
    for (model, shape), op, mode in [
        (m, op, mode)
        for m in models.items()
        for op in ("rms_norm", "add_rms_norm", "rotary", "loss")
        for mode in ("fwd", "fwd_bwd")
    ]:
        args, leaves, work = inputs(op, shape, tokens, device, dtype, grad=mode == "fwd_bwd")
        eager_p50 = None
        for name, fn in providers(op, device, shape[0]).items():
            if mode == "fwd":

                def step(fn=fn):
                    with torch.no_grad():
                        return fn(*args)
            else:
                grads = _gradients_like(fn(*args))

                def step(fn=fn, grads=grads):
                    torch.autograd.backward(_as_tuple(fn(*args)), grads)

            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            times = harness.time_ms(step, device=device, grad_to_none=list(leaves))
            eager_p50 = times[1] if name == "eager" else eager_p50
            compute_bound = op == "loss"
            rate = harness.matmul_rate if compute_bound else harness.copy_bandwidth
            floor = work / rate(device)
            row = harness.row(
                op,
                name,
                mode,
                f"{model} {tokens} tokens",
                dtype,
                times,
                work=work,
                throughput_unit="TFLOP/s" if compute_bound else "TB/s",
                floor_s=floor,
                baseline=eager_p50,
                gpu=gpu,
                version=kf.__version__,
                timestamp=stamp,
            )
            if device == "cuda":
                row.memory_gib = (torch.cuda.max_memory_allocated() - base) / 2**30
            rows.append(row)
        if progress:
            progress()
    if device == "cuda":
        rows += host_rows(gpu, stamp)
    return rows


def host_rows(gpu: str, stamp: str, rounds: int = 5) -> list[harness.Row]:
    """Host microseconds of one forward call at a small size, in a host-bound loop, providers
    taking turns (no synchronization inside the loop)."""
    rows = []
    for op in ("rms_norm", "rotary", "loss"):
        args, _, _ = inputs(op, (128, 256, 4, 2, 64), 64, "cuda", torch.bfloat16, grad=False)
        fns = {n: f for n, f in providers(op, "cuda", 128).items() if n != "compile"}
        samples = {n: [] for n in fns}
        for _ in range(rounds):
            costs = harness.host_us_side_by_side(
                [lambda f=f: f(*args) for f in fns.values()], calls=500, repeats=1
            )
            for n, us in zip(fns, costs, strict=True):
                samples[n].append(us)
        eager = statistics.median(samples["eager"])
        for n, values in samples.items():
            us = statistics.median(values)
            spread = (min(values), us, max(values))
            rows.append(
                harness.row(
                    op,
                    n,
                    "host",
                    "small",
                    "bfloat16",
                    spread,
                    unit="us",
                    baseline=eager,
                    gpu=gpu,
                    version=kf.__version__,
                    timestamp=stamp,
                )
            )
    return rows


def plot(rows: list[harness.Row], path: Path) -> Path:
    """Time relative to eager (lower is better), per op and mode."""
    return harness.plot_vs_baseline(
        rows,
        path,
        title=f"kernels-fused on {rows[0].gpu}" if rows else "kernels-fused",
        panel=lambda r: (r.kernel, r.mode),
        lower=("roofline_fraction", "fraction of the roofline (copy bandwidth; matmul rate)"),
    )


def main(argv: list[str] | None = None) -> None:
    harness.sweep_command(
        argv, __doc__, RESULTS, run, plot, quick_help="the 0.85B shapes only", desc="fused sweep"
    )


if __name__ == "__main__":
    main()
