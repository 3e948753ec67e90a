"""``llmsys-bench``: the Transformer LM's benchmarks, one subcommand each.

    llmsys-bench e2e --size medium --context-length 1024 --preset llmsys
    llmsys-bench memory --size small --context-length 128 256 512
    llmsys-bench profile --size small
    llmsys-bench attention
    llmsys-bench precision
    llmsys-bench llama --quick
    llmsys-bench serve --model 8b
    torchrun --nproc-per-node 4 -m llmsys.profiling.cli train --model 8b --strategies fsdp fsdp2
    llmsys-bench report llmsys-bench-results/ --out REPORT.md

Every subcommand prints a Markdown table and writes ``<out>/<subcommand>.csv`` in the shared
results schema (``llmsys.bench_harness.results``; each run overwrites it: ``--out`` picks another
folder); ``--help`` on each lists its options and their defaults.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from types import ModuleType

import torch

from llmsys.bench_harness import arguments, results

# subcommand -> module with HELP, add_arguments(parser) and run(args) -> list[results.Row], or
# None on a process that writes nothing (train's torchrun ranks other than 0)
SUBCOMMANDS = {
    "e2e": "e2e",
    "memory": "memory",
    "profile": "kernel_profile",
    "attention": "attention_sweep",
    "precision": "precision",
    "llama": "llama",
    "serve": "serve",
    "train": "train",
    "report": "infra.report",
}


def subcommand(name: str) -> ModuleType:
    """The module that implements subcommand ``name``."""
    return importlib.import_module(f"{__package__}.{SUBCOMMANDS[name]}")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written, and each option's default as ``(default: ...)``, unless its help
    says it already or there is none to show (None, or off for a flag)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        # BooleanOptionalAction appends its own "(default: %(default)s)" on some Pythons.
        help = (action.help or "").replace(" (default: %(default)s)", "")
        default = action.default
        nothing = default is None or default is False or default is argparse.SUPPRESS
        if "default" in help or not action.option_strings or nothing:
            return help
        shown = " ".join(map(str, default)) if isinstance(default, list) else str(default)
        return f"{help} (default: {shown.replace('%', '%%')})"


def _plain(text: str | None) -> str | None:
    """A docstring for a terminal: ``code`` printed as `code`."""
    return text.replace("``", "`") if text else text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmsys-bench",
        description=_plain(__doc__.splitlines()[0]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_plain("\n".join(__doc__.splitlines()[2:])),
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
    for name in SUBCOMMANDS:
        module = subcommand(name)
        sub = commands.add_parser(
            name,
            help=module.HELP,
            description=_plain(module.__doc__),
            formatter_class=_HelpFormatter,
        )
        if name != "report":
            sub.add_argument(
                "--device",
                type=arguments.device,
                default="cuda" if torch.cuda.is_available() else "cpu",
                help="cpu, cuda or cuda:N (default: cuda if there is a GPU, else cpu)",
            )
            sub.add_argument(
                "--out",
                type=Path,
                default=Path("llmsys-bench-results"),
                help=f"folder for {name}.csv (each run overwrites it) and any plots or traces",
            )
        module.add_arguments(sub)
    return parser


def emit(rows: list[results.Row], out: Path, name: str, replaced: bool | None = None) -> Path:
    """Print ``rows`` as a Markdown table and write them to ``out/<name>.csv``, saying when that
    replaces an earlier run's file (``replaced``: whether it was there before the run began,
    for a run that writes the file as it goes; default: whether it is there now)."""
    print(results.markdown_table(rows))
    path = Path(out) / f"{name}.csv"
    if replaced is None:
        replaced = path.exists()
    results.write_csv(rows, path)
    note = " (replacing the previous run's; --out DIR keeps runs apart)" if replaced else ""
    print(f"\nwrote {path}{note}")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "int8", False) and set(getattr(args, "mode", ["forward"])) != {"forward"}:
        parser.error("--int8: int8 linears are inference-only; add --mode forward")
    module = subcommand(args.command)
    # llama and serve write their CSV after every case: look for an earlier run's before this one
    earlier = args.command != "report" and (Path(args.out) / f"{args.command}.csv").exists()
    rows = module.run(args)
    if args.command != "report" and rows is not None:
        emit(rows, args.out, args.command, replaced=earlier)
    return 0


if __name__ == "__main__":
    sys.exit(main())
