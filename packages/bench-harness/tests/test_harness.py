"""The shared benchmark harness: CSV schema, device names, CPU timing."""

import argparse

import pytest
import torch

import llmsys.bench_harness as harness


def test_csv_round_trip_keeps_the_schema(tmp_path):
    row = harness.Row(
        kernel="swiglu",
        provider="ours",
        mode="fwd",
        x="7x3x5",
        dtype="float32",
        p20=1.0,
        p50=2.0,
        p80=3.0,
        throughput=1.5,
        throughput_unit="TB/s",
    )
    path = harness.write_csv([row, row], tmp_path / "r" / "cpu.csv")
    rows = harness.read_csv(path)
    assert list(rows[0]) == harness.CSV_FIELDS
    assert len(rows) == 2 and rows[0]["p50"] == "2.0" and rows[0]["provider"] == "ours"


def test_device_slug_for_cpu():
    assert harness.device_slug("cpu") == "cpu"


def test_cpu_timer_orders_quantiles():
    x = torch.randn(256, 256)
    p20, p50, p80 = harness.time_ms(lambda: x @ x, device="cpu", rep_ms=20)
    assert 0 < p20 <= p50 <= p80


def test_side_by_side_timer_takes_turns_in_alternating_order():
    calls = []
    times = harness.time_ms_side_by_side(
        [lambda: calls.append("a"), lambda: calls.append("b")], rep_ms=0, device="cpu"
    )
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-up, then 3 rounds
    assert len(times) == 2 and all(0 <= p20 <= p50 <= p80 for p20, p50, p80 in times)
    with pytest.raises(ValueError, match="fns must hold at least one callable, got none"):
        harness.time_ms_side_by_side([], device="cpu")
    with pytest.raises(ValueError, match="flush_by must be 'write' or 'read', got 'clean'"):
        harness.time_ms_side_by_side([lambda: None], device="cpu", flush_by="clean")


@pytest.mark.gpu
def test_side_by_side_timer_times_each_fn_alone_on_the_gpu():
    small, large = torch.randn(2**10, device="cuda"), torch.randn(2**26, device="cuda")
    (_, fast, _), (_, slow, _) = harness.time_ms_side_by_side(
        [lambda: small.mul_(1.0), lambda: large.mul_(1.0)], rep_ms=20, flush_bytes=2**24
    )
    assert 0 < fast < slow  # 4 KiB against 256 MiB read and written


def test_call_times_ms_times_each_call_after_the_warmup():
    calls = []
    times = harness.call_times_ms(lambda: calls.append(1), reps=5, warmup=2, device="cpu")
    assert len(calls) == 7 and len(times) == 5 and all(t >= 0 for t in times)


@pytest.mark.parametrize("helper", ["call_times_ms", "cuda_graph"])
def test_timing_helpers_name_a_bad_argument(helper):
    count = {"call_times_ms": "reps", "cuda_graph": "calls"}[helper]
    call = getattr(harness, helper)
    with pytest.raises(TypeError, match="fn must be callable, got int"):
        call(3, **{count: 1})
    with pytest.raises(ValueError, match=f"{count} must be an int >= 1, got 0"):
        call(lambda: None, **{count: 0})
    with pytest.raises(ValueError, match="warmup must be an int >= 0, got -1"):
        call(lambda: None, **{count: 1}, warmup=-1)
    with pytest.raises(ValueError, match="warmup must be an int >= 0, got True"):
        call(lambda: None, **{count: 1}, warmup=True)


def test_cuda_graph_without_cuda_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="cuda_graph needs a CUDA device"):
        harness.cuda_graph(lambda: None)


@pytest.mark.gpu
def test_cuda_graph_replays_the_captured_calls_on_the_current_inputs():
    x = torch.randn(1000, device="cuda")
    total = torch.zeros_like(x)
    replay = harness.cuda_graph(lambda: total.add_(x), calls=3, warmup=2)
    torch.cuda.synchronize()
    torch.testing.assert_close(total, 2 * x)  # the warm-up calls ran, the capture did not
    x.copy_(torch.randn_like(x))  # a replay reads the captured addresses: the new values
    expected = total + 3 * x
    replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(total, expected)


def test_flush_by_is_write_or_read():
    with pytest.raises(ValueError, match="flush_by must be 'write' or 'read', got 'clean'"):
        harness.time_ms(lambda: None, device="cpu", flush_by="clean")


def test_report_table_says_how_many_rows_only_the_csv_has():
    rows = [
        harness.Row("k", provider, "fwd", "8", "float32", p20=1.0, p50=1.0, p80=1.0)
        for provider in ("eager", "ours", "liger")
    ]
    full = harness.table_section(rows, rows, "k.csv")
    assert full.count("\n| k |") == 3 and "rows; all of them" not in full
    short = harness.table_section(rows, rows[:1], "k.csv")
    assert short.count("\n| k |") == 1
    assert short.endswith("1 of 3 rows; all of them are in `k.csv`.")


def test_row_derives_throughput_fraction_and_speedup():
    row = harness.row(
        "k", "ours", "fwd", "8", torch.bfloat16, (1.0, 2.0, 4.0),
        work=4e9, throughput_unit="TB/s", floor_s=1e-3, baseline=3.0, version="1.0",
    )  # fmt: skip
    assert row.dtype == "bfloat16" and (row.p20, row.p50, row.p80) == (1.0, 2.0, 4.0)
    assert row.throughput == 4e9 / 2e-3 / 1e12  # 2 TB/s
    assert row.roofline_fraction == 0.5 and row.speedup_vs_baseline == 1.5
    assert row.unit == "ms" and row.version == "1.0"


def test_row_in_microseconds_without_work_leaves_rates_empty():
    row = harness.row("k", "ours", "host", "8", "float32", (5.0, 5.0, 5.0), unit="us", baseline=10)
    assert row.unit == "us" and row.speedup_vs_baseline == 2.0
    assert row.throughput is None and row.roofline_fraction is None


def test_sweep_main_writes_the_csv_and_plot_then_replots_from_the_csv(tmp_path, capsys):
    rows = [harness.row("k", "ours", "fwd", "8", "float32", (1.0, 2.0, 3.0))]
    plotted = []

    def plot(rows, path):
        plotted.append(len(rows))
        return path

    parser = harness.sweep_arguments("test", tmp_path, quick_help="")
    args = parser.parse_args(["--device", "cpu", "--out", str(tmp_path)])
    assert harness.sweep_main(args, plot, lambda progress: rows, desc="test") == rows
    assert harness.read_rows(tmp_path / "cpu.csv") == rows and plotted == [1]
    printed = capsys.readouterr().out
    assert "wrote" in printed and "| k | fwd | float32 | 8 | ours | 2 ms |" in printed
    args = parser.parse_args(["--replot", str(tmp_path / "cpu.csv")])
    assert harness.sweep_main(args, plot, lambda progress: [], desc="test") == []
    assert plotted == [1, 1]


def test_sweep_command_parses_the_shared_command_line_then_runs_the_sweep(tmp_path):
    rows = [harness.row("k", "ours", "fwd", "8", "float32", (1.0, 2.0, 3.0))]
    calls = []

    def run(device, *, quick, progress):
        calls.append((device, quick))
        progress()
        return rows

    argv = ["--device", "cpu", "--quick", "--out", str(tmp_path)]
    out = harness.sweep_command(
        argv, "A sweep.\n\nMore.", tmp_path, run, lambda rows, path: path, quick_help="", desc="t"
    )
    assert out == rows and calls == [("cpu", True)]
    assert harness.read_rows(tmp_path / "cpu.csv") == rows


def test_sweep_main_without_matplotlib_writes_the_csv_and_says_no_plot(tmp_path, capsys):
    rows = [harness.row("k", "ours", "fwd", "8", "float32", (1.0, 2.0, 3.0))]

    def plot(rows, path):
        raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")

    args = harness.sweep_arguments("t", tmp_path, "").parse_args(["--device", "cpu"])
    args.out = tmp_path
    assert harness.sweep_main(args, plot, lambda progress: rows, desc="t") == rows
    assert "no plot: matplotlib is not installed" in capsys.readouterr().out
    assert harness.read_rows(tmp_path / "cpu.csv") == rows


def test_plain_progress_prints_a_line_per_step(capsys):
    with harness.harness._PlainProgress(desc="sweep", total=2) as bar:
        bar.update()
        bar.set_postfix_str("case b")
    assert capsys.readouterr().out.splitlines() == ["sweep: 1/2", "sweep: 1/2 case b"]


def test_markdown_table_prints_the_quantile_range_without_scientific_notation():
    import dataclasses

    base = harness.row("e2e/step", "sdpa+eager", "train", "tiny", torch.float32, (700, 732, 760))
    cases = [((700, 732, 760), "732 ms (p20-p80 700-760)"),
             ((1.25, 1.3, 1.5), "1.3 ms (p20-p80 1.25-1.5)"),
             ((0.00001234, 0.0123, 0.5), "0.0123 ms (p20-p80 0.00001234-0.5)"),
             ((12000.0, 12345.0, 13000.0), "12345 ms (p20-p80 12000-13000)")]  # fmt: skip
    for (p20, p50, p80), shown in cases:
        row = dataclasses.replace(base, p20=p20, p50=p50, p80=p80, std=1e9)  # std is not shown
        table = harness.markdown_table([row])
        assert shown in table, table
        assert "±" not in table
        assert "e+" not in table and "e-" not in table
    assert "p20-p80" not in harness.markdown_table([base])  # no spread reported, no range


def test_markdown_table_shows_small_memory_in_mib_and_large_in_gib():
    import dataclasses

    base = harness.row("e2e/step", "sdpa+eager", "train", "tiny", torch.float32, (1, 2, 3))
    small = [dataclasses.replace(base, memory_gib=gib) for gib in (0.0309, 0.05, None)]
    table = harness.markdown_table(small)
    assert "| memory MiB |" in table and "| 31.6 |" in table and "| 51.2 |" in table
    table = harness.markdown_table([*small, dataclasses.replace(base, memory_gib=1.5)])
    assert "| memory GiB |" in table and "| 0.03 |" in table and "| 1.50 |" in table


def test_a_table_without_times_shows_its_values_in_full_and_its_config_by_name():
    nan = float("nan")
    sums = [
        harness.Row("accumulate", way, "sum", "1000 x 0.01", "float32", nan, nan, nan, unit="",
                    throughput=total, throughput_unit="value", config=f"abs_error={error}")
        for way, total, error in [("fp32", 10.000133514404297, 0.000133514),
                                  ("fp16", 10.00213623046875, 0.00213623)]
    ]  # fmt: skip
    table = harness.markdown_table(sums)
    assert table.splitlines()[0] == "| kernel | mode | dtype | case | provider | value | config |"
    assert "| fp32 | 10.00013 | abs_error=0.000133514 |" in table
    assert "| fp16 | 10.00214 | abs_error=0.00213623 |" in table


@pytest.mark.parametrize("device", ["bogus", "meta", "cuda:99", "mps"])
def test_sweep_arguments_refuse_a_device_this_machine_cannot_run_on(device, tmp_path, capsys):
    """Issue 49: a bad --device is argparse's error naming the option, before any case runs."""
    parser = harness.sweep_arguments("t", tmp_path, "")
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--device", device])
    assert exit_.value.code == 2
    assert "argument --device: " in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kind", "good", "bad"),
    [("positive_int", ["1", "12"], ["0", "-1", "1.5", "x"]),
     ("non_negative_int", ["0", "3"], ["-1", "x"]),
     ("positive_float", ["0.5", "1e3"], ["0", "-1", "nan", "inf"]),
     ("non_negative_float", ["0", "2.5"], ["-0.1", "nan", "inf"]),
     ("batch_by_tokens", ["8x512", "1X1"], ["8", "0x4", "ax2", "2x3x4"])],
)  # fmt: skip
def test_the_shared_argparse_types_name_the_option_in_their_error(kind, good, bad, capsys):
    parser = argparse.ArgumentParser()
    parser.add_argument("--value", type=getattr(harness.arguments, kind))
    for text in good:
        assert parser.parse_args(["--value", text]).value is not None
    for text in bad:
        with pytest.raises(SystemExit):
            parser.parse_args(["--value", text])
        assert "argument --value: " in capsys.readouterr().err


def test_plot_vs_baseline_leaves_a_gap_where_a_row_has_no_baseline(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [
        harness.row("k", "ours", "fwd", "8", "float32", (1.0, 2.0, 3.0), baseline=4.0),
        harness.row("k", "ours", "fwd", "16", "float32", (1.0, 2.0, 3.0)),  # baseline failed
    ]
    assert rows[1].speedup_vs_baseline is None
    path = harness.plot_vs_baseline(
        rows, tmp_path / "plot.png", title="t", panel=lambda r: (r.kernel, r.mode)
    )
    assert path.stat().st_size > 0
