"""One timer, one row builder and one tidy CSV schema for every llmsys package's benchmarks.

- ``results``: the CSV schema (``Row``, ``CSV_FIELDS``), reading and writing it, device names,
  and the Markdown table every tool prints.
- ``arguments``: the argparse types every command line shares (``positive_int``, ``device``,
  ...), whose errors name the option.
- ``harness``: the timer (``time_ms``), the row builder (``row``), device ceilings
  (``copy_bandwidth``, ``matmul_rate``), host cost per call, and the command line, progress,
  plots and torchrun launch that every package's ``benchmarks/sweep.py`` shares.

Sweeps use it as ``import llmsys.bench_harness as harness``.
"""

from . import arguments, harness, results
from .harness import *  # noqa: F403
from .harness import __all__ as _harness_all
from .results import markdown_table, quantiles, table_section

__version__ = "0.1.0"

__all__ = [
    *_harness_all,
    "__version__",
    "arguments",
    "harness",
    "markdown_table",
    "quantiles",
    "results",
    "table_section",
]
