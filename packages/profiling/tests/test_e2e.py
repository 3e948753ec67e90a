"""`llmsys-bench e2e` on the tiny model: its CSV, its OOM handling, its argument checks."""

import math

import pytest
import torch

from llmsys.bench_harness import results
from llmsys.profiling import cli, e2e, options, progress, training

TINY_ARGS = ["--device", "cpu", "--size", "tiny", "--context-length", "16", "--batch-size", "2"]


def test_e2e_writes_a_step_row_and_a_row_per_phase(tmp_path, capsys):
    argv = ["e2e", *TINY_ARGS, "--attention", "sdpa", "--steps", "2", "--warmup", "0", "1"]
    assert cli.main([*argv, "--mode", "forward", "train-step", "--out", str(tmp_path)]) == 0
    rows = results.read_rows(tmp_path / "e2e.csv")
    steps = [r for r in rows if r.kernel == "transformer_lm"]
    assert {(r.mode, r.config.split()[0]) for r in steps} == {
        (mode, f"warmup={w}") for mode in ("forward", "train-step") for w in (0, 1)
    }
    for row in steps:
        assert row.p50 > 0 and row.mean > 0 and row.std >= 0
        assert row.throughput == pytest.approx(2 * 16 / (row.p50 / 1e3))  # tokens/s, median step
        settings = row.config.split(";")[0]
        phases = [
            r
            for r in rows
            if r.kernel.startswith("transformer_lm/") and r.mode == row.mode
            and r.config == settings
        ]  # fmt: skip
        names = {r.kernel.split("/")[1] for r in phases}
        assert names == set(e2e.PHASES[row.mode])
        # the phases of a step add up to the step (same samples)
        assert sum(r.mean for r in phases) == pytest.approx(row.mean, rel=1e-9)
    assert "| transformer_lm | train-step |" in capsys.readouterr().out


def test_presets_pick_their_parts_and_compare_with_the_first(tmp_path):
    argv = ["e2e", *TINY_ARGS, "--preset", "eager", "compiled", "--steps", "1", "--warmup", "1"]
    cli.main([*argv, "--out", str(tmp_path)])
    steps = [r for r in results.read_rows(tmp_path / "e2e.csv") if r.kernel == "transformer_lm"]
    assert [r.provider for r in steps] == ["eager", "compiled"]
    assert steps[0].speedup_vs_baseline == 1.0
    assert steps[1].speedup_vs_baseline == pytest.approx(steps[0].p50 / steps[1].p50)
    assert "compile=True" in steps[1].config and "compile=False" in steps[0].config


def test_one_slow_step_moves_no_derived_number(tmp_path, monkeypatch, capsys):
    """Tokens/s and the speed-up come from the median step, as the time shown beside them; the
    spread shown is the p20-p80 range."""
    step_ms = {"eager": iter([10.0, 10.0, 500.0, 10.0, 10.0]), "compiled": iter([5.0] * 5)}

    def step(self):
        return {"forward": next(step_ms["compiled" if self.variant.compile else "eager"])}

    monkeypatch.setattr(e2e.Runner, "step", step)
    argv = ["e2e", *TINY_ARGS, "--preset", "eager", "compiled", "--mode", "forward"]
    cli.main([*argv, "--compile-mode", "default", "--steps", "5", "--warmup", "0",
              "--out", str(tmp_path)])  # fmt: skip
    steps = [r for r in results.read_rows(tmp_path / "e2e.csv") if r.kernel == "transformer_lm"]
    eager, compiled = steps
    assert eager.p50 == 10.0 and eager.mean == pytest.approx(108.0)
    assert eager.throughput == pytest.approx(2 * 16 / 10e-3)
    assert compiled.speedup_vs_baseline == pytest.approx(10.0 / 5.0)
    out = capsys.readouterr().out
    assert "| 10 ms (p20-p80 10-108) | 3,200 tok/s |" in out and "±" not in out


def test_out_of_memory_is_recorded_and_the_sweep_goes_on(tmp_path, oom_at_context_16):
    argv = ["e2e", *TINY_ARGS[:-4], "--context-length", "16", "8", "--batch-size", "2"]
    cli.main([*argv, "--steps", "1", "--warmup", "0", "--out", str(tmp_path)])
    rows = results.read_rows(tmp_path / "e2e.csv")
    oom = [r for r in rows if "ctx=16" in r.x]
    assert len(oom) == 1 and oom[0].config.startswith("OOM") and math.isnan(oom[0].p50)
    assert any("ctx=8" in r.x and r.p50 > 0 for r in rows)


def test_other_errors_are_not_swallowed(monkeypatch, tmp_path):
    def step(self):
        raise RuntimeError("shape mismatch somewhere")

    monkeypatch.setattr(e2e.Runner, "step", step)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        cli.main(["e2e", *TINY_ARGS, "--steps", "1", "--warmup", "0", "--out", str(tmp_path)])


def test_int8_is_refused_outside_inference_as_an_argument_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:  # before any model is built, one line
        cli.main(["e2e", *TINY_ARGS, "--int8", "--steps", "1", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "int8 linears are inference-only; add --mode forward" in capsys.readouterr().err


def test_every_subcommand_has_help(capsys):
    for name in [None, *cli.SUBCOMMANDS]:
        with pytest.raises(SystemExit) as exit_info:
            cli.main([name, "--help"] if name else ["--help"])
        assert exit_info.value.code == 0
        assert "usage: llmsys-bench" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["e2e", "memory", "profile"])
def test_model_subcommands_help_shows_defaults_and_explains_presets(name, capsys):
    with pytest.raises(SystemExit):
        cli.main([name, "--help"])
    raw = capsys.readouterr().out
    out = " ".join(raw.split())  # argparse wraps the options' help
    assert "--size" in out and "(default: small on cuda, tiny on cpu)" in out
    assert "sequences per step (default: 4)" in out
    assert "(default: None)" not in out and "['" not in out  # no Python reprs
    assert f"folder for {name}.csv (each run overwrites it)" in out
    presets = raw.split("presets (--preset")[1]  # the epilog explains each preset
    assert [line.split()[0] for line in presets.splitlines()[1:] if line[2:3] != " "] == [
        *options.PRESETS,
        "(none)",
    ]
    assert "the provider `sdpa+eager`" in out  # what runs with no preset


def test_sizes_and_contexts_default_by_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # --device cuda is checked
    parser = cli.build_parser()
    expected = {"cpu": (["tiny"], [128]), "cuda": (["small"], [1024])}
    for device, (sizes, contexts) in expected.items():
        args = parser.parse_args(["e2e", "--device", device])
        options.fill_device_defaults(args)
        assert (args.size, args.context_length) == (sizes, contexts)
    args = parser.parse_args(["memory", "--device", "cpu", "--size", "small"])
    options.fill_device_defaults(args)
    assert (args.size, args.context_length) == (["small"], [32, 64])  # given values are kept


def test_progress_names_a_case_when_it_starts(capsys):
    cases = progress.progress(["first case", "second case"], "e2e", lambda case: case.upper())
    assert next(cases) == "first case"
    assert "FIRST CASE" in capsys.readouterr().err  # before the case has run


@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        ("--steps", "0", "must be a positive integer, got '0'"),
        ("--batch-size", "-2", "must be a positive integer, got '-2'"),
        ("--warmup", "-1", "must be a non-negative integer, got '-1'"),
        ("--context-length", "0", "must be a positive integer, got '0'"),
    ],
)
def test_bad_numbers_are_refused_naming_the_option(tmp_path, capsys, option, value, expected):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["e2e", "--device", "cpu", "--size", "tiny", option, value])
    assert exit_info.value.code == 2
    assert f"argument {option}: {expected}" in capsys.readouterr().err


def test_a_baseline_that_ran_out_of_memory_gives_no_speedups(tmp_path, monkeypatch):
    real_step = e2e.Runner.step

    def step(self):
        if self.config.attention == "naive":  # the eager preset, the baseline
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return real_step(self)

    monkeypatch.setattr(e2e.Runner, "step", step)
    argv = ["e2e", *TINY_ARGS, "--preset", "eager", "compiled", "--steps", "1", "--warmup", "0"]
    cli.main([*argv, "--compile-mode", "default", "--out", str(tmp_path)])
    steps = [r for r in results.read_rows(tmp_path / "e2e.csv") if r.kernel == "transformer_lm"]
    assert steps[0].config.startswith("OOM") and steps[1].p50 > 0
    assert steps[1].speedup_vs_baseline is None


def test_out_of_memory_is_recognised_however_it_is_phrased():
    assert training.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory."))
    cublas = RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate`")
    assert training.is_out_of_memory(cublas)
    assert not training.is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_accounting_refuses_unknown_modes_and_precisions():
    from llmsys.profiling import ModelConfig
    from llmsys.profiling.infra import accounting

    with pytest.raises(ValueError, match="`mode` must be one of"):
        accounting.step_flops(ModelConfig.named("tiny"), 1, 8, "train")
    with pytest.raises(ValueError, match="`precision` must be one of"):
        accounting.peak_flops("NVIDIA H100 80GB HBM3", "fp16")
    with pytest.raises(ValueError, match="`dtype` must be 'bf16' or 'fp32'"):
        accounting.matmul_precision("fp16")


def test_peaks_tell_h100_variants_apart():
    from llmsys.profiling.infra.accounting import peak_flops

    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16")[0] == pytest.approx(989.4e12)
    assert peak_flops("NVIDIA H100 PCIe", "bf16")[0] == pytest.approx(756e12)
    assert peak_flops("NVIDIA H100 NVL", "bf16")[0] == pytest.approx(835e12)
    assert peak_flops("NVIDIA GeForce RTX 4090", "bf16")[0] is None


def test_fused_presets_run_every_part_on_an_llmsys_kernel_eager_and_compiled(capsys):
    args = cli.build_parser().parse_args(["e2e", "--preset", "fused", "fused-compiled"])
    fused, compiled = options.variants(args, "bf16")
    assert [fused.label, compiled.label] == ["fused", "fused-compiled+reduce-overhead"]
    assert not fused.compile and compiled.compile and compiled.cuda_graphs
    for variant in (fused, compiled):
        config = variant.config("xl", 1024)
        parts = (config.attention, config.ffn, config.norm, config.rope, config.loss)
        assert parts == ("flash", "swiglu", "fused", "fused", "fused")
    with pytest.raises(SystemExit):
        cli.main(["e2e", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "fused every part on an llmsys kernel, no torch.compile" in help_text
    assert "fused-compiled the same parts, torch.compile with CUDA graphs" in help_text
    assert "--norm {eager,fused}" in help_text and "--loss {eager,fused}" in help_text


def test_fused_loss_step_builds_no_logits(tmp_path, monkeypatch):
    """A step of the fused preset (SDPA and eager rotary here: the interpreter is slow) gets
    its loss from the model's hidden states: lm_head's forward never runs."""
    calls = []
    real_init = e2e.Runner.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.model.lm_head.register_forward_hook(lambda *_: calls.append("lm_head"))

    monkeypatch.setattr(e2e.Runner, "__init__", init)
    argv = ["e2e", *TINY_ARGS, "--preset", "fused", "--attention", "sdpa", "--rope", "eager"]
    assert cli.main([*argv, "--steps", "1", "--warmup", "0", "--out", str(tmp_path)]) == 0
    steps = [r for r in results.read_rows(tmp_path / "e2e.csv") if r.kernel == "transformer_lm"]
    assert [r.provider for r in steps] == ["sdpa+swiglu+fused-norm+fused-loss"]
    assert steps[0].p50 > 0 and calls == []
