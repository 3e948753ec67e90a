"""Floating-point precision: the error of float16 accumulation, and the dtypes autocast produces.

(a) accumulate (CS336 assignment 2): s = 0, then s += 0.01 a thousand times, four ways:
    ``fp32 += fp32``, ``fp16 += fp16``, ``fp32 += fp16`` (the in-place add converts the float16
    0.01, already rounded, to float32) and ``fp32 += fp16.float()`` (the same, explicitly).
    Nothing is timed, so these rows reuse the schema like this: kernel ``accumulate``, provider
    the way, mode ``sum``, x ``1000 x 0.01``, dtype the accumulator's; the sum is in
    ``throughput`` (throughput_unit ``value``), its absolute error from 10 in ``config``
    (``abs_error=...``); p20 / p50 / p80 are NaN and unit is empty.
(b) autocast: the assignment's ToyModel (fc1 = Linear(in, 10, no bias), ReLU, LayerNorm(10),
    fc2 = Linear(10, out, no bias)) with a cross-entropy loss, run under ``torch.autocast`` in
    each ``--autocast`` dtype the device supports (others are skipped with the reason printed).
    The dtypes are observed, not looked up: forward hooks on fc1, the layer norm and fc2 (the
    logits) record their outputs' dtypes, beside those of the parameters, the loss and the
    gradients. Rows: kernel ``autocast``, provider the autocast dtype, mode the tensor, x
    ``ToyModel``, dtype the observed dtype; times NaN. Note the device matters: CUDA autocast runs
    layer_norm in float32, CPU autocast leaves it in the input's (lower) precision.
Both tables are also printed in plain text before the Markdown table.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmsys.bench_harness import results

HELP = "float16 vs float32 accumulation error, and the dtypes autocast gives a small model"
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TENSORS = ("parameters", "fc1 output", "layernorm output", "logits", "loss", "gradients")
NAN = float("nan")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--autocast",
        nargs="+",
        default=list(AUTOCAST_DTYPES),
        choices=list(AUTOCAST_DTYPES),
        help="autocast dtypes to inspect",
    )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def accumulate(
    device: torch.device | str = "cpu", steps: int = 1000, addend: float = 0.01
) -> dict[str, torch.Tensor]:
    """The four sums of ``steps`` x ``addend`` from 0: way -> 0-dim tensor (the accumulator)."""

    def total(
        accumulator: torch.dtype, addend_dtype: torch.dtype, upcast: bool = False
    ) -> torch.Tensor:
        s = torch.tensor(0.0, dtype=accumulator, device=device)
        x = torch.tensor(addend, dtype=addend_dtype, device=device)
        for _ in range(steps):
            s += x.float() if upcast else x
        return s

    return {
        "fp32 += fp32": total(torch.float32, torch.float32),
        "fp16 += fp16": total(torch.float16, torch.float16),
        "fp32 += fp16": total(torch.float32, torch.float16),
        "fp32 += fp16.float()": total(torch.float32, torch.float16, upcast=True),
    }


class ToyModel(nn.Module):
    """The assignment's toy model: (batch, in_features) -> (batch, out_features) logits."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, 10, bias=False)
        self.ln = nn.LayerNorm(10)
        self.fc2 = nn.Linear(10, out_features, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.ln(self.relu(self.fc1(x))))


def autocast_unsupported(device_type: str, dtype: torch.dtype) -> str | None:
    """Why ``torch.autocast(device_type, dtype)`` would not run, or None if it would."""
    # Unsupported combinations either raise or warn and disable autocast, depending on device.
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.autocast(device_type, dtype=dtype):
                enabled = torch.is_autocast_enabled(device_type)
    except RuntimeError as error:
        return str(error)
    if enabled:
        return None
    return "; ".join(str(w.message) for w in caught) or "autocast stays disabled"


def autocast_dtypes(device: torch.device | str, dtype: torch.dtype) -> dict[str, str]:
    """Tensor (one of TENSORS) -> observed dtype name, for one forward + backward of ToyModel.

    Parameters and gradients list every distinct dtype, comma-separated.
    """
    model = ToyModel(16, 4).to(device)
    seen: dict[str, torch.Tensor] = {}
    hooked = {"fc1 output": model.fc1, "layernorm output": model.ln, "logits": model.fc2}
    for tensor, module in hooked.items():
        module.register_forward_hook(lambda m, inputs, out, key=tensor: seen.update({key: out}))
    x = torch.randn(8, 16, device=device)
    targets = torch.randint(0, 4, (8,), device=device)
    with torch.autocast(torch.device(device).type, dtype=dtype):
        loss = F.cross_entropy(model(x), targets)
    loss.backward()
    seen["loss"] = loss
    observed = {tensor: _name(seen[tensor].dtype) for tensor in seen}

    def dtypes(tensors: Iterable[torch.Tensor]) -> str:
        return ", ".join(sorted({_name(t.dtype) for t in tensors}))

    observed["parameters"] = dtypes(model.parameters())
    observed["gradients"] = dtypes(p.grad for p in model.parameters() if p.grad is not None)
    return {tensor: observed[tensor] for tensor in TENSORS}


def run(args: argparse.Namespace) -> list[results.Row]:
    device = torch.device(args.device)
    common: dict[str, Any] = dict(
        gpu=results.device_name(device), version=f"torch {torch.__version__}"
    )
    common.update(timestamp=results.timestamp(), p20=NAN, p50=NAN, p80=NAN, unit="")
    rows = []

    print("s = 0; s += 0.01, 1000 times (exact: 10)")
    for way, s in accumulate(device).items():
        error = abs(s.item() - 10.0)
        print(f"  {way:<22} {_name(s.dtype):<9} {s.item():<12.7g} abs error {error:.3g}")
        rows.append(
            results.Row(
                kernel="accumulate", provider=way, mode="sum", x="1000 x 0.01",
                dtype=_name(s.dtype), throughput=s.item(), throughput_unit="value",
                config=f"abs_error={error:.6g}", **common,
            )
        )  # fmt: skip

    tables = {}
    for name in args.autocast:
        reason = autocast_unsupported(device.type, AUTOCAST_DTYPES[name])
        if reason:
            print(f"\nautocast {name} on {device.type}: skipped ({reason})")
            continue
        tables[name] = autocast_dtypes(device, AUTOCAST_DTYPES[name])
        rows += [
            results.Row(kernel="autocast", provider=name, mode=tensor, x="ToyModel",
                        dtype=observed, **common)
            for tensor, observed in tables[name].items()
        ]  # fmt: skip
    if tables:
        print(f"\nToyModel under torch.autocast on {device.type}: observed dtypes")
        print(f"  {'tensor':<18}" + "".join(f"{name:<10}" for name in tables))
        for tensor in TENSORS:
            print(f"  {tensor:<18}" + "".join(f"{table[tensor]:<10}" for table in tables.values()))
    print()
    return rows
