"""``llmsys-roofline``: every subcommand in-process, and ``check`` on the committed CSVs."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest

from llmsys.bench_harness import results
from llmsys.profiling.infra import hardware, roofline_check
from llmsys.profiling.roofline_cli import main

PACKAGES = Path(__file__).resolve().parents[2]
DDP_CSV = PACKAGES / "ddp" / "benchmarks" / "results" / "h200.csv"
PROFILING_CSV = PACKAGES / "profiling" / "benchmarks" / "results" / "h100.csv"
KERNEL_CSV = PACKAGES / "kernels-swiglu" / "benchmarks" / "results" / "h100.csv"
TOY = ["--bandwidth-tbs", "2.4", "--tflops", "800", "--min-kernel-us", "10"]


def run(argv, capsys) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def test_help_lists_the_questions(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for name in ("hardware", "matmul", "linear", "elementwise", "attention", "h2d",
                 "collective", "memory", "min-devices", "hiding", "check"):  # fmt: skip
        assert name in out
    with pytest.raises(SystemExit):
        main(["linear", "--help"])
    assert "--tokens" in capsys.readouterr().out


def test_worked_examples(capsys):
    out = run(["linear", "--tokens", "512", "--in", "4096", "--out", "8192", "512", "512", *TOY],
              capsys)  # fmt: skip
    assert "total: 62.95 us" in out and "launch" in out
    out = run(["linear", "--tokens", "512", "--in", "4096", "--out", "9216", *TOY], capsys)
    assert "| 48.32 | compute |" in out
    out = run(["elementwise", "--shape", "64", "8192", "8192", *TOY], capsys)
    assert "| 7158 | memory |" in out
    out = run(["elementwise", "--shape", "1000", "--inputs", "2", "--dtype", "fp32", *TOY], capsys)
    assert "| 1.2e+04 | 0.08333 |" in out


def test_other_subcommands(capsys):
    out = run(["hardware"], capsys)
    assert "| H100 | 3.35 | 989.4 |" in out and "datasheet" in out and "| B200 |" in out
    out = run(["matmul", "-m", "4096", "-n", "4096", "-k", "4096", "--gpu", "H200"], capsys)
    assert "| 138.9 | compute |" in out  # 2 * 4096**3 / 989.4e12 s
    out = run(["attention", "--heads", "32", "--q-len", "1", "--kv-len", "4096"], capsys)
    assert "decode" in out and "memory" in out
    assert "host-to-device" in run(["h2d", "--mb", "100"], capsys)
    out = run(["collective", "all-reduce", "--mb", "100", "--nodes", "2"], capsys)
    assert "| ring | 16 | 2 x 8 hierarchical |" in out and "| tree |" in out
    out = run(["memory", "--ffn", "16384", "53248", "126", "--policy", "fp32-adamw",
               "--devices", "1", "38"], capsys)  # fmt: skip
    assert "| 1 | 879.4 GB | 879.4 GB | 0 B | 1.759 TB | 3.518 TB |" in out
    assert "| 38 |" in out and "92.57 GB" in out
    out = run(["min-devices", "--ffn", "16384", "53248", "126", "--policy", "fp32-adamw",
               "--budget-gb", "95"], capsys)  # fmt: skip
    assert ": 38 devices, 92.57 GB per device" in out
    out = run(["min-devices", "--size", "small", "--strategy", "ddp", "--budget-gb", "0.1"],
              capsys)  # fmt: skip
    assert "no device count fits" in out
    assert "hides from" in run(["hiding", "--size", "xl"], capsys)


def test_bad_values_are_clear_errors(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["linear", "--tokens", "1", "--in", "1", "--out", "1", "--bandwidth-tbs", "-1",
              "--tflops", "1"])  # fmt: skip
    assert exit_.value.code == 2
    assert "--bandwidth-tbs: must be a finite number > 0, got -1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["matmul", "-m", "0", "-n", "1", "-k", "1"])
    assert "must be a positive int" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["hardware", "--tflops", "100"])
    assert "--bandwidth-tbs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["hardware", "--gpu", "RTX 4090"])
    assert "RTX 4090" in capsys.readouterr().err


def test_check_all_reduce_rows():
    checks = roofline_check.check(DDP_CSV)
    nccl = [c for c in checks if c.kernel == "all_reduce" and c.provider == "nccl"]
    gloo = [c for c in checks if c.kernel == "all_reduce" and c.provider == "gloo"]
    assert len(nccl) == 4 and len(gloo) == 9
    big = next(c for c in nccl if c.x == "1000 MB")
    assert big.predicted_ms == pytest.approx(2 * 5e-3 + 1e9 / 450e9 * 1e3)
    assert not big.flagged  # large NCCL all-reduces come within 2x of NVLink's rate
    assert all(c.flagged for c in gloo)  # gloo is CPU- and TCP-bound (see the README)


def test_check_end_to_end_rows(capsys):
    checks = [c for c in roofline_check.check(PROFILING_CSV) if c.kernel == "transformer_lm"]
    assert len(checks) == 9
    for c in checks:  # the ratio is 1 / MFU (of the p50, where the CSV's MFU uses the mean)
        assert 1 < c.ratio < 50
    out = run(["check", str(DDP_CSV), str(PROFILING_CSV)], capsys)
    assert "measured/predicted" in out and ">2x off" in out and "h100.csv" in out


def _examples(text: str) -> str:
    """The block of ``llmsys-roofline`` examples in ``text``, unindented."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "llmsys-roofline hardware" in line)
    end = next(i for i in range(start, len(lines)) if lines[i].strip() in ("", "```"))
    return textwrap.dedent("\n".join(lines[start:end]))


def test_the_readme_and_help_give_the_same_examples_and_each_runs_from_the_repo_root(
    capsys, monkeypatch
):
    with pytest.raises(SystemExit):
        main(["--help"])
    examples = _examples(capsys.readouterr().out)
    assert examples == _examples((PACKAGES / "profiling" / "README.md").read_text())
    assert "# H100 (the SXM part), H100 PCIe, H100 NVL" in examples  # the hardware rows' names
    monkeypatch.chdir(PACKAGES.parent)
    commands = [line.split("#")[0].split() for line in examples.replace("\\\n", " ").splitlines()]
    assert len(commands) == 9
    for argv in commands:
        assert argv[0] == "llmsys-roofline" and run(argv[1:], capsys).strip(), argv


def _kernel_row(unit: str, dtype: str, throughput: float, p50_ms: float) -> results.Row:
    return results.Row(kernel="k", provider="p", mode="fwd", x="n", dtype=dtype, p20=p50_ms,
                       p50=p50_ms, p80=p50_ms, throughput=throughput, throughput_unit=unit,
                       gpu="NVIDIA H100 80GB HBM3")  # fmt: skip


def test_kernel_rows_at_the_datasheet_roofline():
    h100 = hardware.lookup("h100")
    # 1.675 TB/s for 2 ms: 3.35e9 bytes, which the H100's 3.35 TB/s moves in 1 ms.
    (memory,) = roofline_check.check_rows([_kernel_row("TB/s", "bfloat16", 1.675, 2.0)])
    assert memory.predicted_ms == pytest.approx(1.0) and memory.ratio == pytest.approx(2.0)
    # 494.7 TFLOP/s in bf16 for 1 ms: half the bf16 peak, predicted 0.5 ms.
    (bf16,) = roofline_check.check_rows([_kernel_row("TFLOP/s", "bf16", 494.7, 1.0)])
    assert bf16.predicted_ms == pytest.approx(0.5)
    # float32 at the TF32 peak; int8 at the int8 peak.
    (fp32,) = roofline_check.check_rows([_kernel_row("TFLOP/s", "float32", 494.7, 1.0)])
    (int8,) = roofline_check.check_rows([_kernel_row("TOP/s", "int8", 1979.0, 1.0)])
    assert fp32.predicted_ms == pytest.approx(1.0) and int8.predicted_ms == pytest.approx(1.0)
    # Never under the minimum kernel time.
    (tiny,) = roofline_check.check_rows([_kernel_row("TB/s", "float32", 1.0, 0.001)])
    assert tiny.predicted_ms == pytest.approx(h100.min_kernel_time * 1e3)
    assert "minimum kernel time" in tiny.model


def test_rows_it_cannot_model_are_skipped():
    unknown_gpu = dataclasses.replace(_kernel_row("TB/s", "bf16", 1.0, 1.0), gpu="cpu")
    other_unit = _kernel_row("tokens/s", "bf16", 1.0, 1.0)
    unknown_dtype = _kernel_row("TFLOP/s", "float64", 1.0, 1.0)
    assert roofline_check.check_rows([unknown_gpu, other_unit, unknown_dtype]) == []


def test_ratio_spread_is_the_median_smallest_and_largest():
    checks = [
        roofline_check.Check("k", "ours", "fwd", str(t), 1.0, t, "m") for t in (3.0, 1.0, 2.0, 4.0)
    ]
    assert roofline_check.ratio_spread(checks) == (3.0, 1.0, 4.0)  # of an even count: the upper
    assert roofline_check.ratio_spread(checks[:3]) == (2.0, 1.0, 3.0)


def test_summary_has_a_line_per_kernel_mode_and_provider():
    checks = roofline_check.check(KERNEL_CSV)
    summary = roofline_check.summary_markdown(checks)
    groups = {(c.kernel, c.mode, c.provider) for c in checks}
    assert len(summary.splitlines()) == 2 + len(groups)
    assert "| swiglu | fwd | ours |" in summary


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bandwidth-tbs", "nan", "--tflops", "1"], "--bandwidth-tbs: must be a finite number"),
        (["--bandwidth-tbs", "1", "--tflops", "inf"], "--tflops: must be a finite number > 0"),
        (["--gpu", "H100", "--latency-us", "nan"], "--latency-us: must be a finite number >= 0"),
        (["--gpu", "H100", "--nvlink-gbs", "0"], "--nvlink-gbs: must be a finite number > 0"),
    ],
)
def test_non_finite_hardware_options_are_refused_by_name(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["linear", "--tokens", "1", "--in", "1", "--out", "1", *args])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["memory", "--context", "0"], "--context: must be a positive int"),
        (["memory", "--ffn", "8", "0", "2"], "--ffn: must be a positive int"),
        (["memory", "--tokens-per-device", "-3"], "--tokens-per-device: must be a non-negative"),
    ],
)
def test_model_options_are_checked(args, message, capsys):
    with pytest.raises(SystemExit):
        main(args)
    assert message in capsys.readouterr().err
