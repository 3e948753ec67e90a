"""GPU tests, pytest-benchmark runs against the committed baselines, and the sweeps.

Runs with whatever python has torch and triton (a GPU host without network or nox):

    python tools/gpu.py                      # every package: tests, benchmarks + compare, sweep
    python tools/gpu.py --package kernels-swiglu --save-baselines --out /tmp/gpu

Baselines live in packages/<name>/benchmarks/baselines/<gpu>.json; a benchmark median more than
10% slower than its baseline fails the run (pytest-benchmark's own ``--benchmark-compare`` and
``--benchmark-compare-fail``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from llmsys_dev.envs import source_env
from llmsys_dev.workspace import ROOT, select


def step(cmd: list[str], **kwargs) -> bool:
    print("+", " ".join(map(str, cmd)), flush=True)
    return subprocess.run(list(map(str, cmd)), env=source_env(), **kwargs).returncode == 0


def benchmark_command(
    bench_dir: Path, json_out: Path, baseline: Path | None, threshold: float
) -> list[str]:
    """pytest arguments that run ``bench_dir``'s benchmarks into ``json_out`` and, given a
    ``baseline`` run, fail when a median is more than ``threshold`` slower than its own there."""
    command = [
        str(bench_dir), "-q", "-p", "no:cacheprovider", f"--benchmark-json={json_out}",
        "--benchmark-min-rounds=20",
    ]  # fmt: skip
    if baseline is not None:
        command += [
            f"--benchmark-compare={baseline}",
            f"--benchmark-compare-fail=median:{threshold * 100:g}%",
        ]
    return command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", action="append", help="only these packages (repeatable)")
    parser.add_argument("--affected-since", help="only packages changed since this git ref")
    parser.add_argument("--out", type=Path, default=ROOT / ".nox" / "gpu", help="JSON and logs")
    parser.add_argument("--save-baselines", action="store_true", help="record new baselines")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-sweep", action="store_true")
    parser.add_argument("--threshold", type=float, default=0.10)
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("gpu: no CUDA device here; nothing to run (use `nox -s tests` on CPU)")
        return 0
    probe = "from llmsys.bench_harness import device_slug; print(device_slug())"
    slug = subprocess.run(
        [sys.executable, "-c", probe], env=source_env(), check=True, capture_output=True, text=True
    ).stdout.strip()
    args.out.mkdir(parents=True, exist_ok=True)
    failures = []
    for package in select(args.package, args.affected_since):
        if not args.skip_tests and not step(
            [sys.executable, "-m", "pytest", package.path / "tests", "-q", "-p", "no:cacheprovider"]
        ):
            failures.append(f"{package.name}: tests")
        bench_dir = package.path / "benchmarks"
        if any(bench_dir.glob("test_*.py")):
            new = args.out / f"{package.name}-{slug}.json"
            baseline = bench_dir / "baselines" / f"{slug}.json"
            compare = None if args.save_baselines else baseline
            if compare and not baseline.exists():
                print(f"notice: no baseline at {baseline}; nothing to compare (record one first)")
                compare = None
            command = benchmark_command(bench_dir, new, compare, args.threshold)
            if not step([sys.executable, "-m", "pytest", *command]):
                failures.append(f"{package.name}: benchmarks failed or slower than {baseline.name}")
            elif args.save_baselines:
                baseline.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(new, baseline)
                print(f"saved baseline {baseline}")
        sweep = bench_dir / "sweep.py"
        if not args.skip_sweep and sweep.exists() and not step([sys.executable, sweep]):
            failures.append(f"{package.name}: sweep")
    print("\n".join(["gpu: FAILED", *failures]) if failures else "gpu: all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
