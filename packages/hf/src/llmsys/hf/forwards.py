"""The forwards ``apply_llmsys`` puts on a Llama-, Mistral- or Qwen2-family model's modules.

Each is bound to one module instance (``module.forward = MethodType(...)``), so other models of
the same class in the process keep transformers' code. Each does what transformers' forward of
that module does, with an llmsys kernel where one fits, and hands every case it does not cover
to transformers' own forward of the module's class:

    RMSNorm         ``rms_norm`` (llmsys.kernels_fused); with ``residual=`` the add before it too
    decoder layer   the residual add after attention fused into the post-attention RMSNorm
    attention       ``llmsys.kernels_fused.hf.attention_forward``: ``rotary`` on q and k in one
                    launch (kernels-int8's ``quantize_model`` binds it too), then the attention
                    implementation the config names (``llmsys_fa2`` after ``apply_llmsys``)
    causal LM       with ``labels=``, the loss from the last hidden states through
                    ``causal_lm_loss`` (the logits never exist); without labels, or with
                    ``logits_to_keep``: transformers' forward
"""

from __future__ import annotations

import torch
from torch import nn

from llmsys.kernels_fused import causal_lm_loss, rms_norm


def rms_norm_forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None):
    """``LlamaRMSNorm.forward``; with ``residual``, returns ``(norm(hidden + residual), sum)``."""
    return rms_norm(hidden_states, self.weight, self.variance_epsilon, residual=residual)


def decoder_layer_forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
    """``LlamaDecoderLayer.forward`` with the add after attention fused into the next norm.

    The keyword arguments go to the attention as transformers' layer passes them. The add after
    the MLP stays a plain add: the next layer receives one tensor, as transformers' model loop
    hands it over."""
    residual = hidden_states
    hidden_states = _cast_once(self.input_layernorm(hidden_states))
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
    # The stream first: the sum takes its dtype (float32 under autocast, as stock's add).
    hidden_states, residual = self.post_attention_layernorm(residual, residual=hidden_states)
    return residual + self.mlp(_cast_once(hidden_states))


def _cast_once(normed: torch.Tensor) -> torch.Tensor:
    """A norm's float32 output in autocast's dtype, where autocast is on for its device.

    Autocast would cast it for each linear that reads it, and each of those saves its own copy
    for backward: q, k and v three, gate and up two, N x hidden 16-bit values each. Cast once,
    they share one (the values are the same: autocast's cast of the same tensor). Backward then
    sums their three input gradients in that dtype, where stock sums them in float32."""
    device = normed.device.type
    if normed.dtype == torch.float32 and torch.is_autocast_enabled(device):
        return normed.to(torch.get_autocast_dtype(device))
    return normed


def _output_with_cache(outputs, **fields):
    """A ``CausalLMOutputWithPast`` carrying ``outputs``' cache under the field name of the
    installed transformers (``cache`` from 5.2x, ``past_key_values`` before)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    for name in ("cache", "past_key_values"):
        if name in CausalLMOutputWithPast.__dataclass_fields__:
            fields[name] = getattr(outputs, name, None)
            break
    return CausalLMOutputWithPast(**fields)


def causal_lm_forward(self, input_ids=None, *args, labels=None, logits_to_keep=0, **kwargs):
    """``LlamaForCausalLM.forward`` whose loss never materialises the logits.

    With ``labels`` (and no ``logits_to_keep``), the loss comes from the last hidden states
    and ``lm_head``'s weight through ``causal_lm_loss``, as transformers' ``ForCausalLMLoss``
    defines it (shifted labels, ``ignore_index=-100``, ``num_items_in_batch``), and ``logits`` is
    ``None``. Anything else (no labels, ``logits_to_keep``, an ``lm_head`` that is no longer an
    ``nn.Linear``, as after int8 quantization) runs the class's own forward.
    """
    head = self.lm_head
    keep_all = isinstance(logits_to_keep, int) and logits_to_keep == 0
    if labels is None or not keep_all or args or type(head) is not nn.Linear:
        return type(self).forward(
            self, input_ids, *args, labels=labels, logits_to_keep=logits_to_keep, **kwargs
        )
    loss_kwargs = {
        name: kwargs.pop(name)
        for name in ("num_items_in_batch", "ignore_index", "shift_labels")
        if name in kwargs
    }
    return_dict = kwargs.pop("return_dict", None)
    outputs = self.model(input_ids, return_dict=True, **kwargs)
    loss = causal_lm_loss(
        outputs.last_hidden_state, head.weight, labels, lm_head_bias=head.bias, **loss_kwargs
    )
    output = _output_with_cache(
        outputs,
        loss=loss,
        logits=None,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    return output if return_dict else output.to_tuple()
