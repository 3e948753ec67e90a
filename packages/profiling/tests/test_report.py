"""`llmsys-bench report` and the main job's profiling sweep (commands, report tables, plot)."""

import importlib.util
from pathlib import Path

import pytest

from llmsys.bench_harness import results
from llmsys.profiling import cli

SWEEP = Path(__file__).resolve().parents[1] / "benchmarks" / "sweep.py"


def load_sweep():
    spec = importlib.util.spec_from_file_location("profiling_sweep", SWEEP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(kernel, provider, mode="train-step", **fields):
    values = dict(x="tiny ctx=16 batch=2", dtype="bf16", p20=1.0, p50=2.0, p80=3.0) | fields
    return results.Row(kernel, provider, mode, **values)


def test_report_composes_every_csv_with_its_plot(tmp_path):
    first = results.write_csv(
        [row("transformer_lm", "eager", gpu="NVIDIA H100")], tmp_path / "a.csv"
    )
    results.write_csv([row("attention", "flash"), row("attention", "sdpa")], tmp_path / "b.csv")
    first.with_suffix(".png").write_bytes(b"png")
    out = tmp_path / "report" / "REPORT.md"
    assert cli.main(["report", str(tmp_path), "--out", str(out), "--title", "T"]) == 0
    text = out.read_text()
    assert text.startswith("# T\n") and "## a\n" in text and "## b\n" in text
    assert "(1 rows, NVIDIA H100)" in text and "![a](../a.png)" in text
    assert text.count("| attention |") == 2 and "| transformer_lm |" in text


def test_report_refuses_what_is_not_a_csv(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(SystemExit, match=r"neither a folder nor an existing \.csv"):
        cli.main(["report", str(tmp_path / "notes.txt")])
    with pytest.raises(SystemExit, match="no CSV files"):
        cli.main(["report", str(tmp_path)])


def test_sweep_commands_parse_and_cover_every_subcommand():
    sweep = load_sweep()
    parser = cli.build_parser()
    every = set(cli.SUBCOMMANDS) - {"report"}
    for device, quick, full, covered in [
        ("cpu", True, False, every),  # CI: each subcommand once, tiny
        ("cuda", False, False, {"e2e", "precision"}),  # the main job's default: the target case
        ("cuda", False, True, every),  # --full
    ]:
        commands = sweep.commands(device, quick, full)
        for argv in commands:
            parser.parse_args([*argv, "--device", "cpu"])  # every line is a valid command
        assert {argv[0] for argv in commands} == covered
    default = sweep.commands("cuda", False, False)
    assert default[0][:3] == ["e2e", "--size", "medium"] and "llmsys" in default[0]  # the target
    full = sweep.commands("cuda", False, True)
    assert full[0][:2] == ["e2e", "--size"] and "--warmup" in full[0]  # warm-up while cold
    assert full[1] == default[0]


def test_sweep_report_has_a_table_per_benchmark_and_a_plot(tmp_path):
    sweep = load_sweep()
    rows = [
        row("transformer_lm", "eager", throughput=100.0, roofline_fraction=0.1),
        row("transformer_lm", "llmsys", throughput=300.0, roofline_fraction=0.3),
        row("transformer_lm/forward", "eager"),
        row("transformer_lm/memory", "sdpa+eager", memory_gib=1.5),
        row("step", "wall", mode="profile"),
        row("aten::mm", "forward", mode="profile"),
        row("attention", "flash", mode="forward"),
        row("autocast", "bf16", mode="logits"),
    ]
    text = sweep.report_markdown(rows)
    assert text.count("### ") == 5
    assert "7 of 8 rows; the per-kernel profile rows are in the CSV." in text
    assert "aten::mm" not in text
    assert sweep.plot(rows, tmp_path / "p.png").stat().st_size > 0


def test_a_row_without_a_time_reads_back_and_shows_an_empty_cell(tmp_path):
    # A case that could not run (an unsupported backend) has no p50; written by pandas it is an
    # empty cell, which reads back as None.
    path = tmp_path / "rows.csv"
    fields = list(results.Row.__dataclass_fields__)
    values = ["attention", "sdpa_flash", "fwd", "1x1x128x16", "float32", "", "", "", "ms"]
    values += [""] * (len(fields) - len(values))
    path.write_text(",".join(fields) + "\n" + ",".join(values) + "\n")
    (skipped,) = results.read_rows(path)
    assert skipped.p50 is None
    table = results.markdown_table([skipped, row("attention", "ours", mode="fwd")])
    assert "| attention | fwd | float32 | 1x1x128x16 | sdpa_flash |  |" in table
    assert "2 ms" in table


def test_each_run_says_when_it_overwrites_the_previous_csv(tmp_path, capsys):
    rows = [row("transformer_lm", "eager")]
    path = cli.emit(rows, tmp_path, "e2e")
    assert path == tmp_path / "e2e.csv" and "replacing" not in capsys.readouterr().out
    cli.emit(rows + rows, tmp_path, "e2e")
    assert f"wrote {path} (replacing the previous run's" in capsys.readouterr().out
    assert len(results.read_rows(path)) == 2
