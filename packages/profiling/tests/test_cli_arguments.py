"""Issue 49: every option of ``llmsys-bench`` and ``llmsys-roofline`` is checked by argparse, so a
bad value (a count of 0 or -1, a device that is not there, a name not among the choices) stops
the parse with an error that names the option, before anything runs."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from llmsys.bench_harness import arguments
from llmsys.profiling import cli, roofline_cli

# The bad values each shared argparse type must refuse.
BAD = {
    arguments.positive_int: ["0", "-1", "x"],
    arguments.non_negative_int: ["-1", "1.5"],
    arguments.positive_float: ["0", "-1", "nan", "inf"],
    arguments.non_negative_float: ["-1", "nan"],
    arguments.batch_by_tokens: ["0x8", "8"],
    arguments.device: ["bogus", "meta", "cuda:99"],
}
FREE_TEXT = {("report", "--title")} | {  # any text: a title, or a GPU name looked up later
    (name, "--gpu")
    for name in (
        "hardware",
        "matmul",
        "linear",
        "elementwise",
        "attention",
        "h2d",
        "collective",
        "hiding",
    )
}  # any name: no type to check


def options(prog: str, parser: argparse.ArgumentParser):
    """(subcommand, parser, action, required values before it) for every option that takes a
    value, in every subcommand."""
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, sub in commands.choices.items():
        positionals = [a for a in sub._actions if not a.option_strings]
        before = [a.choices[0] if a.choices else "x.csv" for a in positionals]
        for action in sub._actions:
            if action.option_strings and action.nargs != 0:
                yield pytest.param(
                    prog, name, sub, action, before, id=f"{prog}-{name}-{action.dest}"
                )


CASES = [
    *options("llmsys-bench", cli.build_parser()),
    *options("roofline", roofline_cli.build_parser()),
]


@pytest.mark.parametrize(("prog", "name", "sub", "action", "before"), CASES)
def test_every_option_refuses_a_bad_value_naming_it(prog, name, sub, action, before, capsys):
    option = "/".join(action.option_strings)
    if action.choices is not None:
        bad = ["not-a-choice"]
    elif action.type in BAD:
        bad = BAD[action.type]
    else:
        free = action.type is Path or (name, option) in FREE_TEXT
        assert free, f"{name} {option}: type {action.type} is not one of the shared checks"
        return
    count = action.nargs if isinstance(action.nargs, int) else 1
    for value in bad:
        with pytest.raises(SystemExit) as exit_:
            sub.parse_args([*before, action.option_strings[0], *[value] * count])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {option}:" in err and value in err, (value, err)


@pytest.mark.parametrize("command", ["e2e", "serve", "llama", "train", "report", "attention"])
def test_the_device_is_checked_when_the_command_line_is_read(command, capsys):
    """``--device meta`` raised a RuntimeError once the run had started; now argparse stops it."""
    argv = [command, "--device", "meta"] + (["x.csv"] if command == "report" else [])
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    err = capsys.readouterr().err
    if command == "report":  # report runs on no device
        assert "unrecognized arguments: --device" in err
    else:
        assert exit_.value.code == 2
        assert "argument --device: must be cpu, cuda or cuda:N, got 'meta'" in err


@pytest.mark.parametrize(
    ("text", "ok"),
    [("cpu", True), ("cuda", None), ("cuda:0", None), ("meta", False), ("bogus", False),
     ("mps", False), ("cuda:-1", False), ("", False)],
)  # fmt: skip
def test_the_device_type(text, ok):
    import torch

    if ok is None:  # a GPU only where there is one
        ok = torch.cuda.is_available()
    if ok:
        assert arguments.device(text) == text
    else:
        with pytest.raises(argparse.ArgumentTypeError, match=repr(text)):
            arguments.device(text)
