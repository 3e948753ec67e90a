"""tools/gpu.py's baseline gate: pytest-benchmark's own --benchmark-compare and
--benchmark-compare-fail, on a tiny benchmark against doctored copies of its own run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import gpu

BENCHMARK = "def test_sum(benchmark):\n    benchmark(sum, range(1000))\n"
FAST = ["--benchmark-max-time=0.01", "--benchmark-warmup=off"]  # and no hypothesis plugin: 3 s


def run(tmp_path: Path, baseline: Path | None, name: str) -> subprocess.CompletedProcess:
    command = gpu.benchmark_command(tmp_path / "benchmarks", tmp_path / name, baseline, 0.10)
    return subprocess.run(
        [sys.executable, "-m", "pytest", *command, "-p", "no:hypothesispytest", *FAST],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        # not a worker of the calling run's pytest-xdist, if any (pytest-benchmark then skips)
        env={k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")},
    )


def doctored(run_json: Path, factor: float, path: Path) -> Path:
    """``run_json`` with every median multiplied by ``factor``."""
    data = json.loads(run_json.read_text())
    for bench in data["benchmarks"]:
        bench["stats"]["median"] *= factor
    path.write_text(json.dumps(data))
    return path


def test_a_median_over_10_percent_slower_than_its_baseline_fails(tmp_path):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "test_b.py").write_text(BENCHMARK)
    first = run(tmp_path, None, "first.json")
    assert first.returncode == 0, first.stdout + first.stderr
    recorded = tmp_path / "first.json"
    # Baselines 5x off either way: a loaded CI machine moves a 10 us median by 2x between runs.
    faster_baseline = doctored(recorded, 0.2, tmp_path / "fast.json")
    slower_baseline = doctored(recorded, 5.0, tmp_path / "slow.json")

    regressed = run(tmp_path, faster_baseline, "second.json")
    assert regressed.returncode != 0
    assert "Performance has regressed" in regressed.stdout + regressed.stderr
    improved = run(tmp_path, slower_baseline, "third.json")
    assert improved.returncode == 0, improved.stdout + improved.stderr
