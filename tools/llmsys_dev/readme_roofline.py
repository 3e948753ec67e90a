"""The profiling README's table of measured against predicted time, generated from the committed
CSVs by ``llmsys-roofline check``'s model (``llmsys.profiling.infra.roofline_check``).

The README holds ``<!-- results:profiling-roofline-check -->`` ... ``<!-- /results:... -->``;
each row of its table is a ``Group`` of CSV rows: how many the model predicts, the median,
smallest and largest measured / predicted time, and how many are off by more than the check's
flag ratio. Unlike ``readme_results`` this module imports the profiling package (and torch).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from llmsys.bench_harness import results
from llmsys.profiling.infra import roofline_check
from llmsys_dev.readme_results import replace_block

NAME = "profiling-roofline-check"
README = Path("packages/profiling/README.md")


@dataclasses.dataclass(frozen=True)
class Group:
    label: str
    package: str
    csv: str  # under packages/<package>/benchmarks/results/
    where: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (Row field, allowed values)

    def path(self, root: Path) -> Path:
        return root / "packages" / self.package / "benchmarks" / "results" / self.csv

    def rows(self, root: Path) -> list[results.Row]:
        return [
            row
            for row in results.read_rows(self.path(root))
            if all(getattr(row, field) in allowed for field, allowed in self.where)
        ]


def _is(field: str, *values: str) -> tuple[str, tuple[str, ...]]:
    return field, values


NCCL = (_is("kernel", "all_reduce"), _is("provider", "nccl"))
MODEL = ("transformer_lm", "transformer_lm/forward", "transformer_lm/backward")
GROUPS = (
    Group("NCCL all-reduce, 2 ranks, 10 to 1000 MB", "ddp", "h200.csv",
          (*NCCL, _is("x", "10 MB", "100 MB", "1000 MB"))),
    Group("NCCL all-reduce, 2 ranks, 1 MB", "ddp", "h200.csv", (*NCCL, _is("x", "1 MB"))),
    Group("gloo all-reduce, 2 to 6 processes", "ddp", "h200.csv", (_is("provider", "gloo"),)),
    Group("`transformer_lm` train steps, their forward and backward", "profiling", "h100.csv",
          (_is("kernel", *MODEL),)),
    Group("`transformer_lm/data_parallel`, 2 ranks", "ddp", "h200.csv",
          (_is("kernel", "transformer_lm/data_parallel"),)),
    Group("kernels-swiglu forward, ours", "kernels-swiglu", "h100.csv",
          (_is("provider", "ours"), _is("mode", "fwd"))),
    Group("kernels-swiglu forward + backward, ours", "kernels-swiglu", "h100.csv",
          (_is("provider", "ours"), _is("mode", "fwd_bwd"))),
    Group("kernels-int8 GEMMs: ours, cuBLAS fp16 and bf16, `torch._int_mm`", "kernels-int8",
          "h100.csv",
          (_is("mode", "gemm"), _is("provider", "ours", "cublas_fp16", "cublas_bf16", "int_mm"))),
    Group("kernels-int8 quantization, ours", "kernels-int8", "h100.csv",
          (_is("kernel", "quantize_int8_perrow"), _is("provider", "ours"))),
    Group("flash-attn2, ours", "flash-attn2", "h100.csv", (_is("provider", "ours"),)),
    Group("flash-attn2's SDPA baselines (flash, cuDNN)", "flash-attn2", "h100.csv",
          (_is("provider", "sdpa_flash", "sdpa_cudnn"),)),
    Group("flash-attn2's naive and compiled attention", "flash-attn2", "h100.csv",
          (_is("provider", "naive", "compile"),)),
    Group("kernels-moe permute and unpermute, ours", "kernels-moe", "h100.csv",
          (_is("provider", "ours", "ours-out_rows"),)),
    Group("kernels-fused, ours", "kernels-fused", "h200.csv", (_is("provider", "ours"),)),
)  # fmt: skip


def table(root: Path) -> str:
    """The generated block's text: where its rows come from, then one line per group."""
    flag = f"{roofline_check.FLAG_RATIO:g}x"
    lines = [
        f"| group | GPU | rows modelled | measured / predicted time (lower is faster): median "
        f"| smallest | largest | more than {flag} off |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for group in GROUPS:
        rows = group.rows(root)
        checks = roofline_check.check_rows(rows)
        if not checks:
            raise ValueError(f"{group.package}/{group.csv}: no modelled row is {group.label!r}")
        median, smallest, largest = roofline_check.ratio_spread(checks)
        gpus = ", ".join(sorted({row.gpu.removeprefix("NVIDIA ") for row in rows}))
        flagged = sum(c.flagged for c in checks)
        cells = [group.label, gpus, str(len(checks)), f"{median:.2f}", f"{smallest:.2f}",
                 f"{largest:.2f}", str(flagged)]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    csvs = dict.fromkeys(group.path(root) for group in GROUPS)
    links = ", ".join(
        f"[{path.parents[2].name} {path.name}]({os.path.relpath(path, (root / README).parent)})"
        for path in csvs
    )
    head = (
        f"Made by `llmsys-roofline check`'s model over the committed CSVs ({links}); a group's "
        "median, smallest and largest of measured / predicted time over the rows it predicts."
    )
    return head + "\n\n" + "\n".join(lines)


def generate(root: Path, texts: dict[Path, str]) -> dict[Path, str]:
    """The profiling README with its block regenerated (``texts``: already generated READMEs)."""
    path = root / README
    text = texts.get(path, path.read_text())
    return {path: replace_block(text, NAME, table(root))}
