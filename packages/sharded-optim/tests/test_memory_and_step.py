"""memory_and_step.py picks its model by device (the XL model on CUDA, the tiny one on the CPU)
and says what it is doing while it runs."""

import importlib.util
import socket
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "memory_and_step.py"


def _script():
    spec = importlib.util.spec_from_file_location("sharded_optim_memory_and_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_model_defaults_by_device_and_given_values_are_kept():
    script = _script()
    cpu = script.fill_device_defaults(script.parse_args([]), on_cuda=False)
    assert (cpu.size, cpu.context_length) == ("tiny", 64)
    cuda = script.fill_device_defaults(script.parse_args([]), on_cuda=True)
    assert (cuda.size, cuda.context_length) == ("xl", 512)
    given = script.parse_args(["--size", "small", "--context-length", "32"])
    assert (script.fill_device_defaults(given, on_cuda=False).size, given.context_length) == (
        "small",
        32,
    )


def test_a_cpu_run_with_no_size_builds_the_tiny_model_and_prints_progress(
    monkeypatch, tmp_path, capsys
):
    script = _script()
    monkeypatch.setattr(script.torch.cuda, "is_available", lambda: False)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    script.main(["--variants", "adamw", "--steps", "1", "--warmup", "1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "adamw: building the tiny model (context 64) on cpu" in out
    assert "adamw: 1 warm-up step(s)" in out and "adamw: timing 1 step(s)" in out
    assert (tmp_path / "cpu.csv").exists()


@pytest.mark.parametrize(
    ("option", "bad"), [("--steps", "0"), ("--warmup", "-1"), ("--context-length", "0")]
)
def test_a_bad_count_is_refused_naming_the_option(option, bad, capsys):
    """Issue 49: argparse's error names the option, before any process group is made."""
    with pytest.raises(SystemExit) as exit_:
        _script().parse_args([option, bad])
    assert exit_.value.code == 2
    assert f"argument {option}: " in capsys.readouterr().err
