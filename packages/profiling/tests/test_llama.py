"""`llmsys-bench llama --quick` on the CPU: a tiny Hugging Face Llama through every case that runs
without CUDA (int8 and int8-fused inference against fp16, their logits error, training with our
kernels against stock), its CSV and its plot."""

import inspect
import math

import pytest
from torch import nn

from llmsys.bench_harness import results
from llmsys.profiling import cli, llama

pytest.importorskip(
    "transformers", reason="transformers is an optional extra: llmsys-profiling[transformers]"
)


def test_quick_run_writes_every_case_its_errors_and_a_plot(tmp_path, capsys, recwarn):
    argv = ["llama", "--quick", "--device", "cpu", "--warmup", "0", "--reps", "1"]
    assert cli.main([*argv, "--out", str(tmp_path)]) == 0
    rows = results.read_rows(tmp_path / "llama.csv")
    timed = {(r.kernel, r.provider, r.mode, r.x): r for r in rows if r.unit == "ms"}
    assert set(timed) == {
        ("llama/prefill", "fp16", "eager", "2x8"),
        ("llama/prefill", "int8", "eager", "2x8"),
        ("llama/prefill", "int8-fused", "eager", "2x8"),
        ("llama/decode", "fp16", "eager", "2 seqs, cache 8"),
        ("llama/decode", "int8", "eager", "2 seqs, cache 8"),
        ("llama/decode", "int8-fused", "eager", "2 seqs, cache 8"),
        ("llama/train-step", "stock", "eager", "2x16"),
        ("llama/train-step", "llmsys", "eager", "2x16"),
    }
    for row in timed.values():
        assert row.p50 > 0 and row.throughput > 0, row
        base = "stock" if row.kernel == "llama/train-step" else "fp16"
        baseline = timed[(row.kernel, base, row.mode, row.x)]
        assert row.speedup_vs_baseline == pytest.approx(baseline.p50 / row.p50)
    errors = {r.provider: r for r in rows if r.kernel == "llama/logits-error"}
    assert set(errors) == {"fp16", "int8", "int8-fused", "w8a8-reference-fp32"}
    assert errors["fp16"].throughput == 0  # against itself
    # W8A8 error against fp16 is the scheme's: the kernels' model and the float32 reference agree
    int8, reference = errors["int8"].throughput, errors["w8a8-reference-fp32"].throughput
    assert 0 < int8 < 0.1 and 0 < reference < 0.1 and math.isclose(int8, reference, rel_tol=0.5)
    # quantize_model computes quantize_linears' scheme with fewer passes: the same logits error
    assert math.isclose(errors["int8-fused"].throughput, int8, rel_tol=0.05)
    assert (tmp_path / "llama.png").stat().st_size > 0
    said = capsys.readouterr().out
    assert "| llama/train-step |" in said
    assert "the previous run's" not in said  # a first run replaces nothing (issue 49)
    # the KV cache goes by the keyword this transformers takes, not a deprecated one
    assert not [w for w in recwarn if "past_key_values" in str(w.message)]


def test_the_cache_keyword_is_the_one_forward_takes():
    class Renamed(nn.Module):
        def forward(self, input_ids, cache=None, use_cache=None): ...

    class Older(nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=None): ...

    assert llama.cache_keyword(Renamed()) == "cache"
    assert llama.cache_keyword(Older()) == "past_key_values"
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**llama.TINY))  # this transformers' own keyword
    assert llama.cache_keyword(model) in inspect.signature(model.forward).parameters


def test_the_readme_example_all_three_kernels_in_one_model():
    """llmsys-hf's README: our attention and SwiGLU for training, then INT8 linears."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from llmsys.hf import SwiGLUGatedMLP, patch_gated_mlps, register_flash_attention
    from llmsys.kernels_int8 import Int8Linear, quantize_linears

    config = LlamaConfig(**llama.TINY)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=register_flash_attention())
    stock = AutoModelForCausalLM.from_config(LlamaConfig(**llama.TINY), attn_implementation="sdpa")
    stock.load_state_dict(model.state_dict())
    patch_gated_mlps(model)
    ids = torch.randint(0, config.vocab_size, (2, 12))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())

    model = quantize_linears(model.half().eval())
    assert (
        sum(isinstance(m, Int8Linear) for m in model.modules()) == 7 * config.num_hidden_layers + 1
    )  # + lm_head
    assert sum(isinstance(m, SwiGLUGatedMLP) for m in model.modules()) == config.num_hidden_layers
    with torch.no_grad():
        got = model(ids).logits.float()
        want = stock.double()(ids).logits
        tokens = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert llama.relative_error(got, want) < 0.1  # W8A8's error, not a broken model
    assert tokens.shape == (2, 15) and torch.equal(tokens[:, :12], ids)


def test_generate_serves_an_int8_model_as_transformers_generate_does():
    """llmsys.hf.generate over a static cache on a model quantized by quantize_model (the
    kernels under Triton's interpreter on CPU): the tokens transformers' greedy generate gives."""
    import torch
    import transformers

    from llmsys.hf import generate, quantize_model

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=97, attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    quantize_model(model)
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(1))
    want = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4,
        do_sample=False, pad_token_id=0,
    )  # fmt: skip
    assert torch.equal(generate(model, ids, 4), want)
