"""A/B on the GPU: this package's kernels against an earlier copy of them, interleaved in one run.

Run-to-run noise on a shared GPU host is ~5%, as large as most kernel changes, so a change is
only judged against its predecessor timed in the same process, round after round. The earlier
version is a copy of ``src/llmsys/flash_attn2`` (for example from ``git archive``); it is loaded
as another module with its ops in another namespace, so both live side by side.

    git archive HEAD~1 packages/flash-attn2/src/llmsys/flash_attn2 | tar -x -C /tmp/before
    python benchmarks/ab.py --before /tmp/before/packages/flash-attn2/src/llmsys/flash_attn2

Prints and writes (``--out``) a table of median milliseconds per variant, case and mode, with
SDPA flash and cuDNN timed in the same rounds; the per-kernel split of the current version
(profiler) follows. ``--variants`` adds module-level switches of ``ops`` to compare, such as
``FOLD_SCALE=False``; a switch is set for the forward call only (the backward runs after it).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

CASES = [(1, 16, 16384, 64), (4, 16, 4096, 128), (1, 1, 4096, 64), (1, 1, 512, 64)]
# Every provider is called as fn(q, k, v) and is causal.


def load_copy(source: Path, name: str):
    """Import the copy at ``source`` as module ``name``, its ops under ``torch.ops.<name>``."""
    root = Path(tempfile.mkdtemp()) / name
    shutil.copytree(source, root)
    ops_file = root / "ops.py"
    text = ops_file.read_text().replace('NAMESPACE = "llmsys"', f'NAMESPACE = "{name}"')
    ops_file.write_text(text.replace("torch.ops.llmsys.", f"torch.ops.{name}."))
    spec = importlib.util.spec_from_file_location(
        name, root / "__init__.py", submodule_search_locations=[str(root)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def attention(q, k, v, causal=True):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return attention


def causal_attention(module, switches: dict | None = None):
    """``module.flash_attention``, causal, run with ``module.ops`` globals set to ``switches``."""
    switches = switches or {}

    def attention(q, k, v, causal=True):
        saved = {name: getattr(module.ops, name) for name in switches}
        for name, value in switches.items():
            setattr(module.ops, name, value)
        try:
            return module.flash_attention(q, k, v, causal=causal)
        finally:
            for name, value in saved.items():
                setattr(module.ops, name, value)

    return attention


def time_modes(fn, shape) -> dict[str, float]:
    import triton.testing

    q, k, v, grad_out = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with torch.no_grad():  # medians (do_bench's default is the mean)
        fwd = triton.testing.do_bench(lambda: fn(q, k, v), warmup=25, rep=200, quantiles=[0.5])
    both = triton.testing.do_bench(
        lambda: fn(*leaves).backward(grad_out),
        warmup=25,
        rep=200,
        grad_to_none=leaves,
        quantiles=[0.5],
    )
    with torch.no_grad():  # host time of a forward call: enqueue 50 without waiting
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(50):
            fn(q, k, v)
        host_us = (time.perf_counter() - started) / 50 * 1e6
        torch.cuda.synchronize()
    return {"fwd": fwd, "fwd_bwd": both, "fwd_host_us": host_us}


def kernel_split(attention, shape, repeats: int = 20) -> tuple[dict[str, float], float]:
    """Device ms per kernel of one fwd+bwd, and the median event-timed ms of the same steps.

    The loop is do_bench's (gradients reset, a 256 MB L2 flush, CUDA events around the step),
    under the profiler, so that every kernel in the timed span is listed: a sum of kernels
    below the span means idle GPU time inside the step.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    q, k, v, grad_out = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    attention(*leaves).backward(grad_out)
    torch.cuda.synchronize()
    events = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            for t in leaves:
                t.grad = None
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            attention(*leaves).backward(grad_out)
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
    span = statistics.median(start.elapsed_time(end) for start, end in events)
    kernels = {
        event.key: event.device_time_total / 1000 / repeats
        for event in prof.key_averages()
        if event.device_type == DeviceType.CUDA and event.device_time_total > 0
    }
    return kernels, span


def parse_switch(text: str) -> tuple[str, dict]:
    """``"FOLD_SCALE=False"`` -> ``("FOLD_SCALE=False", {"FOLD_SCALE": False})``."""
    name, value = text.split("=")
    return text, {name: ast.literal_eval(value)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="an earlier copy of src/llmsys/flash_attn2")
    parser.add_argument(
        "--variants", nargs="*", default=[], help="ops switches for the forward, NAME=VALUE"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("ab-out"))
    args = parser.parse_args(argv)
    from torch.nn.attention import SDPBackend

    import llmsys.flash_attn2 as after

    providers = {"sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION)}
    providers["sdpa_cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    if args.before:
        providers["before"] = causal_attention(load_copy(args.before, "flash_attn2_before"))
    providers["after"] = causal_attention(after)
    for text in args.variants:
        label, switches = parse_switch(text)
        providers[f"after {label}"] = causal_attention(after, switches)

    times: dict[tuple, list[float]] = {}
    names = list(providers)
    for round_ in range(args.rounds):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]  # rotate: no fixed slot
        for shape in CASES:
            for name in order:
                for mode, ms in time_modes(providers[name], shape).items():
                    times.setdefault((shape, name, mode), []).append(ms)
        print(f"round {round_ + 1} of {args.rounds} done", flush=True)

    lines = [f"GPU: {torch.cuda.get_device_name()}, causal bf16, median of {args.rounds} rounds"]
    lines.append(f"{'case':>16} {'mode':12}" + "".join(f"{name:>18}" for name in providers))
    for shape in CASES if args.rounds else ():
        for mode in ("fwd", "fwd_bwd", "fwd_host_us"):
            cells = [statistics.median(times[(shape, name, mode)]) for name in providers]
            lines.append(
                f"{'x'.join(map(str, shape)):>16} {mode:12}"
                + "".join(f"{ms:18.4f}" for ms in cells)
            )
    lines.append("every round, ms:")
    for (shape, name, mode), samples in times.items():
        rounds = " ".join(f"{ms:.4f}" for ms in samples)
        lines.append(f"  {'x'.join(map(str, shape))} {mode:8} {name:24} {rounds}")
    lines.append("per-kernel ms of one fwd+bwd (after; the L2 flush is outside the span):")
    for shape in CASES[:2]:
        kernels, span = kernel_split(providers["after"], shape)
        for kernel, ms in kernels.items():
            lines.append(f"  {'x'.join(map(str, shape))} {kernel[:60]:60} {ms:.4f}")
        lines.append(
            f"  {'x'.join(map(str, shape))} {'event-timed span of the step':60} {span:.4f}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ab.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
