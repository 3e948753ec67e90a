"""Predicted against measured: the roofline's prediction for each row of a results CSV it can
model, the measured p50 and their ratio.

Rows it models (others are skipped):

- ``all_reduce`` (the ddp package's sweep; x "100 MB" in decimal megabytes, mode "2 ranks"):
  a flat ring all-reduce of ``collectives``. NCCL rows run over the GPU's NVLink (``gpu``
  names the GPU); gloo rows run on CPU processes, modelled as if over the host link (PCIe
  Gen5), which gloo's TCP loopback and CPU reduction are far from (see the README).
- ``transformer_lm`` (train step), ``transformer_lm/forward``, ``transformer_lm/backward``
  and ``transformer_lm/data_parallel`` (x "medium ctx=1024 batch=4" or "xl ctx512
  b4/rank"): matmul FLOPs (``accounting``) at the GPU's datasheet peak, i.e. 100% MFU, with
  data-parallel communication assumed hidden; the ratio is then the MFU.
- every kernel package's rows (throughput in TB/s, TFLOP/s or TOP/s): the row's own bytes or
  operations (its throughput times its time, as its benchmark counted them) at the GPU's
  datasheet bandwidth or tensor-core peak for its dtype (float32 at the TF32 peak, the ceiling
  of a tensor-core kernel), and never under the minimum kernel time. The ratio is then one over
  the fraction of the datasheet roofline the kernel reached.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

from llmsys.bench_harness import results

from ..config import SIZES, ModelConfig
from . import accounting, collectives, hardware

FLAG_RATIO = 2.0  # a prediction more than this factor off either way is flagged
MB = 1e6  # the ddp sweep's sizes are decimal megabytes
# nominal stand-in for gloo's transport on one host (see the module docstring)
GLOO_LINK = collectives.Link("host link (PCIe Gen5)", 10e-6, 64e9)


@dataclasses.dataclass(frozen=True)
class Check:
    """One modelled row: ``predicted_ms`` and ``measured_ms`` (the row's p50) and how."""

    kernel: str
    provider: str
    mode: str
    x: str
    predicted_ms: float
    measured_ms: float
    model: str

    @property
    def ratio(self) -> float:
        """measured / predicted (above 1: slower than the model)."""
        return self.measured_ms / self.predicted_ms

    @property
    def flagged(self) -> bool:
        return not 1 / FLAG_RATIO <= self.ratio <= FLAG_RATIO


def predict(row: results.Row) -> tuple[float, str] | None:
    """(predicted milliseconds, how) for a row the roofline models, else None."""
    if row.kernel == "all_reduce":
        return _predict_all_reduce(row)
    if row.kernel in ("transformer_lm", "transformer_lm/forward", "transformer_lm/backward"):
        return _predict_model(row, data_parallel=False)
    if row.kernel == "transformer_lm/data_parallel":
        return _predict_model(row, data_parallel=True)
    if row.throughput_unit in KERNEL_UNITS and row.throughput and row.p50:
        return _predict_kernel(row)
    return None


KERNEL_UNITS = ("TB/s", "TFLOP/s", "TOP/s")
# the tensor-core peak each dtype's matmuls can reach (float32: TF32, what Triton's dots use)
PRECISION_OF = {"bfloat16": "bf16", "bf16": "bf16", "float16": "bf16", "fp16": "bf16",
                "float32": "tf32", "fp32": "tf32", "int8": "int8"}  # fmt: skip


def _predict_kernel(row: results.Row) -> tuple[float, str] | None:
    spec = hardware.find(row.gpu)
    if spec is None:
        return None
    assert row.throughput is not None  # (predict passes only rows with one)
    work = row.throughput * 1e12 * row.p50 / 1e3  # bytes, FLOPs or operations the row counted
    if row.throughput_unit == "TB/s":
        seconds = work / spec.memory_bandwidth
        how = f"bytes at {spec.memory_bandwidth / 1e12:g} TB/s"
    else:
        precision = PRECISION_OF.get(row.dtype)
        if precision is None or precision not in spec.matmul_flops:
            return None
        peak = spec.peak(precision)
        seconds = work / peak
        how = f"{row.throughput_unit[1:]} at {precision} {peak / 1e12:g} T/s"
    if spec.min_kernel_time > seconds:
        seconds = spec.min_kernel_time
        how = f"minimum kernel time {spec.min_kernel_time * 1e6:g} us"
    return seconds * 1e3, f"{spec.name} {how}"


def _predict_all_reduce(row: results.Row) -> tuple[float, str] | None:
    size = re.fullmatch(r"([\d.]+) MB", row.x.strip())
    ranks = re.fullmatch(r"(\d+) ranks?", row.mode.strip())
    if not size or not ranks:
        return None
    nbytes, n = float(size.group(1)) * MB, int(ranks.group(1))
    if row.provider == "gloo":
        link = GLOO_LINK
    else:
        spec = hardware.find(row.gpu)
        if spec is None:
            return None
        link = collectives.intra_node_link(spec)
        link = dataclasses.replace(link, name=f"{spec.name} {link.name}")
    seconds = collectives.flat_time("all-reduce", nbytes, n, link, "ring")
    return seconds * 1e3, f"ring over {link.name} {link.bandwidth / 1e9:g} GB/s"


def _predict_model(row: results.Row, data_parallel: bool) -> tuple[float, str] | None:
    case = re.match(r"(\S+) ctx=?(\d+) (?:batch=|b)(\d+)", row.x.strip())
    spec = hardware.find(row.gpu)
    if not case or case.group(1) not in SIZES or spec is None or row.dtype != "bf16":
        return None
    size, context, batch = case.group(1), int(case.group(2)), int(case.group(3))
    config = ModelConfig.named(size, context_length=context)
    if row.kernel == "transformer_lm/forward":
        flops = accounting.forward_flops(config, batch, context)
    elif row.kernel == "transformer_lm/backward":
        flops = 2 * accounting.forward_flops(config, batch, context)
    else:
        flops = accounting.step_flops(config, batch, context, "train-step")
    how = f"FLOPs at {spec.name} bf16 {spec.peak('bf16') / 1e12:g} TFLOP/s"
    return flops / spec.peak("bf16") * 1e3, how + (" (comm hidden)" if data_parallel else "")


def check(path: str | Path) -> list[Check]:
    """Every row of the results CSV at ``path`` that :func:`predict` models."""
    return check_rows(results.read_rows(path))


def check_rows(rows: list[results.Row]) -> list[Check]:
    """Every row that :func:`predict` models, with its prediction."""
    checks = []
    for row in rows:
        prediction = predict(row)
        if prediction is None or row.p50 is None or math.isnan(row.p50):
            continue
        predicted_ms, how = prediction
        checks.append(Check(row.kernel, row.provider, row.mode, row.x, predicted_ms, row.p50, how))
    return checks


def markdown(checks: list[Check]) -> str:
    """The checks as a Markdown table, flagged rows marked."""
    lines = [
        "| kernel | provider | mode | case | predicted ms | measured ms | measured/predicted "
        "| flag | model |",
        "|---|---|---|---|---:|---:|---:|---|---|",
    ]
    for c in checks:
        flag = f">{FLAG_RATIO:g}x off" if c.flagged else ""
        lines.append(
            f"| {c.kernel} | {c.provider} | {c.mode} | {c.x} | {c.predicted_ms:.4g} | "
            f"{c.measured_ms:.4g} | {c.ratio:.2f} | {flag} | {c.model} |"
        )
    return "\n".join(lines)


def summary_markdown(checks: list[Check]) -> str:
    """One line per (kernel, mode, provider): how many rows, and the median, smallest and
    largest measured/predicted ratio (a benchmark with hundreds of rows reads at a glance)."""
    groups: dict[tuple[str, str, str], list[Check]] = {}
    for c in checks:
        groups.setdefault((c.kernel, c.mode, c.provider), []).append(c)
    lines = [
        "| kernel | mode | provider | rows | measured/predicted: median | min | max | "
        f">{FLAG_RATIO:g}x off |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for (kernel, mode, provider), group in groups.items():
        median, smallest, largest = ratio_spread(group)
        flagged = sum(c.flagged for c in group)
        lines.append(
            f"| {kernel} | {mode} | {provider} | {len(group)} | {median:.2f} | {smallest:.2f} | "
            f"{largest:.2f} | {flagged} |"
        )
    return "\n".join(lines)


def ratio_spread(checks: list[Check]) -> tuple[float, float, float]:
    """The median (of an even count, the upper one), smallest and largest measured/predicted."""
    ratios = sorted(c.ratio for c in checks)
    return ratios[len(ratios) // 2], ratios[0], ratios[-1]
