"""README results tables, generated from the committed CSVs (standard library only).

A README holds ``<!-- results:NAME -->`` ... ``<!-- /results:NAME -->``; ``TABLES[NAME]`` says
which CSV and which rows it shows. Package tables pivot providers into columns: each provider's
median time and, in brackets, that time over the baseline's (the first provider). Every ratio
of times reads one way, this time over the baseline's (lower is faster), and every column that
holds a ratio says so in its header (``tools/tests/test_ratio_direction.py``). The root README's
table (``results:root``) picks one or two numbers per package from the same CSVs, so a claim has
one value. Each table starts with the GPU, the date of the run and
the command that made it.
"""

from __future__ import annotations

import csv
import dataclasses
import math
from pathlib import Path

MAIN_JOB = "python tools/bench.py"
DDP_COMMAND = "python packages/ddp/benchmarks/sweep.py (2 GPUs)"
# The four runs behind h200-2gpu-fsdp.csv, one after the other on one host.
FSDP_COMMAND = (
    "torchrun --nproc-per-node 2 packages/ddp/benchmarks/fsdp.py --kernels fused --rounds 4 "
    "--steps 5 --strategies 'one GPU alone' 'FSDP bf16' 'FSDP bf16, 2 blocks per gather' 'torch "
    "FSDP2 bf16'; the same with --rounds 2 --checkpointing on; with --rounds 2 --steps 4 "
    "--batch-size 12; with --rounds 2 --strategies FSDP 'torch FSDP2'"
)

# The two llmsys-bench llama runs behind h100-llama-training.csv (each side by side).
LLAMA_TRAINING_COMMAND = (
    "llmsys-bench llama --part training curve --train-shape 4x2048 --compile both --reps 10 "
    "--largest-batch 2048; llmsys-bench llama --model 3b --part training --train-shape 2x2048 "
    "--compile both --reps 5 --warmup 2"
)

# The four llmsys-bench serve runs behind h100-serve-8b.csv, one after the other on one H100 host
# with transformers 5.24 and torchao 0.18 carried in (each case's providers side by side in one
# run, but for torchao's batch-1 decode rows).
SERVE_COMMAND = (
    "llmsys-bench serve --model 8b --prefill 1x4096 8x512 --decode 8 --generate --providers fp16 "
    "int8-fused torchao-int8 torchao-float8 --compile fp16 --warmup 2 --reps 8; the same with "
    "--prefill --decode 1 32 (batch 32, and torchao's batch-1 rows; cut off in generate); with "
    "--prefill --decode 1 --generate --providers fp16 int8-fused --compile fp16 int8-fused (batch "
    "1); with --prefill --decode --generate 8 --compile --generate-tokens 16 --warmup 1 --reps 4 "
    "(generate)"
)

# The two runs behind h100-serve-0.85b.csv, on one H100 host (each case from one of them).
# The run behind h100-serve-8b-transformers-5.17.csv: the decode step reading its static cache
# through flash-attn2 (issue 46), transformers 5.17 (whose SDPA path copies the GQA cache).
SERVE_DECODE_COMMAND = (
    "llmsys-bench serve --model 8b --providers fp16 int8-fused --prefill 1x1024 --decode 1 8 32 "
    "--generate --context 1024"
)
SERVE_SMALL_COMMAND = (
    "llmsys-bench serve --model 0.85b --compile fp16 int8-fused --warmup 2 --reps 8 (cut off at "
    "decode batch 32); the same with --providers fp16 int8-fused (decode batch 32 and generate)"
)


@dataclasses.dataclass(frozen=True)
class Table:
    package: str
    csv: str  # under packages/<package>/benchmarks/results/
    providers: tuple[str, ...]  # columns; the first is the baseline
    where: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (field, allowed values)
    ours: str = "ours"  # the provider whose throughput and roofline fraction are shown
    command: str = ""  # default: the main job for this package
    speedup: bool = False  # add ours' time over the CSV's own baseline (1 / its speed-up)

    def rows(self, root: Path) -> list[dict]:
        allowed = dict(self.where)
        return [
            r
            for r in _read(root, self.package, self.csv)
            if all(r[field] in values for field, values in allowed.items())
        ]


def _read(root: Path, package: str, name: str) -> list[dict]:
    path = root / "packages" / package / "benchmarks" / "results" / name
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _float(value: str) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(number) else number


def _time(p50: float, unit: str) -> str:
    if unit == "ms" and p50 < 1:
        return f"{p50 * 1000:.1f} us"
    return f"{p50:.3g} {unit}" if p50 < 100 else f"{p50:,.0f} {unit}"


def provenance(rows: list[dict], command: str, csv_link: str, baseline: str) -> str:
    gpus = ", ".join(sorted({r["gpu"] for r in rows if r["gpu"]})) or "unknown GPU"
    days = sorted({r["timestamp"][:10] for r in rows if r["timestamp"]})
    when = days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}" if days else "undated"
    return (
        f"{gpus}, {when}, {_versions(rows)}; made by `{command}` "
        f"([CSV]({csv_link})); medians, time over `{baseline}` "
        "in brackets where a baseline applies (lower is faster)."
    )


def _versions(rows: list[dict]) -> str:
    versions = ", ".join(sorted({r["version"] for r in rows if r["version"]}))
    return f"versions {versions}" if versions else "package version not recorded"


def ratio_header(name: str, baseline: str) -> str:
    """A provider column holding its time and, in brackets, its time over the baseline's."""
    return name if name == baseline else f"{name} (time / {baseline}, lower is faster)"


def package_table(table: Table, root: Path) -> str:
    rows = table.rows(root)
    by_case: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        by_case.setdefault((r["kernel"], r["mode"], r["x"], r["dtype"]), {})[r["provider"]] = r
    base = table.providers[0]
    head = ["kernel", "mode", "case", "dtype"]
    head += [ratio_header(name, base) for name in table.providers]
    head += [f"{table.ours} throughput"]
    if table.speedup:  # serve's rule: fp16's fastest mode of the case (generate: the same mode)
        head += [f"{table.ours} time / {base}'s fastest mode, lower is faster"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---|---|" + "---:|" * (len(head) - 4)]
    for (kernel, mode, x, dtype), providers in by_case.items():
        baseline = providers.get(base)
        base_p50 = _float(baseline["p50"]) if baseline else None
        cells = []
        for name in table.providers:
            r = providers.get(name)
            p50 = _float(r["p50"]) if r else None
            if p50 is None:
                cells.append("")
                continue
            text = _time(p50, r["unit"])
            if base_p50 and name != base:
                text += f" ({p50 / base_p50:.2f})"
            cells.append(text)
        if not any(cells):  # a case no provider of the table has a time for
            continue
        ours = providers.get(table.ours)
        rate = ""
        if ours and _float(ours["throughput"]):
            value = _float(ours["throughput"])
            rate = f"{value:,.2f}" if value < 100 else f"{value:,.0f}"
            rate += f" {ours['throughput_unit']}"
            fraction = _float(ours["roofline_fraction"])
            if fraction is not None:
                rate += f" ({fraction:.0%} of roofline)"
        extra = []
        if table.speedup:
            value = _float(ours["speedup_vs_baseline"]) if ours else None
            extra.append(f"{1 / value:.2f}x" if value else "")
        lines.append("| " + " | ".join([kernel, mode, x, dtype, *cells, rate, *extra]) + " |")
    command = table.command or f"{MAIN_JOB} --package {table.package}"
    link = f"benchmarks/results/{table.csv}"
    return provenance(rows, command, link, base) + "\n\n" + "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Pick:
    """One number of the root README: ``field`` of one row, or a ratio of two rows' p50."""

    label: str
    package: str
    csv: str
    row: tuple[str, str, str, str, str]  # kernel, provider, mode, x, dtype ("" matches any)
    over: tuple[str, str, str, str, str] | None = None  # p50 ratio: row / over
    field: str = "p50"
    fmt: str = "{:.2f}x"

    def find(self, rows: list[dict], key: tuple) -> dict:
        names = ("kernel", "provider", "mode", "x", "dtype")
        found = [
            r for r in rows if all(not v or r[n] == v for n, v in zip(names, key, strict=True))
        ]
        if len(found) != 1:
            raise ValueError(f"{self.package}/{self.csv}: {len(found)} rows match {key}")
        return found[0]

    def render(self, root: Path) -> tuple[str, dict]:
        rows = _read(root, self.package, self.csv)
        r = self.find(rows, self.row)
        if self.over:
            value = _float(r["p50"]) / _float(self.find(rows, self.over)["p50"])
        else:
            value = _float(r[self.field])
        return f"{self.label} {self.fmt.format(value)}", r


SW = ("swiglu", "ours", "fwd", "16384x8192", "bfloat16")


def _serve_table(csv_name: str, command: str) -> Table:
    """An ``llmsys-bench serve`` CSV: every provider, ours' speed-up as serve computed it."""
    return Table(
        "profiling",
        csv_name,
        ("fp16", "int8-fused", "torchao-int8", "torchao-float8"),
        (("kernel", ("serve/prefill", "serve/decode", "serve/generate")),),
        ours="int8-fused",
        command=command,
        speedup=True,
    )


# Issue 30's cases in the flash-attn2 sweep (benchmarks/sweep.py: hopper_cases; a test keeps
# the two equal). The leaderboard case is in the package's main table.
FLASH_HOPPER_CASES = (
    *(
        f"4x32x{n}x128{kv}{mask}"
        for n in (2048, 8192)
        for mask in ("", " full")
        for kv in ("", " kv8")
    ),
    *(f"4x32x{n}x64" for n in (2048, 4096, 8192, 16384)),
    "4x32x4096x128",
    "4x32x16384x128",
)

TABLES = {
    "kernels-swiglu": Table(
        "kernels-swiglu",
        "h100.csv",
        ("eager", "ours", "swiglu()", "previous", "compile", "liger"),
        (("mode", ("fwd", "fwd_bwd")),),
    ),
    "kernels-int8": Table(
        "kernels-int8",
        "h100.csv",
        ("cublas_fp16", "ours", "ours_e2e", "int_mm_rescale"),
        (("mode", ("sum4",)),),
        command=f"{MAIN_JOB} --package kernels-int8",
    ),
    "kernels-int8-quantize": Table(
        "kernels-int8",
        "h100.csv",
        ("eager_native", "ours"),
        (("mode", ("quantize",)),),
    ),
    "kernels-moe": Table(
        "kernels-moe",
        "h100.csv",
        ("eager", "ours", "ours-out_rows", "torch.compile"),
        (("mode", ("fwd", "fwd_bwd")),),
    ),
    "flash-attn2": Table(
        "flash-attn2",
        "h100.csv",
        ("sdpa_flash", "ours", "sdpa_cudnn", "previous", "compile"),
        (
            ("x", ("1x16x16384x64", "4x16x4096x128", "1x1x65536x128")),
            ("dtype", ("bfloat16",)),
        ),
    ),
    "flash-attn2-hopper": Table(
        "flash-attn2",
        "h100.csv",
        ("sdpa_cudnn", "ours", "previous", "sdpa_flash"),
        (
            ("x", FLASH_HOPPER_CASES),
            ("mode", ("fwd", "fwd_bwd")),
        ),
    ),
    "profiling": Table(
        "profiling",
        "h100.csv",
        ("eager", "compiled", "llmsys+reduce-overhead", "sdpa+eager+compiled+reduce-overhead"),
        (("kernel", ("transformer_lm",)), ("mode", ("train-step",))),
        ours="llmsys+reduce-overhead",
    ),
    "profiling-llama-inference": Table(
        "profiling",
        "h100-llama.csv",
        ("fp16", "int8", "int8-fused"),
        (("kernel", ("llama/prefill", "llama/decode")),),
        ours="int8-fused",
        command="llmsys-bench llama --part inference --reps 10",
    ),
    "profiling-llama-8b-inference": Table(
        "profiling",
        "h100-llama-8b.csv",
        ("fp16", "int8", "int8-fused"),
        (("kernel", ("llama/prefill", "llama/decode")),),
        ours="int8-fused",
        command="llmsys-bench llama --model 8b --part inference --reps 10",
    ),
    "profiling-serve-8b": _serve_table("h100-serve-8b.csv", SERVE_COMMAND),
    "profiling-serve-0.85b": _serve_table("h100-serve-0.85b.csv", SERVE_SMALL_COMMAND),
    "profiling-serve-8b-decode": _serve_table(
        "h100-serve-8b-transformers-5.17.csv", SERVE_DECODE_COMMAND
    ),
    "profiling-llama-training": Table(
        "profiling",
        "h100-llama-training.csv",
        ("stock", "llmsys", "liger"),
        (("kernel", ("llama/train-step",)),),
        ours="llmsys",
        command=LLAMA_TRAINING_COMMAND,
    ),
    "profiling-llama-largest-batch": Table(
        "profiling",
        "h100-llama-training.csv",
        ("stock", "llmsys", "liger"),
        (("kernel", ("llama/largest-batch",)),),
        ours="llmsys",
        command=LLAMA_TRAINING_COMMAND,
    ),
    "kernels-fused": Table(
        "kernels-fused",
        "h200.csv",
        ("eager", "ours", "compile", "liger"),
        (("mode", ("fwd", "fwd_bwd")),),
    ),
    "ddp": Table(
        "ddp",
        "h100.csv",
        (
            "torch DDP",
            "no communication",
            "naive",
            "flat",
            "bucketed 25 MB",
            "bucketed 1000 MB",
            "bucketed 25 MB bf16",
            "bucketed 100 MB bf16",
        ),
        (("kernel", ("transformer_lm/data_parallel",)),),
        ours="bucketed 100 MB bf16",
        command=DDP_COMMAND,
    ),
    "ddp-fsdp": Table(
        "ddp",
        "h200-2gpu-fsdp.csv",
        (
            "one GPU alone",
            "FSDP bf16",
            "FSDP bf16, 2 blocks per gather",
            "torch FSDP2 bf16",
            "FSDP",
            "torch FSDP2",
        ),
        (("kernel", ("transformer_lm/sharded_training",)),),
        ours="FSDP bf16",
        command=FSDP_COMMAND,
    ),
    "ddp-largest": Table(
        "ddp",
        "h100.csv",
        ("FSDP bf16",),
        (("kernel", ("transformer_lm/largest_fsdp",)),),
        ours="FSDP bf16",
        command=DDP_COMMAND,
    ),
    "ddp-all-reduce": Table(
        "ddp",
        "h100.csv",
        ("nccl",),
        (("kernel", ("all_reduce",)), ("provider", ("nccl",))),
        ours="nccl",
        command=DDP_COMMAND,
    ),
    "sharded-optim": Table(
        "sharded-optim",
        "h100.csv",
        ("adamw", "sharded", "zero-redundancy"),
        (("kernel", ("zero1/train-step", "zero1/optimizer-step")),),
        ours="sharded",
        command="torchrun --nproc-per-node 2 packages/sharded-optim/benchmarks/memory_and_step.py",
    ),
}

ROOT_PICKS = {  # package: (GPU label, picks)
    "kernels-swiglu": [
        Pick("fwd time / eager at 16384x8192 bf16:", "kernels-swiglu", "h100.csv", SW,
             ("swiglu", "eager", "fwd", "16384x8192", "bfloat16")),
        Pick("of copy bandwidth there:", "kernels-swiglu", "h100.csv", SW,
             field="roofline_fraction", fmt="{:.0%}"),
        Pick("fwd+bwd:", "kernels-swiglu", "h100.csv",
             ("swiglu", "ours", "fwd_bwd", "16384x8192", "bfloat16"),
             ("swiglu", "eager", "fwd_bwd", "16384x8192", "bfloat16")),
        Pick("fwd at 7x3x5 fp32:", "kernels-swiglu", "h100.csv",
             ("swiglu", "ours", "fwd", "7x3x5", "float32"),
             ("swiglu", "eager", "fwd", "7x3x5", "float32")),
    ],
    "kernels-int8": [
        Pick("the four Qwen2.5-3B GEMMs at 16384 tokens, time / cuBLAS fp16:", "kernels-int8",
             "h100.csv", ("w8a8_gemm", "ours", "sum4", "M=16384 all shapes", "int8"),
             ("w8a8_gemm", "cublas_fp16", "sum4", "M=16384 all shapes", "fp16")),
        Pick("with activation quantization (end to end):", "kernels-int8", "h100.csv",
             ("w8a8_gemm", "ours_e2e", "sum4", "M=16384 all shapes", "int8"),
             ("w8a8_gemm", "cublas_fp16", "sum4", "M=16384 all shapes", "fp16")),
        Pick("decode (M=1) end to end:", "kernels-int8", "h100.csv",
             ("w8a8_gemm", "ours_e2e", "sum4", "M=1 all shapes", "int8"),
             ("w8a8_gemm", "cublas_fp16", "sum4", "M=1 all shapes", "fp16")),
    ],
    "flash-attn2": [
        Pick("causal bf16 fwd+bwd at 1x16x16384x64, time / SDPA flash:", "flash-attn2",
             "h100.csv", ("flash_attention", "ours", "fwd_bwd", "1x16x16384x64", "bfloat16"),
             ("flash_attention", "sdpa_flash", "fwd_bwd", "1x16x16384x64", "bfloat16")),
        Pick("/ cuDNN:", "flash-attn2", "h100.csv",
             ("flash_attention", "ours", "fwd_bwd", "1x16x16384x64", "bfloat16"),
             ("flash_attention", "sdpa_cudnn", "fwd_bwd", "1x16x16384x64", "bfloat16")),
    ],
    "kernels-moe": [
        Pick("permute time / eager at T16384-H4096-k8-E128:", "kernels-moe", "h100.csv",
             ("moe_permute", "ours", "fwd", "T16384-H4096-k8-E128", "bfloat16"),
             ("moe_permute", "eager", "fwd", "T16384-H4096-k8-E128", "bfloat16")),
        Pick("unpermute:", "kernels-moe", "h100.csv",
             ("moe_unpermute", "ours", "fwd", "T16384-H4096-k8-E128", "bfloat16"),
             ("moe_unpermute", "eager", "fwd", "T16384-H4096-k8-E128", "bfloat16")),
    ],
    "ddp": [
        Pick("NCCL all-reduce bus bandwidth at 1000 MB (GB/s):", "ddp", "h100.csv",
             ("all_reduce", "nccl", "2 ranks", "1000 MB", ""), field="throughput",
             fmt="{:.0f}"),
        Pick("xl train step on 2 GPUs, bucketed 25 MB / torch DDP:", "ddp", "h100.csv",
             ("transformer_lm/data_parallel", "bucketed 25 MB", "", "", ""),
             ("transformer_lm/data_parallel", "torch DDP", "", "", "")),
        Pick("bucketed 100 MB bf16 / torch DDP:", "ddp", "h100.csv",
             ("transformer_lm/data_parallel", "bucketed 100 MB bf16", "", "", ""),
             ("transformer_lm/data_parallel", "torch DDP", "", "", "")),
        Pick("FSDP bf16 / torch FSDP2 bf16 (2 x H200, batch 4 per GPU):", "ddp",
             "h200-2gpu-fsdp.csv",
             ("transformer_lm/sharded_training", "FSDP bf16", "2 ranks, fused norm+rope",
              "xl ctx512 b4/rank", ""),
             ("transformer_lm/sharded_training", "torch FSDP2 bf16", "2 ranks, fused norm+rope",
              "xl ctx512 b4/rank", "")),
    ],
    "sharded-optim": [
        Pick("AdamW state, GiB: unsharded", "sharded-optim", "h100.csv",
             ("zero1/optimizer-state", "adamw", "accounting", "", ""), field="memory_gib",
             fmt="{:.2f}"),
        Pick("per rank of 2:", "sharded-optim", "h100.csv",
             ("zero1/optimizer-state", "sharded", "accounting", "", ""), field="memory_gib",
             fmt="{:.2f}"),
        Pick("peak saving, GiB:", "sharded-optim", "h100.csv",
             ("zero1/peak-saving", "sharded", "accounting", "", ""), field="memory_gib",
             fmt="{:.2f}"),
    ],
    "kernels-fused": [
        Pick("Llama-3.2-3B loss fwd+bwd at 8192 tokens, time / eager:", "kernels-fused",
             "h200.csv", ("loss", "ours", "fwd_bwd", "3B 8192 tokens", "bfloat16"),
             ("loss", "eager", "fwd_bwd", "3B 8192 tokens", "bfloat16")),
        Pick("/ Liger:", "kernels-fused", "h200.csv",
             ("loss", "ours", "fwd_bwd", "3B 8192 tokens", "bfloat16"),
             ("loss", "liger", "fwd_bwd", "3B 8192 tokens", "bfloat16")),
        Pick("RMSNorm fwd+bwd there / Liger:", "kernels-fused", "h200.csv",
             ("rms_norm", "ours", "fwd_bwd", "3B 8192 tokens", "bfloat16"),
             ("rms_norm", "liger", "fwd_bwd", "3B 8192 tokens", "bfloat16")),
    ],
    "profiling": [
        Pick("medium ctx 1024 bf16 train step, every llmsys kernel + CUDA graphs / eager:",
             "profiling", "h100.csv",
             ("transformer_lm", "llmsys+reduce-overhead", "train-step", "medium ctx=1024 batch=4",
              "bf16"),
             ("transformer_lm", "eager", "train-step", "medium ctx=1024 batch=4", "bf16")),
        Pick("/ torch.compile:", "profiling", "h100.csv",
             ("transformer_lm", "llmsys+reduce-overhead", "train-step", "medium ctx=1024 batch=4",
              "bf16"),
             ("transformer_lm", "compiled", "train-step", "medium ctx=1024 batch=4", "bf16")),
    ],
}  # fmt: skip


def root_table(root: Path) -> str:
    lines = [
        "| package | GPU, date | headline (time ratios: lower is faster) | made by |",
        "|---|---|---|---|",
    ]
    for package, picks in ROOT_PICKS.items():
        texts, rows = zip(*(pick.render(root) for pick in picks), strict=True)
        gpus = ", ".join(sorted({r["gpu"].removeprefix("NVIDIA ") for r in rows}))
        days = ", ".join(sorted({r["timestamp"][:10] for r in rows}))
        table = next(t for t in TABLES.values() if t.package == package)
        command = table.command or f"{MAIN_JOB} --package {package}"
        link = f"[{package}](packages/{package}#results)"
        lines.append(f"| {link} | {gpus}, {days} | {'; '.join(texts)} | `{command}` |")
    return "\n".join(lines)


HOST_COST_COMMAND = "python packages/profiling/benchmarks/host_cost.py"


def host_cost_table(root: Path) -> str:
    """triton-launch's table: host microseconds per call of each package's call against what a
    user calls instead, with the recorded plans and without them (the Python fallback)."""
    rows = [r for r in _read(root, "profiling", "host_cost_h100.csv") if r["kind"] == "host"]
    fallback = {
        r["case"]: r
        for r in _read(root, "profiling", "host_cost_h100_without_native_plans.csv")
        if r["kind"] == "host"
    }
    lines = [
        "| call | ours | instead | ours / instead, lower is faster | target, lower is faster "
        "| without native plans (ours / instead, lower is faster) |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        ratio, target = _float(r["ratio"]), _float(r["target_ratio"])
        mark = "" if ratio is None or target is None else " ✓" if ratio <= target else " ✗"
        old = fallback.get(r["case"])
        cells = [
            r["case"],
            f"{float(r['ours_us']):.1f} us",
            f"{r['baseline']}: {float(r['baseline_us']):.1f} us" if r["baseline"] else "",
            f"{ratio:.2f}x{mark}" if ratio is not None else "",
            f"{target:g}x" if target is not None else "",
            ""
            if old is None
            else f"{float(old['ours_us']):.1f} us"
            + (f" ({float(old['ratio']):.2f}x)" if old["ratio"] else ""),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    gpus = ", ".join(sorted({r["gpu"] for r in rows}))
    days = ", ".join(sorted({r["date"] for r in rows}))
    head = (
        f"{gpus}, {days}, torch {rows[0]['torch']}, triton {rows[0]['triton']}; made by "
        f"`{HOST_COST_COMMAND}` ([CSV](../profiling/benchmarks/results/host_cost_h100.csv)), and "
        f"with `LLMSYS_NATIVE_PLANS=0` for the last column "
        "([CSV](../profiling/benchmarks/results/host_cost_h100_without_native_plans.csv), "
        "another run, on another host: compare its ratios, not its microseconds). Host "
        "microseconds per call, loops of 50 calls "
        "without a synchronize, medians of 21, ours and the call a user makes instead taking "
        "turns in one process."
    )
    return head + "\n\n" + "\n".join(lines)


DECODE_GEMM_COMMAND = "python packages/kernels-int8/benchmarks/decode_gemm.py"


def decode_gemm_table(root: Path) -> str:
    """kernels-int8's decode GEMM table: per shape, the fastest of the tuner's candidates, the
    fastest of every configuration tried, the tuner's pick after a write flush, and a plain read
    of the same weight bytes."""
    rows = _read(root, "kernels-int8", "decode_gemm_h100.csv")
    lines = [
        "| M, K, N | the tuner's best | best of all | fraction of copy bandwidth "
        "| after a write flush | a plain read of the bytes | target |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for shape in dict.fromkeys(r["x"] for r in rows):
        of_shape = [r for r in rows if r["x"] == shape]
        by_kind: dict[str, list[dict]] = {}
        for r in of_shape:
            by_kind.setdefault(r["config"].split(";")[0], []).append(r)
        candidates = by_kind["the tuner's candidate"]
        tuner = min(candidates, key=lambda r: float(r["p50"]))
        best = min(candidates + by_kind["grid"], key=lambda r: float(r["p50"]))
        flushed, read = by_kind["the tuner's best"][0], by_kind["a plain read of the same bytes"][0]
        cells = [
            ", ".join(part.split("=")[1] for part in shape.split()),
            _time(float(tuner["p50"]), "ms"),
            _time(float(best["p50"]), "ms"),
            f"{float(tuner['roofline_fraction']):.0%} ({float(best['roofline_fraction']):.0%})",
            _time(float(flushed["p50"]), "ms"),
            _time(float(read["p50"]), "ms"),
            tuner["config"].split("target ")[1],
        ]
        lines.append("| " + " | ".join(cells) + " |")
    head = provenance(rows, DECODE_GEMM_COMMAND, "benchmarks/results/decode_gemm_h100.csv", "")
    head = head.split("; medians")[0] + "; medians of each configuration, in microseconds."
    return head + "\n\n" + "\n".join(lines)


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` with the body of its ``<!-- results:NAME -->`` block replaced (if it has one)."""
    start, end = f"<!-- results:{name} -->", f"<!-- /results:{name} -->"
    if start not in text:
        return text
    head, rest = text.split(start, 1)
    return f"{head}{start}\n{body}\n{end}{rest.split(end, 1)[1]}"


def generate(root: Path, texts: dict[Path, str]) -> dict[Path, str]:
    """README texts with every results block regenerated (``texts``: already generated ones)."""
    out = {}
    readmes = [root / "README.md", *sorted((root / "packages").glob("*/README.md"))]
    for path in readmes:
        text = texts.get(path, path.read_text())
        new = replace_block(text, "root", root_table(root)) if path.parent == root else text
        new = replace_block(new, "triton-launch-host-cost", host_cost_table(root))
        new = replace_block(new, "kernels-int8-decode-gemm", decode_gemm_table(root))
        for name, table in TABLES.items():
            if f"<!-- results:{name} -->" in new:
                new = replace_block(new, name, package_table(table, root))
        if new != text or path in texts:
            out[path] = new
    return out
