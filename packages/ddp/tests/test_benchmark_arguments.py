"""Issue 49: the ddp benchmarks refuse a bad count or size with argparse's error naming the
option, before any process group or model is made."""

from pathlib import Path

import pytest

from llmsys.bench_harness import load_beside

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
CASES = [
    ("all_reduce", ["--out", "x.csv"], "--rounds", "0"),
    ("all_reduce", ["--out", "x.csv"], "--sizes-mb", "-1"),
    ("fsdp", ["--out", "x.csv"], "--steps", "0"),
    ("fsdp", ["--out", "x.csv"], "--size", "huge"),
    ("host_profile", ["--out", "x"], "--batch-size", "-2"),
    ("strategies", ["--out", "x.csv"], "--warmup", "-1"),
    ("strategies", ["--out", "x.csv"], "--context-length", "0"),
    ("timeline", ["--out", "x"], "--steps", "0"),
]


@pytest.mark.parametrize(("script", "argv", "option", "bad"), CASES)
def test_a_bad_value_is_refused_naming_the_option(script, argv, option, bad, capsys):
    main = load_beside(BENCHMARKS / f"{script}.py", script).main
    with pytest.raises(SystemExit) as exit_:
        main([*argv, option, bad])
    assert exit_.value.code == 2
    assert f"argument {option}: " in capsys.readouterr().err
