"""The README's torchrun example, as a user runs it: 2 CPU ranks, then one plain process."""

import os
import re
import subprocess
import sys
from pathlib import Path

from llmsys_dev.ranks import free_port

EXAMPLE = Path(__file__).parents[1] / "examples" / "smallest.py"


def run(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=os.environ)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_torchrun_two_cpu_ranks_train_and_stay_identical():
    out = run(
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(free_port()), str(EXAMPLE),
    )  # fmt: skip
    losses = {
        int(step): float(loss) for step, loss in re.findall(r"step +(\d+) loss ([\d.]+)", out)
    }
    assert losses[59] < losses[0] / 10, out
    assert "rank 1: done" in out and "rank 0: done" in out


def test_plain_python_is_one_rank():
    out = run(sys.executable, str(EXAMPLE))
    assert "rank 0/1 step 59" in out and "rank 0: done" in out


def test_fsdp_example_trains_the_tiny_model_on_two_cpu_ranks():
    out = run(
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(free_port()), str(EXAMPLE.with_name("fsdp_small.py")),
        "--size", "tiny", "--steps", "40",
    )  # fmt: skip
    losses = [float(loss) for loss in re.findall(r"loss ([\d.]+)", out)]
    assert losses[-1] < 0.75 * losses[0], out  # about 9.2 -> 5.0 on a 2-core CPU
    assert "rank 1: done" in out and "rank 0: done" in out


def test_fsdp_benchmark_runs_every_strategy_on_two_cpu_ranks(tmp_path):
    from llmsys.bench_harness import results

    out = tmp_path / "rows.csv"
    run(
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(free_port()), str(EXAMPLE.parents[1] / "benchmarks" / "fsdp.py"),
        "--size", "tiny", "--context-length", "16", "--batch-size", "2", "--steps", "1",
        "--warmup", "1", "--rounds", "1", "--checkpointing", "on", "--out", str(out),
    )  # fmt: skip
    rows = results.read_rows(out)
    assert [r.provider for r in rows] == [
        "one process alone", "DDPBucketed", "ShardedOptimizer + DDPBucketed", "FSDP", "FSDP bf16",
        "torch FSDP2", "torch FSDP2 bf16", "FSDP bf16, 2 blocks per gather",
        "torch FSDP2 bf16, 2 blocks per gather",
    ]  # fmt: skip
    assert all(r.p50 > 0 and "predicted peak" in r.config for r in rows)
