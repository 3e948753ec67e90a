"""The sweep script ends cleanly where matplotlib is not installed (a sharded-optim-only venv):
the CSV, the rows as a table, and one line saying why there is no plot."""

import importlib.util
import sys
from pathlib import Path

import torch

import llmsys.bench_harness as harness

SWEEP = Path(__file__).resolve().parents[1] / "benchmarks" / "sweep.py"


def _sweep_module():
    spec = importlib.util.spec_from_file_location("sharded_optim_sweep", SWEEP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sweep_without_matplotlib_writes_the_csv_prints_the_table_and_says_why_no_plot(
    monkeypatch, tmp_path, capsys
):
    sweep = _sweep_module()
    row = harness.row("zero1/step", "sharded", "train", "tiny", torch.float32, (1.0, 2.0, 3.0))
    monkeypatch.setattr(sweep, "run", lambda device, quick=False, progress=None: [row])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ModuleNotFoundError
    monkeypatch.setattr(sys, "argv", ["sweep.py", "--device", "cpu", "--out", str(tmp_path)])
    sweep.main()
    out = capsys.readouterr().out
    assert "no plot: matplotlib is not installed" in out
    assert "zero1/step" in out  # the table
    assert (tmp_path / "cpu.csv").exists() and not (tmp_path / "cpu.png").exists()
    assert f"wrote {tmp_path / 'cpu.csv'}" in out
