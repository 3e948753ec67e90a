"""``patch_gated_mlps``: tiny random Llama, Mistral and Qwen2 models patched in place against the
stock model in float64 (logits and every parameter's gradient), and the refusals."""

import pytest
import torch

from llmsys.hf import SwiGLUGatedMLP, patch_gated_mlps
from llmsys.hf import mlp as hf_mlp
from llmsys_dev.compare import assert_matches_stock, logits_and_grads

transformers = pytest.importorskip("transformers")

VOCAB, LAYERS = 97, 2
# float32 against float64; on a GPU the float32 matmuls may run TF32 (cuBLAS defaults vary)
TOL = {"cpu": 1e-5, "cuda": 1e-2}
CONFIGS = {
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config,
}


def tiny_model(family: str = "llama", **overrides):
    sizes = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    config = CONFIGS[family](**(sizes | overrides))
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")


@pytest.mark.parametrize("family", list(CONFIGS))
def test_patched_models_match_the_stock_model(family, device, monkeypatch):
    stock = tiny_model(family).to(device, torch.float64)
    ours = tiny_model(family).to(device)
    ours.load_state_dict(stock.state_dict())
    parameters = dict(ours.named_parameters())
    assert patch_gated_mlps(ours) is ours

    mlps = [m for m in ours.modules() if isinstance(m, SwiGLUGatedMLP)]
    assert len(mlps) == LAYERS
    # the same parameter objects under the same names: optimizers and checkpoints see no change
    assert dict(ours.named_parameters()) == parameters
    calls, swiglu = [], hf_mlp.swiglu
    monkeypatch.setattr(hf_mlp, "swiglu", lambda a, b: calls.append(a.shape) or swiglu(a, b))

    ids = torch.randint(0, VOCAB, (2, 9), device=device)
    weight = torch.randn(2, 9, VOCAB, device=device)
    got, want = logits_and_grads(ours, ids, weight), logits_and_grads(stock, ids, weight)
    assert calls == [(2, 9, 48)] * LAYERS
    assert_matches_stock(got, want, TOL[torch.device(device).type])


def test_patching_twice_changes_nothing(caplog):
    with caplog.at_level("INFO", logger="llmsys.hf.mlp"):
        model = patch_gated_mlps(tiny_model())
    assert "patched 2 gated MLP(s): ['model.layers.0.mlp', 'model.layers.1.mlp']" in caplog.text
    mlps = [m for m in model.modules() if isinstance(m, SwiGLUGatedMLP)]
    with caplog.at_level("INFO", logger="llmsys.hf.mlp"):
        assert patch_gated_mlps(model) is model
    assert "patched already; nothing changed" in caplog.text
    assert [m for m in model.modules() if isinstance(m, SwiGLUGatedMLP)] == mlps


@pytest.mark.parametrize("act", ["gelu", "relu", "gelu_pytorch_tanh"])
def test_other_activations_are_refused_and_nothing_is_patched(act):
    model = tiny_model(hidden_act=act)
    before = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=r"activation \w+; swiglu fuses SiLU only"):
        patch_gated_mlps(model)
    assert [type(m) for m in model.modules()] == before


def test_swish_is_silu():
    model = patch_gated_mlps(tiny_model(hidden_act="swish"))
    assert sum(isinstance(m, SwiGLUGatedMLP) for m in model.modules()) == LAYERS


def test_a_model_without_gated_mlps_is_refused():
    with pytest.raises(ValueError, match=r"no gated MLP to patch \(looked for LlamaMLP"):
        patch_gated_mlps(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(TypeError, match=r"`model` must be an nn\.Module"):
        patch_gated_mlps("model")
    mlp = tiny_model().model.layers[0].mlp
    with pytest.raises(ValueError, match="is itself a gated MLP"):
        patch_gated_mlps(mlp)
