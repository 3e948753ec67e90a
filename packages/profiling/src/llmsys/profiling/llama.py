"""Our kernels inside a Hugging Face Llama: random weights from a config.

The model (``--model``): 0.85b, hidden 2048, intermediate 5632, 16 layers, 16 heads, 4 KV heads,
vocab 32000, untied embeddings; 3b, Llama-3.2-3B's shape (hidden 3072, 28 layers, 24 heads,
8 KV heads, vocab 128256, tied); or 8b, Llama-3.1-8B's shape (hidden 4096, intermediate 14336,
32 layers, 32 heads, 8 KV heads, vocab 128256, untied). Every case runs in this one process, the
providers of a case side by side; times are medians of per-call CUDA-event times after warm-up.

inference  float16, SDPA attention. ``fp16`` is the model as built; ``int8`` is a copy with
           every linear swapped by ``llmsys.kernels_int8.quantize_linears`` (W8A8: weights per
           output channel, activations per token); ``int8-fused`` a copy rewritten by
           ``llmsys.hf.quantize_model`` (the same scheme: q|k|v and gate|up as one
           GEMM each, the quantization fused into RMSNorm and SiLU-and-mul). Prefill: 8 x 512
           tokens, no cache, last token's logits. Decode: one token for each of 8 sequences over
           a static KV cache holding 512 tokens. Each eagerly and as one CUDA graph of the whole
           forward (``cuda-graph``: captured after warm-up, replayed). Logits error on the
           prefill batch: each model's against the float16 model and against the float32 model
           (the same weights in float32), beside a float32 reference of the same W8A8 scheme
           (the int8 model's quantized weights; activations quantized in float32, the integer
           product in float64).
training   bf16 autocast over float32 weights, fused AdamW, a full step (forward with
           ``labels=``, so each provider computes its own loss; backward; optimizer). ``stock`` is
           the model as transformers builds it (SDPA attention); ``llmsys`` the same weights
           after ``llmsys.hf.apply_llmsys``; ``liger`` after Liger-Kernel's
           ``apply_liger_kernel_to_llama(model=...)`` (when liger-kernel is installed). Each
           case copies the model from the CPU to the device alone, so its peak memory is its
           own. Batches 4 x 2048 and 1 x 8192, eagerly and under ``torch.compile``;
           ``--largest-batch 2048`` also finds each provider's largest batch that fits.

Writes ``<out>/llama.csv`` (after every case, so a cut-off run keeps what it measured) and
``<out>/llama.png`` (speed-ups, when matplotlib is installed). ``--quick`` runs a tiny Llama at
tiny sizes, eagerly only on a CPU: a smoke test. Needs transformers.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import math
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import torch
from torch import nn

from llmsys.bench_harness import call_times_ms, cuda_graph, results
from llmsys.bench_harness.arguments import batch_by_tokens, non_negative_int, positive_int

from .progress import progress
from .training import free_device_memory, make_optimizer, synchronize

HELP = "a 0.85B Hugging Face Llama: int8 inference and training with our kernels"
LLAMA = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=4,
    vocab_size=32000,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
)
# Llama-3.2-3B's shape (head dim 128, tied embeddings), for the training comparison.
LLAMA_3B = LLAMA | dict(
    hidden_size=3072,
    intermediate_size=8192,
    num_hidden_layers=28,
    num_attention_heads=24,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=True,
)
# Llama-3.1-8B's shape, the published serving anchors' model (RoPE theta left at the config's
# default: it changes no timing).
LLAMA_8B = LLAMA | dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
)
MODELS = {"0.85b": LLAMA, "3b": LLAMA_3B, "8b": LLAMA_8B}
TINY = LLAMA | dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=64,
)
SIZES: dict[
    str, dict[str, Any]
] = {  # prefill (batch, tokens), decode (sequences, cached tokens), training (batch, tokens)
    "full": dict(prefill=(8, 512), decode=(8, 512), train=[(4, 2048), (1, 8192)]),
    "quick": dict(prefill=(2, 8), decode=(2, 8), train=[(2, 16)]),
}
PARTS = ("inference", "training", "curve")
TRAIN_PROVIDERS = ("stock", "llmsys", "liger")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--part",
        nargs="+",
        choices=PARTS,
        default=["inference", "training"],
        help="what to run: inference, training, and curve (the loss over --curve-steps steps on "
        "one fixed batch for stock eager and compiled, llmsys and Liger); default inference "
        "and training",
    )
    parser.add_argument(
        "--curve-steps", type=positive_int, default=200, help="steps of the loss curve (200)"
    )
    parser.add_argument(
        "--curve-shape",
        type=batch_by_tokens,
        default=(2, 1024),
        help="the loss curve's batch as BxT (default 2x1024)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a tiny Llama at tiny sizes (a smoke test)"
    )
    parser.add_argument(
        "--compile",
        choices=("off", "on", "both"),
        help="training eagerly, under torch.compile, or both (default: both on CUDA, off on CPU)",
    )
    parser.add_argument(
        "--compile-mode",
        choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
        default="default",
        help="torch.compile mode for training (default: 'default')",
    )
    parser.add_argument(
        "--train-shape",
        nargs="+",
        type=batch_by_tokens,
        help="training batches as BxT (default: 4x2048 1x8192; with --quick, 2x16)",
    )
    parser.add_argument(
        "--model",
        choices=MODELS,
        default="0.85b",
        help="the Llama config: 0.85b (hidden 2048, 16 layers, vocab 32000), 3b "
        "(Llama-3.2-3B's shape, vocab 128256) or 8b (Llama-3.1-8B's shape); default 0.85b",
    )
    parser.add_argument(
        "--providers",
        nargs="+",
        choices=TRAIN_PROVIDERS,
        default=list(TRAIN_PROVIDERS),
        help="training providers (default: all; liger needs liger-kernel installed)",
    )
    parser.add_argument(
        "--largest-batch",
        type=non_negative_int,
        default=0,
        metavar="TOKENS",
        help="also find each training provider's largest batch of TOKENS-token sequences "
        "(eager; 0, the default: skip)",
    )
    parser.add_argument("--warmup", type=non_negative_int, default=3, help="untimed calls per case")
    parser.add_argument("--reps", type=positive_int, default=20, help="timed calls per case")


def _transformers() -> ModuleType:
    try:
        import transformers
    except ImportError as error:
        raise SystemExit(
            "llmsys-bench llama needs transformers: pip install 'llmsys-profiling[transformers]'"
        ) from error
    return transformers


def build_llama(
    sizes: dict, device: torch.device | str, dtype: torch.dtype, attn: str = "sdpa"
) -> nn.Module:
    """A LlamaForCausalLM with random weights, built on ``device`` in ``dtype``."""
    transformers = _transformers()
    config = transformers.LlamaConfig(**sizes)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation=attn, dtype=dtype
        )
    return model


def cache_keyword(model: nn.Module) -> str:
    """The keyword ``model``'s forward takes its KV cache by, read from its signature: ``cache``
    where transformers has renamed it (it then deprecates the old name), else
    ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm()).item()


def _row(
    kernel: str,
    provider: str,
    mode: str,
    x: str,
    dtype: str,
    times: list[float],
    tokens: int,
    config: str,
    **extra: Any,
) -> results.Row:
    p20, p50, p80 = results.quantiles(times)
    return results.Row(
        kernel=kernel, provider=provider, mode=mode, x=x, dtype=dtype, p20=p20, p50=p50,
        p80=p80, throughput=tokens / (p50 / 1e3), throughput_unit="tok/s", config=config,
        **extra,
    )  # fmt: skip


def _with_speedups(rows: list[results.Row], baseline: str) -> list[results.Row]:
    """Each row's speed-up over the ``baseline`` provider's row of the same case."""
    base = {(r.kernel, r.mode, r.x): r.p50 for r in rows if r.provider == baseline}
    for r in rows:
        ms = base.get((r.kernel, r.mode, r.x))
        r.speedup_vs_baseline = ms / r.p50 if ms and not math.isnan(r.p50) else None
    return rows


def inference(
    args: argparse.Namespace, sizes: dict, shapes: dict, emit: Callable[[results.Row], None]
) -> None:
    """fp16 vs int8 (quantize_linears) and int8-fused (quantize_model): prefill and decode,
    eager and CUDA graph; logits error."""
    from llmsys.hf import quantize_model
    from llmsys.kernels_int8 import quantize_linears

    transformers = _transformers()
    device, on_cuda = args.device, torch.device(args.device).type == "cuda"
    fp16 = build_llama(sizes, device, torch.float16).eval()
    fused = copy.deepcopy(fp16)
    quantize_model(fused)
    models = {"fp16": fp16, "int8": quantize_linears(copy.deepcopy(fp16)), "int8-fused": fused}
    params = sum(p.numel() for p in fp16.parameters())
    batch, tokens = shapes["prefill"]
    seqs, cached = shapes["decode"]
    prompt = torch.randint(0, sizes["vocab_size"], (batch, tokens), device=device)
    history = torch.randint(0, sizes["vocab_size"], (seqs, cached), device=device)
    steps = 3 * (args.warmup + args.reps) + 8  # every decode call adds a token to the cache
    modes = ["eager", "cuda-graph"] if on_cuda else ["eager"]
    cases = [(p, n, m) for p in ("prefill", "decode") for n in models for m in modes]
    caches = {}

    def call(phase: str, name: str) -> Callable[[], object]:
        model = models[name]
        if phase == "prefill":
            return lambda: model(prompt, use_cache=False, logits_to_keep=1)
        key = cache_keyword(model)
        if name not in caches:  # prefilled once; each step then writes the next slot
            caches[name] = transformers.StaticCache(
                config=model.config, max_cache_len=cached + steps
            )
            model(history, **{key: caches[name]}, use_cache=True)
        token, kv = history[:, -1:], {key: caches[name]}
        return lambda: model(token, **kv, use_cache=True)

    label = f"{params / 1e9:.2f}B params, {sizes['num_hidden_layers']} layers"
    for phase, name, mode in progress(cases, "llama inference", lambda c: " ".join(c)):
        x = f"{batch}x{tokens}" if phase == "prefill" else f"{seqs} seqs, cache {cached}"
        settings = f"{label}; warmup={args.warmup} reps={args.reps}"
        with torch.no_grad():
            fn = call(phase, name)
            try:
                fn = cuda_graph(fn) if mode == "cuda-graph" else fn
                times = call_times_ms(fn, reps=args.reps, warmup=args.warmup, device=device)
            except Exception as error:  # a provider that cannot be captured is a result too
                if on_cuda:
                    torch.cuda.synchronize()
                times, settings = [math.nan], f"failed: {type(error).__name__}: {error}"[:300]
        done = batch * tokens if phase == "prefill" else seqs
        emit(_row(f"llama/{phase}", name, mode, x, "float16", times, done, settings))
    caches.clear()

    from llmsys.kernels_int8 import w8a8_reference_model

    with torch.no_grad():  # logits error on the prefill batch
        fp32 = copy.deepcopy(fp16).float()
        want = fp32(prompt, use_cache=False).logits
        del fp32  # one float32 copy at a time (an 8B one is 32 GB)
        reference = w8a8_reference_model(fp16)  # every linear, as quantize_linears swaps them
        logits = {
            "fp16": fp16(prompt, use_cache=False).logits,
            "int8": models["int8"](prompt, use_cache=False).logits,
            "int8-fused": models["int8-fused"](prompt, use_cache=False).logits,
            "w8a8-reference-fp32": reference(prompt, use_cache=False).logits,
        }
        del reference
    for name, got in logits.items():
        versus_fp16 = relative_error(got, logits["fp16"])
        emit(
            results.Row(
                kernel="llama/logits-error", provider=name, mode="prefill",
                x=f"{batch}x{tokens}", dtype="float16" if name != "w8a8-reference-fp32"
                else "float32", p20=math.nan, p50=math.nan, p80=math.nan, unit="",
                throughput=versus_fp16, throughput_unit="rel err vs fp16",
                config=f"rel err vs fp32 model {relative_error(got, want):.4g}; vs the W8A8 "
                f"reference {relative_error(got, logits['w8a8-reference-fp32']):.4g}",
            )
        )  # fmt: skip


def _liger() -> Callable[..., None] | None:
    """Liger-Kernel's patch for Llama, or None when liger-kernel is not installed."""
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
    except ImportError:
        return None
    return apply_liger_kernel_to_llama


@contextlib.contextmanager
def kernels_of(provider: str, model: nn.Module) -> Iterator[nn.Module]:
    """``model`` with ``provider``'s kernels put in: nothing (stock), ``apply_llmsys``, or
    Liger-Kernel's ``apply_liger_kernel_to_llama(model=...)``. Liger also replaces
    transformers' module-level rotary function and classes; they are put back on leaving, so
    the next stock model is stock."""
    if provider == "llmsys":
        from llmsys.hf import apply_llmsys

        apply_llmsys(model)
    if provider != "liger":
        yield model
        return
    module = sys.modules[type(model).__module__]
    saved = {name: getattr(module, name) for name in LIGER_REPLACES if hasattr(module, name)}
    try:
        patch = _liger()
        assert patch is not None  # (the callers ask for liger only where it is installed)
        patch(model=model)
        yield model
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


LIGER_REPLACES = ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")


def train_step(
    call: Callable[..., Any],
    optimizer: torch.optim.Optimizer,
    data: torch.Tensor,
    device: torch.device | str,
) -> torch.Tensor:
    """One bf16-autocast step with the loss from the model's forward (``labels=``)."""
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        loss = call(data, labels=data, use_cache=False).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def largest_batch(
    model: nn.Module, tokens: int, vocab: int, device: torch.device | str, cap: int = 512
) -> int:
    """The largest batch of ``tokens``-token sequences whose eager train step fits: doubled from
    1 until a step runs out of memory, then bisected to within 1/8."""
    optimizer = make_optimizer(model)

    def fits(batch: int) -> bool:
        ok = True
        data: torch.Tensor | None = None
        try:
            data = torch.randint(0, vocab, (batch, tokens), device=device)
            for _ in range(2):  # the first allocates the optimizer state
                train_step(model, optimizer, data, device)
            synchronize(device)
        except torch.OutOfMemoryError:
            ok = False
        data = None
        optimizer.zero_grad(set_to_none=True)
        free_device_memory(device)
        return ok

    low = 0
    high: int | None = None  # the first batch that does not fit, once one is found
    batch = 1
    while high is None and batch <= cap:
        if fits(batch):
            low, batch = batch, batch * 2
        else:
            high = batch
    high = high or cap + 1
    while high - low > max(1, low // 8):
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def training(
    args: argparse.Namespace,
    sizes: dict,
    shapes: list[tuple[int, int]],
    emit: Callable[[results.Row], None],
) -> None:
    """stock vs llmsys (``apply_llmsys``) vs Liger-Kernel: bf16 autocast train steps with the
    loss from the model's forward, eager and compiled, each model alone on the device."""
    device, on_cuda = args.device, torch.device(args.device).type == "cuda"
    compile_choice = args.compile or ("both" if on_cuda else "off")
    compiled = {"off": [False], "on": [True], "both": [False, True]}[compile_choice]
    master = build_llama(sizes, "cpu", torch.float32).train()  # each case copies it to device
    params = sum(p.numel() for p in master.parameters())
    label = "" if args.quick or args.model == "0.85b" else f"{args.model} "  # in each row's case
    providers = [p for p in args.providers if p != "liger" or _liger() is not None]
    if len(providers) < len(args.providers):
        print("llama: liger-kernel is not installed; no Liger rows (pip install liger-kernel)")
    # eager cases first, compiled ones last: a run cut off early still compares like with like
    cases = [(p, s, c) for c in compiled for s in shapes for p in providers]
    for provider, (batch, tokens), use_compile in progress(
        cases, "llama training", lambda c: f"{c[0]} {c[1][0]}x{c[1][1]} compile={c[2]}"
    ):
        free_device_memory(device)
        if on_cuda:
            torch.cuda.reset_peak_memory_stats(device)
        mode = f"compiled/{args.compile_mode}" if use_compile else "eager"
        settings = (
            f"{params / 1e9:.2f}B params; bf16 autocast, fused AdamW, loss from labels=; "
            f"warmup={args.warmup} reps={args.reps}"
        )
        with kernels_of(provider, copy.deepcopy(master).to(device)) as model:
            call = torch.compile(model, mode=args.compile_mode) if use_compile else model
            optimizer = make_optimizer(model)
            data = torch.randint(0, sizes["vocab_size"], (batch, tokens), device=device)
            try:
                times = call_times_ms(
                    lambda: train_step(call, optimizer, data, device),
                    reps=args.reps,
                    warmup=args.warmup,
                    device=device,
                )
                memory = torch.cuda.max_memory_allocated(device) / 2**30 if on_cuda else None
            except torch.OutOfMemoryError:
                times, settings, memory = [math.nan], "OOM", None
            except Exception as error:  # a peer failing (Liger under torch.compile) is a result
                reason = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
                print(f"llama: {provider} {mode} failed: {reason}")
                times, settings, memory = [math.nan], f"failed: {reason}", None
            case = f"{label}{batch}x{tokens}"
            row = _row("llama/train-step", provider, mode, case, "bf16", times, batch * tokens,
                       settings, memory_gib=memory)  # fmt: skip
            # free the optimizer state and compiled graphs (the timed lambda's cells too)
            optimizer = call = data = None  # type: ignore[assignment]
        emit(row)
    if not args.largest_batch:
        return
    tokens = args.largest_batch
    for provider in progress(providers, "largest batch", str):
        free_device_memory(device)
        with kernels_of(provider, copy.deepcopy(master).to(device)) as model:
            batch = largest_batch(model, tokens, sizes["vocab_size"], device)
        emit(
            results.Row(
                kernel="llama/largest-batch", provider=provider, mode="eager",
                x=f"{label}{tokens} tokens", dtype="bf16", p20=batch, p50=batch, p80=batch,
                unit="sequences", throughput=batch * tokens, throughput_unit="tokens",
                config=f"{params / 1e9:.2f}B params; the largest batch whose train step fits, "
                "to within 1/8",
            )
        )  # fmt: skip


CURVES = (("stock", False), ("stock", True), ("llmsys", False), ("liger", False))


def loss_curves(
    args: argparse.Namespace, sizes: dict, emit: Callable[[results.Row], None], out: Path
) -> None:
    """Train each of ``CURVES`` from the same weights on one fixed batch for ``--curve-steps``
    steps; writes every step's loss to ``<out>/llama-loss-curve.csv`` and its plot, and emits one
    row per curve: the largest gap to stock eager's loss over the steps."""
    device = args.device
    batch, tokens = args.curve_shape
    steps = 8 if args.quick else args.curve_steps
    master = build_llama(sizes, "cpu", torch.float32).train()
    data = torch.randint(
        0, sizes["vocab_size"], (batch, tokens), generator=torch.Generator().manual_seed(0)
    ).to(device)
    curves: dict[str, list[float]] = {}
    for provider, use_compile in progress(CURVES, "loss curves", lambda c: f"{c[0]} {c[1]}"):
        if provider == "liger" and _liger() is None:
            continue
        name = f"{provider} {'compiled' if use_compile else 'eager'}"
        free_device_memory(device)
        with kernels_of(provider, copy.deepcopy(master).to(device)) as model:
            call = torch.compile(model, mode=args.compile_mode) if use_compile else model
            optimizer = make_optimizer(model)
            step_losses = [train_step(call, optimizer, data, device).detach() for _ in range(steps)]
            curves[name] = torch.stack(step_losses).float().tolist()
            optimizer = call = None  # type: ignore[assignment]  # (freed)
    reference = curves["stock eager"]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "llama-loss-curve.csv", "w") as file:
        file.write("step,curve,loss\n")
        for name, losses in curves.items():
            file.writelines(f"{i},{name},{loss!r}\n" for i, loss in enumerate(losses))
    for name, losses in curves.items():
        gaps = [abs(a - b) for a, b in zip(losses, reference, strict=True)]
        emit(
            results.Row(
                kernel="llama/loss-curve", provider=name, mode="train",
                x=f"{steps} steps {batch}x{tokens}", dtype="bf16", p20=min(gaps),
                p50=statistics.median(gaps), p80=max(gaps), unit="loss gap",
                config=f"largest gap to stock eager {max(gaps):.4f}; loss {losses[0]:.3f} -> "
                f"{losses[-1]:.3f}; one fixed batch, bf16 autocast, fused AdamW lr 1e-4",
            )
        )  # fmt: skip
    try:
        plot_curves(curves, out / "llama-loss-curve.png")
    except ImportError:
        print("llama: matplotlib is not installed; no loss-curve plot")


def plot_curves(curves: dict[str, list[float]], path: Path) -> Path:
    """The loss per step of each curve, and each curve's difference to stock eager."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4), layout="constrained")
    loss_ax, gap_ax = fig.subplots(1, 2)
    reference = curves["stock eager"]
    for name, losses in curves.items():
        loss_ax.plot(losses, label=name, linewidth=1)
        gap_ax.plot([a - b for a, b in zip(losses, reference, strict=True)], label=name)
    loss_ax.set(title="training loss, one fixed batch", xlabel="step", ylabel="loss")
    gap_ax.set(title="loss minus stock eager's", xlabel="step", ylabel="difference")
    loss_ax.legend(fontsize="small")
    fig.savefig(path, dpi=120)
    return path


def plot(rows: list[results.Row], path: Path) -> Path:
    """Speed-ups over the baseline provider, one bar per case: inference, then training."""
    from matplotlib.figure import Figure  # no pyplot: no global backend, renders with Agg

    panels = [
        ("int8 and int8-fused over fp16 (inference)", ("int8", "int8-fused")),
        ("llmsys over stock (training)", ("llmsys",)),
    ]
    fig = Figure(figsize=(13, 4), layout="constrained")
    for ax, (title, providers) in zip(fig.subplots(1, 2), panels, strict=True):
        shown = [r for r in rows if r.provider in providers and r.speedup_vs_baseline]
        labels = [
            f"{r.kernel.split('/')[1]}\n{r.x}\n{r.mode}"
            + (f"\n{r.provider}" if len(providers) > 1 else "")
            for r in shown
        ]
        speedups = [cast(float, r.speedup_vs_baseline) for r in shown]  # (shown: with one)
        ax.bar(range(len(shown)), speedups, color=["C2" if s >= 1 else "C3" for s in speedups])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(shown)), labels, fontsize="small")
        ax.set(title=title, ylabel="speed-up (median time ratio)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def run(args: argparse.Namespace) -> list[results.Row]:
    sizes = TINY if args.quick else MODELS[args.model]
    shapes = dict(SIZES["quick" if args.quick else "full"])
    if args.train_shape:
        shapes["train"] = args.train_shape
    gpu, stamp = results.device_name(args.device), results.timestamp()
    version = f"torch {torch.__version__}, transformers {_transformers().__version__}"
    rows: list[results.Row] = []
    out = Path(args.out)

    def emit(row: results.Row) -> None:
        row.gpu, row.timestamp, row.version = gpu, stamp, version
        rows.append(row)
        results.write_csv(rows, out / "llama.csv")

    torch.manual_seed(0)
    if "inference" in args.part:
        inference(args, sizes, shapes, emit)
        free_device_memory(args.device)
    if "training" in args.part:
        training(args, sizes, shapes["train"], emit)
    if "curve" in args.part:
        loss_curves(args, sizes, emit, out)
    _with_speedups([r for r in rows if r.kernel in ("llama/prefill", "llama/decode")], "fp16")
    _with_speedups([r for r in rows if r.kernel == "llama/train-step"], "stock")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("llama: matplotlib is not installed; no plot")
    else:
        print(f"wrote {plot(rows, out / 'llama.png')}")
    return rows
