"""SwiGLU sweep: sizes x dtypes x {eager, torch.compile, Liger, ours}; fwd, bwd, fwd+bwd, host.

``ours`` is the op by name (``torch.ops.llm_scaling_week.swiglu_fwd``), ``swiglu()`` the public
function, and ``previous`` the same kernels at the launch configuration before 0.3.0 (1024
elements per program up to 2**18 elements, 4096 above), so a change of GPU time shows side by
side.

Writes ``results/<gpu>.csv`` (the shared schema of ``llmsys.bench_harness``) and
``results/<gpu>.png``. Run ``python benchmarks/sweep.py --help``; the ``bench`` main job calls
:func:`run`.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import llmsys.bench_harness as harness
import llmsys.kernels_swiglu as ks
from llmsys.triton_launch import forget

RESULTS = Path(__file__).parent / "results"
GPU_SHAPES = [
    (7, 3, 5),
    (128, 128),
    (1000, 1001),
    (1024, 1024),
    (4096, 4096),
    (8192, 8192),
    (16384, 8192),
]
CPU_SHAPES = [(7, 3, 5), (64, 64)]
HOST_SHAPE = (128, 128)


def eager(a, b):
    return F.silu(a) * b


def ours(a, b):
    return torch.ops.llm_scaling_week.swiglu_fwd(a, b)


def _previous_launch_config(n_elements: int) -> tuple[int, int]:
    return (1024, 4) if n_elements <= 1 << 18 else (4096, 8)


@contextlib.contextmanager
def previous_launch_config():
    """The kernels launched at the configuration before 0.3.0 inside the block. The ops'
    recorded replays are forgotten when the switch changes: they launch the configuration they
    were recorded with."""
    ops = ks.ops
    current, ops.launch_config = ops.launch_config, _previous_launch_config
    forget(ops.swiglu_fwd, ops.swiglu_bwd)
    try:
        yield
    finally:
        ops.launch_config = current
        forget(ops.swiglu_fwd, ops.swiglu_bwd)


def providers(device: str) -> dict:
    found = {"eager": eager, "ours": ours, "swiglu()": ks.swiglu, "previous": ks.swiglu}
    if device == "cuda":
        # One specialization per size, dtype and grad mode: past dynamo's default limit of 8 the
        # compiled function silently runs eager (the compile column read 1.00x on 2026-11-26).
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        found["compile"] = torch.compile(eager, dynamic=False)
        try:
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            found["liger"] = LigerSiLUMulFunction.apply
        except ImportError:
            print("liger-kernel is not installed: its rows are skipped", file=sys.stderr)
    return found


def skipped(device: str) -> list[str]:
    """What this sweep leaves out on ``device``, and why."""
    notes = []
    if device != "cuda":
        notes.append(
            "torch.compile, Liger-Kernel and host-cost rows, bfloat16 and sizes above 64x64 need "
            "a CUDA GPU (on CPU the Triton kernel runs under the slow interpreter)"
        )
    else:
        try:
            import liger_kernel  # noqa: F401
        except ImportError:
            notes.append("Liger-Kernel rows: `liger-kernel` is not installed")
    return notes


def bytes_moved(numel: int, dtype: torch.dtype, mode: str) -> int:
    tensors = {"fwd": 3, "bwd": 5, "fwd_bwd": 8}[mode]  # fwd: a, b, out; bwd: g, a, b, da, db
    return tensors * numel * dtype.itemsize


def run(device: str = "cuda", *, quick: bool = False, progress=None) -> list[harness.Row]:
    """Time every provider on every case; returns the rows (speed-up is eager time / time)."""
    shapes = GPU_SHAPES if device == "cuda" else CPU_SHAPES
    dtypes = [torch.float32, torch.bfloat16] if device == "cuda" else [torch.float32]
    if quick:
        shapes = shapes[:2]
    impls = providers(device)
    gpu, stamp = harness.device_name(device), harness.timestamp()
    copy_bw = harness.copy_bandwidth(device)
    rows = []
    cases = [(s, d, m) for s in shapes for d in dtypes for m in ("fwd", "bwd", "fwd_bwd")]
    for shape, dtype, mode in cases:
        a = torch.randn(shape, device=device, dtype=dtype, requires_grad=mode != "fwd")
        b = torch.randn(shape, device=device, dtype=dtype, requires_grad=mode != "fwd")
        g = torch.randn(shape, device=device, dtype=dtype)
        eager_p50 = None
        for name, fn in impls.items():
            if mode == "fwd":

                def step(fn=fn):
                    return fn(a, b)
            elif mode == "bwd":
                out = fn(a, b)  # the graph is kept, so each call times the backward alone

                def step(out=out):
                    out.backward(g, retain_graph=True)
            else:

                def step(fn=fn):
                    fn(a, b).backward(g)

            with previous_launch_config() if name == "previous" else contextlib.nullcontext():
                times = harness.time_ms(step, device=device, grad_to_none=[a, b])
            eager_p50 = times[1] if name == "eager" else eager_p50
            nbytes = bytes_moved(math.prod(shape), dtype, mode)
            rows.append(
                harness.row(
                    "swiglu",
                    name,
                    mode,
                    "x".join(map(str, shape)),
                    dtype,
                    times,
                    work=nbytes,
                    throughput_unit="TB/s",
                    floor_s=nbytes / copy_bw,
                    baseline=eager_p50,
                    gpu=gpu,
                    version=ks.__version__,
                    timestamp=stamp,
                )
            )
        if progress:
            progress()
    if device == "cuda":
        rows += host_rows(impls, gpu, stamp)
    return rows


def host_rows(impls: dict, gpu: str, stamp: str, rounds: int = 5) -> list[harness.Row]:
    """Host cost of one forward call at 128x128 in a host-bound loop (microseconds).

    Providers alternate over several rounds and each reports its median, so a noisy host
    moment does not land on one provider only.
    """
    a = torch.randn(HOST_SHAPE, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    impls = {name: fn for name, fn in impls.items() if name != "previous"}  # same host path
    samples = {name: [] for name in impls}
    for _ in range(rounds):
        for name, fn in impls.items():
            samples[name].append(harness.host_us_per_call(lambda fn=fn: fn(a, b), repeats=3))
    costs = {name: statistics.median(values) for name, values in samples.items()}
    return [
        harness.row(
            "swiglu",
            name,
            "host",
            "x".join(map(str, HOST_SHAPE)),
            "bfloat16",
            (min(samples[name]), us, max(samples[name])),
            unit="us",
            baseline=costs["eager"],
            gpu=gpu,
            version=ks.__version__,
            timestamp=stamp,
        )
        for name, us in costs.items()
    ]


def plot(rows: list[harness.Row], path: Path) -> Path:
    """Time relative to eager (lower is better) and achieved TB/s, per dtype and mode."""
    return harness.plot_vs_baseline(
        rows,
        path,
        title=f"SwiGLU on {rows[0].gpu}" if rows else "SwiGLU",
        panel=lambda r: (r.dtype, r.mode),
        ratio_targets={"fwd": 0.62, "fwd_bwd": 0.65},
    )


def main(argv: list[str] | None = None) -> None:
    harness.sweep_command(
        argv,
        __doc__,
        RESULTS,
        run,
        plot,
        quick_help="only the two smallest shapes",
        desc="swiglu sweep",
    )


if __name__ == "__main__":
    main()
