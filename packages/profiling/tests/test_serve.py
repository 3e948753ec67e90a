"""`llmsys-bench serve` on the CPU: a tiny Hugging Face Llama through prefill, decode and
generate, every provider a row (a time, or why it has none), speed-ups over fp16, and the plot."""

import math

import pytest
import torch
from torch import nn

from llmsys.bench_harness import results
from llmsys.profiling import cli, serve

pytest.importorskip(
    "transformers", reason="transformers is an optional extra: llmsys-profiling[transformers]"
)


def test_quick_run_gives_every_provider_a_row_per_case(tmp_path, capsys):
    # generate's time per token is the difference of two runs: 24 tokens and 5 pairs keep it
    # above a loaded machine's noise (8 and 3 read a negative median once, with other jobs on)
    argv = ["serve", "--quick", "--device", "cpu", "--warmup", "0", "--reps", "5"]
    argv += ["--context", "8", "--generate-tokens", "24", "--out", str(tmp_path)]
    assert cli.main([*argv, "--providers", "fp16", "torchao-int8"]) == 0
    rows = results.read_rows(tmp_path / "serve.csv")
    cases = {
        ("serve/prefill", "2x16"),
        ("serve/decode", "batch 2, context 8"),
        ("serve/generate", "batch 2, prompt 8"),
    }
    assert {(r.kernel, r.x) for r in rows} == cases
    for kernel, x in cases:
        fp16 = [r for r in rows if (r.kernel, r.x, r.provider) == (kernel, x, "fp16")]
        assert [r.mode for r in fp16] == ["eager"]  # no CUDA graph, no compile on a CPU
        assert fp16[0].p50 > 0 and fp16[0].throughput > 0 and fp16[0].speedup_vs_baseline == 1
        ao = [r for r in rows if (r.kernel, r.x, r.provider) == (kernel, x, "torchao-int8")]
        assert len(ao) == 1
        if math.isnan(ao[0].p50):  # torchao is not installed: the row says so
            assert ao[0].config.startswith("not run:") and "torchao" in ao[0].config
        else:
            assert ao[0].speedup_vs_baseline == pytest.approx(fp16[0].p50 / ao[0].p50)
    tokens = {r.kernel: r.throughput * r.p50 / 1e3 for r in rows if r.provider == "fp16"}
    assert tokens == pytest.approx(
        {"serve/prefill": 2 * 16, "serve/decode": 2, "serve/generate": 2}
    )
    assert (tmp_path / "serve.png").stat().st_size > 0
    assert "| serve/decode |" in capsys.readouterr().out


def test_int8_fused_is_served_eagerly_on_the_cpu(tmp_path):
    argv = ["serve", "--quick", "--device", "cpu", "--warmup", "0", "--reps", "1"]
    argv += ["--providers", "int8-fused", "--decode", "--generate", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    (row,) = results.read_rows(tmp_path / "serve.csv")  # --quick keeps its own sizes
    assert (row.kernel, row.provider, row.mode) == ("serve/prefill", "int8-fused", "eager")
    assert row.p50 > 0 and "weights" in row.config and "failed" not in row.config


def test_int8_fused_kv8_decodes_and_generates_over_the_int8_cache(tmp_path):
    """The provider ``int8-fused-kv8``: int8-fused's model over an int8 KV cache at decode and
    generate; its rows say which cache ran, and every cache it filled was int8."""
    from llmsys.hf import kv_cache

    argv = ["serve", "--quick", "--device", "cpu", "--warmup", "0", "--reps", "1"]
    argv += ["--providers", "int8-fused-kv8", "--prefill", "--decode", "2"]
    argv += ["--generate", "2", "--generate-tokens", "2", "--context", "8", "--out", str(tmp_path)]
    caches = []
    real = kv_cache.Int8StaticCache

    def spy(*args, **kwargs):
        caches.append(real(*args, **kwargs))
        return caches[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kv_cache, "Int8StaticCache", spy)
        assert cli.main(argv) == 0
    rows = {(r.kernel, r.provider): r for r in results.read_rows(tmp_path / "serve.csv")}
    assert set(rows) == {(k, "int8-fused-kv8") for k in ("serve/decode", "serve/generate")}
    for kernel in ("serve/decode", "serve/generate"):
        assert "int8-fused-kv8, weights" in rows[kernel, "int8-fused-kv8"].config
        assert "KV cache int8" in rows[kernel, "int8-fused-kv8"].config
    decode = rows["serve/decode", "int8-fused-kv8"]
    assert decode.p50 > 0 and "failed" not in decode.config
    generate = rows["serve/generate", "int8-fused-kv8"]  # a time, unless too short to tell
    assert generate.p50 > 0 or "within the timing noise" in generate.config
    assert "failed: ValueError" not in generate.config and "failed: Type" not in generate.config
    # decode's cache, then generate's warm-up and runs: each one int8, filled by the model
    assert len(caches) >= 2
    assert all(layer.keys.dtype == torch.int8 for c in caches for layer in c.layers)
    assert caches[0].layers[0].cumulative_length.item() > 8  # the context, then steps


def _row(kernel, provider, mode, p50, x="x"):
    return results.Row(kernel, provider, mode, x, "float16", p50, p50, p50)


def test_speed_ups_are_over_fp16s_fastest_graph_or_compiled_mode():
    rows = [
        _row("serve/decode", "fp16", "eager", 5.0),  # eager is not the baseline while others ran
        _row("serve/decode", "fp16", "cuda-graph", 10.0),
        _row("serve/decode", "fp16", "compiled+graph", 8.0),
        _row("serve/decode", "int8-fused", "cuda-graph", 4.0),
        _row("serve/decode", "torchao-int8", "cuda-graph", math.nan),
        _row("serve/decode", "int8-fused", "cuda-graph", 2.0, x="other case"),  # no fp16 row
        _row("serve/generate", "fp16", "eager", 30.0),
        _row("serve/generate", "fp16", "cuda-graph", 10.0),
        _row("serve/generate", "int8-fused", "eager", 20.0),
    ]
    serve._with_speedups(rows)
    got = [r.speedup_vs_baseline for r in rows]
    assert got == [1.6, 0.8, 1.0, 2.0, None, None, 1.0, 1.0, 1.5]


@pytest.mark.parametrize("shape", ["8", "8x", "0x512", "ax2", "2x3x4"])
def test_a_bad_prefill_shape_is_refused_by_name(shape, capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--prefill", shape])
    assert "--prefill" in capsys.readouterr().err


def test_a_run_with_no_cases_writes_an_empty_table(tmp_path):
    argv = ["serve", "--quick", "--device", "cpu", "--providers", "fp16"]
    assert cli.main([*argv, "--prefill", "--decode", "--generate", "--out", str(tmp_path)]) == 0
    assert results.read_rows(tmp_path / "serve.csv") == []


def test_the_context_is_checked_against_generate_only_when_generate_runs(tmp_path, capsys):
    """Issue 49: --context 62 left no room for generate's tokens in the tiny Llama (64
    positions), and the run was refused although --generate named no case."""
    argv = ["serve", "--quick", "--device", "cpu", "--providers", "fp16", "--context", "62"]
    argv += ["--prefill", "--decode", "1", "--warmup", "0", "--reps", "1", "--out", str(tmp_path)]
    assert cli.main([*argv, "--generate"]) == 0
    (row,) = results.read_rows(tmp_path / "serve.csv")
    assert (row.kernel, row.x) == ("serve/decode", "batch 1, context 62") and row.p50 > 0
    with pytest.raises(SystemExit, match="--context 62 leaves no room for generate's tokens"):
        cli.main([*argv, "--generate", "1"])


def test_replacing_is_said_only_when_a_previous_run_is_there(tmp_path, capsys):
    """Issue 49: a first run into an empty --out said it replaced the previous run's CSV (the
    run had written it case by case)."""
    argv = ["serve", "--quick", "--device", "cpu", "--providers", "fp16", "--decode"]
    argv += ["--generate", "--warmup", "0", "--reps", "1"]
    for out in (tmp_path / "new", tmp_path / "empty"):
        (tmp_path / "empty").mkdir(exist_ok=True)
        assert cli.main([*argv, "--out", str(out)]) == 0
        said = capsys.readouterr().out
        assert f"wrote {out / 'serve.csv'}\n" in said and "the previous run's" not in said
    assert cli.main([*argv, "--out", str(tmp_path / "empty")]) == 0
    assert "(replacing the previous run's; --out DIR keeps runs apart)" in capsys.readouterr().out


class _Packed(torch.Tensor):
    """A float16 weight stored as int8 values and a scale, as torchao's quantized tensors are:
    a wrapper subclass whose own storage is not the data."""

    @staticmethod
    def __new__(cls, values: torch.Tensor, scale: torch.Tensor):
        packed = torch.Tensor._make_wrapper_subclass(cls, values.shape, dtype=torch.float16)
        packed.values, packed.scale = values, scale
        return packed

    def __tensor_flatten__(self):
        return ["values", "scale"], None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"_Packed does not compute ({func})")


def test_weight_size_counts_what_a_quantized_tensor_holds_and_each_storage_once():
    model = nn.Module()
    model.register_buffer("w", _Packed(torch.zeros(64, 16, dtype=torch.int8), torch.ones(64)))
    tied = nn.Parameter(torch.zeros(8, 4, dtype=torch.float16))
    model.a, model.b = nn.Linear(4, 8, bias=False), nn.Linear(4, 8, bias=False)
    model.a.weight = model.b.weight = tied  # one storage under two names
    assert serve.weight_gib(model) * 2**30 == 64 * 16 + 64 * 4 + 8 * 4 * 2
