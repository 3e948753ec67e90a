"""The fused SwiGLU in Hugging Face transformers models: ``patch_gated_mlps(model)``.

    from llmsys.hf import patch_gated_mlps

    patch_gated_mlps(model)  # every LlamaMLP / MistralMLP / Qwen2MLP now calls swiglu()

Those MLPs compute ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``; with a SiLU ``act_fn`` the
middle is exactly :func:`~llmsys.kernels_swiglu.swiglu`. Each one is replaced, in place, by a
:class:`SwiGLUGatedMLP` that holds the same three projection layers (the same parameters: the
optimizer, ``state_dict`` keys and ``save_pretrained`` see no change) and fuses the activation and
the product, forward and backward. transformers is imported only when ``patch_gated_mlps`` runs.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from llmsys.kernels_swiglu import swiglu

from .families import FAMILIES, family_classes, is_silu

logger = logging.getLogger(__name__)


class SwiGLUGatedMLP(nn.Module):
    """``down_proj(swiglu(gate_proj(x), up_proj(x)))`` over a gated MLP's own projections.

    Args:
        gate_proj, up_proj: ``(..., hidden) -> (..., intermediate)`` layers (any modules:
            ``nn.Linear``, or ``Int8Linear`` after ``quantize_linears``).
        down_proj: ``(..., intermediate) -> (..., hidden)``.
    """

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def patch_gated_mlps(model: nn.Module) -> nn.Module:
    """Replace every Llama-, Mistral- and Qwen2-style gated MLP of ``model`` in place by a
    :class:`SwiGLUGatedMLP` over the same projections.

    All or nothing: every MLP found is checked before any is replaced. Calling it again on a
    patched model changes nothing.

    Args:
        model: an ``nn.Module`` containing ``LlamaMLP``, ``MistralMLP`` or ``Qwen2MLP`` layers
            (exactly those classes) whose activation is SiLU (``hidden_act="silu"`` or
            ``"swish"``).

    Returns:
        ``model`` itself. The names of the patched MLPs are logged (``logging`` INFO, logger
        ``llmsys.hf.mlp``).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: a gated MLP's activation is not SiLU (nothing is replaced then), the
            model has no such MLP and none patched already, or ``model`` is itself one.
        ImportError: transformers is not installed.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch_gated_mlps: `model` must be an nn.Module, got {type(model)}")
    classes = family_classes()["mlp"]
    found = [(name, m) for name, m in model.named_modules() if type(m) in classes]
    for name, mlp in found:
        if not name:  # the model is itself an MLP: it cannot replace itself
            raise ValueError(
                "patch_gated_mlps: `model` is itself a gated MLP; build "
                "SwiGLUGatedMLP(mlp.gate_proj, mlp.up_proj, mlp.down_proj) instead"
            )
        if not is_silu(mlp.act_fn):
            raise ValueError(
                f"patch_gated_mlps: the gated MLP `{name or type(mlp).__name__}` has activation "
                f"{type(mlp.act_fn).__name__}; swiglu fuses SiLU only (hidden_act='silu'), so "
                "nothing was patched"
            )
    if not found:
        if any(isinstance(m, SwiGLUGatedMLP) for m in model.modules()):
            logger.info("patch_gated_mlps: every gated MLP is patched already; nothing changed")
            return model
        names = ", ".join(f"{prefix}MLP" for prefix in FAMILIES.values())
        raise ValueError(
            f"patch_gated_mlps: `model` ({type(model).__name__}) has no gated MLP to patch "
            f"(looked for {names})"
        )
    for name, mlp in found:
        parent_name, _, child = name.rpartition(".")
        patched = SwiGLUGatedMLP(mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        setattr(model.get_submodule(parent_name), child, patched)
    patched_names = [name for name, _ in found]
    logger.info("patch_gated_mlps: patched %d gated MLP(s): %s", len(patched_names), patched_names)
    return model
