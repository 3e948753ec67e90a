"""Command-line options the model benchmarks share (``e2e``, ``memory``, ``profile``).

The part switches pick each part's implementation; a preset sets them all at once
(``PRESETS_HELP``, the epilog of each of those subcommands' ``--help``).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import torch

from llmsys.bench_harness.arguments import positive_int

from .config import ATTENTION, FFN, LOSS, NORM, ROPE, SIZES, ModelConfig
from .training import DTYPES, OPTIMIZERS

FUSED_PARTS = ("norm", "rope", "loss")  # "eager" or "fused" each (llmsys.kernels_fused)
# Every part on an llmsys kernel: the llmsys preset's, and the fused RMSNorm, rotary and loss.
_ALL_FUSED: dict[str, Any] = dict(attention="flash", ffn="swiglu") | dict.fromkeys(
    FUSED_PARTS, "fused"
)
PRESETS: dict[str, dict[str, Any]] = {
    "eager": dict(attention="naive", ffn="eager", compile=False),
    "compiled": dict(attention="sdpa", ffn="eager", compile=True),
    "llmsys": dict(attention="flash", ffn="swiglu", compile=True, compile_mode="reduce-overhead"),
    "fused": _ALL_FUSED | dict(compile=False),
    "fused-compiled": _ALL_FUSED | dict(compile=True, compile_mode="reduce-overhead"),
}
# torch.compile modes: "default"; "reduce-overhead" replays CUDA graphs (no per-kernel launch
# cost on the host); "max-autotune-no-cudagraphs" tunes Inductor's matmuls (minutes to compile).
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way to run the model: its parts, compile, precision, optimizer and checkpointing."""

    attention: str = "sdpa"
    ffn: str = "eager"
    norm: str = "eager"
    rope: str = "eager"
    loss: str = "eager"
    compile: bool = False
    compile_mode: str = "default"
    dtype: str = "bf16"
    optimizer: str = "adamw-fused"
    checkpoint: bool = False
    int8: bool = False
    preset: str = ""

    def __post_init__(self) -> None:
        choices = {
            "attention": ATTENTION,
            "ffn": FFN,
            "norm": NORM,
            "rope": ROPE,
            "loss": LOSS,
            "compile_mode": COMPILE_MODES,
            "dtype": DTYPES,
            "optimizer": OPTIMIZERS,
        }
        for name, allowed in choices.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(
                    f"Variant: `{name}` must be one of {tuple(allowed)}, got {value!r}"
                )
        for name in ("compile", "checkpoint", "int8"):
            value = getattr(self, name)
            # checkpoint None: not chosen yet (the memory sweep then runs both)
            if not isinstance(value, bool) and not (name == "checkpoint" and value is None):
                raise ValueError(f"Variant: `{name}` must be a bool, got {value!r}")
        if not isinstance(self.preset, str):
            raise ValueError(f"Variant: `preset` must be a str, got {self.preset!r}")

    @property
    def cuda_graphs(self) -> bool:
        """Whether torch.compile replays CUDA graphs (``reduce-overhead``)."""
        return self.compile and self.compile_mode == "reduce-overhead"

    @property
    def label(self) -> str:
        """Short provider name for tables: the preset, or the parts spelled out (``fused-norm``
        and the like only for the parts that are fused, so earlier labels stay as they were)."""
        spelled = [self.attention, self.ffn]
        spelled += [f"fused-{name}" for name in FUSED_PARTS if getattr(self, name) == "fused"]
        parts = [
            self.preset or "+".join(spelled),
            "compiled" if self.compile and not self.preset else "",
            self.compile_mode if self.compile and self.compile_mode != "default" else "",
            "int8" if self.int8 else "",
            "ckpt" if self.checkpoint else "",
        ]
        return "+".join(p for p in parts if p)

    def config(self, size: str, context_length: int, **overrides: Any) -> ModelConfig:
        return ModelConfig.named(
            size,
            context_length=context_length,
            attention=self.attention,
            ffn=self.ffn,
            norm=self.norm,
            rope=self.rope,
            loss=self.loss,
            checkpoint=self.checkpoint,
            **overrides,
        )


PRESETS_HELP = f"""\
presets (--preset NAME ...; a part switch given with a preset overrides it):
  eager     naive attention, eager SwiGLU, no torch.compile (what a first implementation is)
  compiled  SDPA attention, eager SwiGLU, torch.compile (the best a user picks from PyTorch)
  llmsys    flash-attn2, the fused SwiGLU kernel, torch.compile with CUDA graphs (every one of
            our kernels, in the compile mode measured fastest for them: on an H100 the medium
            model's train step took 38.4 ms with "reduce-overhead" and 59.6 ms with "default",
            whose host cost per custom-op call starves the GPU)
  fused     every part on an llmsys kernel, no torch.compile: flash-attn2, the SwiGLU kernel,
            and llmsys.kernels_fused's RMSNorm (each residual add fused into the next norm),
            rotary (q and k in one launch) and linear cross-entropy (no logits)
  fused-compiled
            the same parts, torch.compile with CUDA graphs (as llmsys)
  (none)    the part switches alone (unset: {Variant.attention} attention, {Variant.ffn} FFN,
            eager norm, rope and loss, no torch.compile: the provider `{Variant().label}`)
"""


def add_model_arguments(
    parser: argparse.ArgumentParser,
    *,
    contexts: tuple[int, ...] = (1024,),
    sizes: tuple[str, ...] = ("small",),
    cpu_contexts: tuple[int, ...] = (128,),
) -> None:
    """Sizes, contexts, batch, precision, presets and part switches (lists sweep).

    ``--size`` and ``--context-length`` default by ``--device``: on a CPU the tiny model at
    ``cpu_contexts`` (``fill_device_defaults`` sets them once the device is known).
    """
    parser.epilog = PRESETS_HELP
    on_cuda, on_cpu, cuda_sizes = (
        " ".join(map(str, values)) for values in (contexts, cpu_contexts, sizes)
    )
    parser.add_argument(
        "--size",
        nargs="+",
        choices=list(SIZES),
        help=f"model sizes (default: {cuda_sizes} on cuda, tiny on cpu)",
    )
    parser.add_argument(
        "--context-length",
        nargs="+",
        type=positive_int,
        help=f"sequence lengths (default: {on_cuda} on cuda, {on_cpu} on cpu)",
    )
    parser.set_defaults(
        device_defaults={
            "cuda": {"size": list(sizes), "context_length": list(contexts)},
            "cpu": {"size": ["tiny"], "context_length": list(cpu_contexts)},
        }
    )
    parser.add_argument("--batch-size", type=positive_int, default=4, help="sequences per step")
    parser.add_argument(
        "--dtype",
        nargs="+",
        default=["bf16"],
        choices=DTYPES,
        help="fp32, or bf16 autocast over float32 weights",
    )
    parser.add_argument(
        "--preset",
        nargs="+",
        choices=list(PRESETS),
        help="run these presets, one case each (see 'presets' below; default: none)",
    )
    preset_or = "default: the preset's; without one,"
    parser.add_argument(
        "--attention", choices=ATTENTION, help=f"attention ({preset_or} {Variant.attention})"
    )
    parser.add_argument(
        "--ffn",
        choices=FFN,
        help=f"feed-forward: eager, swiglu kernel or moe ({preset_or} {Variant.ffn})",
    )
    for name, choices, what in (
        ("norm", NORM, "RMSNorm: eager, or fused (kernels_fused.rms_norm with the residual add)"),
        ("rope", ROPE, "rotary embedding: eager, or fused (kernels_fused.rotary, q and k at once)"),
        ("loss", LOSS, "loss: eager logits + cross-entropy, or fused (no logits)"),
    ):
        parser.add_argument(f"--{name}", choices=choices, help=f"{what} ({preset_or} eager)")
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"torch.compile ({preset_or} off)",
    )
    parser.add_argument(
        "--compile-mode",
        choices=COMPILE_MODES,
        help=f"torch.compile mode ({preset_or} {Variant.compile_mode!r})",
    )
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=Variant.optimizer,
        help="AdamW: PyTorch's fused kernel, its foreach loops, or the readable one",
    )
    parser.add_argument(
        "--checkpoint",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="per-block activation checkpointing",
    )
    parser.add_argument(
        "--int8", action="store_true", help="int8 linears (llmsys.kernels_int8; forward only)"
    )


def fill_device_defaults(args: argparse.Namespace) -> None:
    """Set ``--size`` and ``--context-length``, where not given, to ``args.device``'s defaults."""
    device = "cpu" if torch.device(args.device).type == "cpu" else "cuda"
    for name, value in args.device_defaults[device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def variants(args: argparse.Namespace, dtype: str) -> list[Variant]:
    """The variants the arguments ask for: one per preset, or one from the switches alone."""
    switches = {
        key: getattr(args, key)
        for key in ("attention", "ffn", *FUSED_PARTS, "compile", "compile_mode")
        if getattr(args, key, None) is not None
    }
    common = dict(
        dtype=dtype,
        optimizer=args.optimizer,
        checkpoint=args.checkpoint,
        int8=getattr(args, "int8", False),
    )
    if not args.preset:
        return [Variant(**switches, **common)]
    return [
        Variant(**(PRESETS[name] | switches), **common, preset=name if not switches else "")
        for name in args.preset
    ]
