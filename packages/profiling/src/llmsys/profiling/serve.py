"""Serving a Hugging Face Llama: prefill and decode tokens per second, fp16 against int8.

    llmsys-bench serve --model 8b
    llmsys-bench serve --model 0.85b
    llmsys-bench serve --quick --device cpu     # a tiny Llama, eagerly: a smoke test

The model has random float16 weights from a config (``--model``: 8b is Llama-3.1-8B's shape, the
published serving anchors' model; 0.85b the llama subcommand's default) and SDPA attention.
Each provider is a copy of the same weights:

fp16            the model as transformers builds it
int8-fused      ``llmsys.hf.quantize_model`` (W8A8: weights per output channel, activations
                per token; q|k|v and gate|up one GEMM each, the quantization fused into
                RMSNorm and SiLU-and-mul)
int8-fused-kv8  int8-fused (the same quantized model) over an int8 KV cache at decode and
                generate (``llmsys.hf.kv_cache.Int8StaticCache``: int8 keys and values, a
                float32 scale per sequence, kv head and token; ``generate(kv_cache="int8")``);
                the others' caches are float16
torchao-int8    torchao's ``quantize_(model, Int8DynamicActivationInt8WeightConfig())``
torchao-float8  torchao's ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``,
                on a bfloat16 copy (torchao's float8 rowwise takes no float16 weights)

The torchao providers need torchao (an optional benchmark dependency); without it, or on a case
where a provider fails, its row says why instead of a time. Cases:

prefill BxT     one forward of B prompts of T tokens, no cache, the last token's logits
                (``--prefill``); tokens/s = B*T / time
decode B        one step of B sequences over a static KV cache holding ``--context`` tokens
                (``--decode``); tokens/s = B / time
generate B      ``llmsys.hf.generate`` from B prompts of ``--context`` tokens (``--generate``):
                the time per new token, from runs of two lengths (prefill and capture cancel)

Modes: ``eager``; ``cuda-graph``, the call captured once after warm-up and replayed (for
generate, its own graph of the decode step); for the providers in ``--compile``, ``compiled``
(each decoder layer under ``torch.compile(dynamic=False)``, PyTorch's regional compilation; a
transformers layer is specialised on its index, so each layer compiles once per shape) and, at
decode, ``compiled+graph`` (that, captured in a CUDA graph, as ``mode="reduce-overhead"`` does;
prefill is GPU-bound, where a graph gains nothing). torchao's providers run no CUDA graph: the
capture of their dynamic quantization is invalidated (measured on an H100), and a failed capture
leaves the process unable to capture again; their rows say so.

Speed-ups of prefill and decode are over fp16's fastest compiled or CUDA-graph mode; of
generate, over fp16 in the same mode. Times are medians of per-call CUDA-event times (generate:
host clock around each run), all providers of a case side by side in this one process. Writes
``<out>/serve.csv`` (after every case) and ``<out>/serve.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import math
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from llmsys.bench_harness import call_times_ms, cuda_graph, results
from llmsys.bench_harness.arguments import batch_by_tokens, non_negative_int, positive_int

from .llama import LLAMA, LLAMA_8B, TINY, _transformers, build_llama
from .progress import progress
from .training import synchronize

if TYPE_CHECKING:
    from transformers import PreTrainedModel  # an optional dependency: mypy reads it as Any

HELP = "a Hugging Face Llama served: prefill and decode tok/s, fp16 against int8 and torchao"
MODELS = {"8b": LLAMA_8B, "0.85b": LLAMA}
PROVIDERS = ("fp16", "int8-fused", "int8-fused-kv8", "torchao-int8", "torchao-float8")
KV_CACHES = {"int8-fused-kv8": "int8"}  # a provider's KV cache at decode and generate (else float)
SHARED = {"int8-fused-kv8": "int8-fused"}  # a provider served by another's model
SIZES = {  # the defaults of --prefill, --decode, --generate, --context and --generate-tokens
    "full": dict(prefill=[(1, 4096), (8, 512)], decode=[1, 8, 32], generate=[8], context=1024,
                 generate_tokens=32),
    "quick": dict(prefill=[(2, 16)], decode=[2], generate=[2], context=16, generate_tokens=3),
}  # fmt: skip
DTYPES = {"torchao-float8": "bfloat16"}  # the activations' and unquantized weights' dtype
GRAPH_MODES = ("cuda-graph", "compiled+graph")
NO_GRAPH = (
    "not run: capturing torchao's dynamic quantization in a CUDA graph is invalidated "
    "(cudaErrorStreamCaptureInvalidated, H100), and the failed capture leaves the process "
    "unable to capture again"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", choices=MODELS, default="8b", help="8b (Llama-3.1-8B's shape) or 0.85b"
    )
    parser.add_argument(
        "--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS), help="providers"
    )
    parser.add_argument(
        "--prefill",
        nargs="*",
        type=batch_by_tokens,
        help="prefill batches as BxT (default 1x4096 8x512, with --quick 2x16; none: --prefill "
        "alone)",
    )
    parser.add_argument(
        "--decode",
        nargs="*",
        type=positive_int,
        help="decode batch sizes (default 1 8 32, with --quick 2; none: --decode alone)",
    )
    parser.add_argument(
        "--generate",
        nargs="*",
        type=positive_int,
        help="generate batch sizes (default 8, with --quick 2; none: --generate alone)",
    )
    parser.add_argument(
        "--context",
        type=positive_int,
        help="tokens in the cache for decode and generate (default 1024, with --quick 16)",
    )
    parser.add_argument(
        "--generate-tokens",
        type=positive_int,
        help="new tokens by which generate's two runs differ (default 32, with --quick 3)",
    )
    parser.add_argument(
        "--compile",
        nargs="*",
        choices=PROVIDERS,
        default=["fp16"],
        help="providers also run compiled (CUDA only; none: --compile with no names)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a tiny Llama at tiny sizes (a smoke test)"
    )
    parser.add_argument("--warmup", type=non_negative_int, default=3, help="untimed calls per case")
    parser.add_argument("--reps", type=positive_int, default=10, help="timed calls per case")


def quantized(name: str, fp16: nn.Module) -> nn.Module:
    """A copy of ``fp16`` served by provider ``name`` (ImportError when torchao is missing)."""
    if name == "fp16":
        return fp16
    model = copy.deepcopy(fp16)
    if name == "torchao-float8":
        model = model.to(torch.bfloat16)
    if name in ("int8-fused", "int8-fused-kv8"):
        from llmsys.hf import quantize_model

        quantize_model(model)
        return model
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Int8DynamicActivationInt8WeightConfig,
        PerRow,
        quantize_,
    )

    if name == "torchao-int8":
        config = Int8DynamicActivationInt8WeightConfig()
    else:
        config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
    quantize_(model, config)
    return model


def allow_a_compile_per_layer() -> None:
    """Raise dynamo's recompile limits so every layer compiles at every shape: at decode a
    transformers layer is specialised on its index (its KV cache slot), 32 compiles a shape
    for the 8B model, where the default limit (8) leaves the rest of the layers eager."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 1024)
    limit = torch._dynamo.config.accumulated_recompile_limit
    torch._dynamo.config.accumulated_recompile_limit = max(limit, 4096)


@contextlib.contextmanager
def compiled_layers(model: PreTrainedModel) -> Iterator[PreTrainedModel]:
    """``model`` with each decoder layer under ``torch.compile(dynamic=False)``; eager again on
    leaving. The layers share one compiled graph (their weights are its inputs)."""
    layers = model.model.layers
    eager = list(layers)
    for i, layer in enumerate(eager):
        layers[i] = torch.compile(layer, dynamic=False)
    try:
        yield model
    finally:
        for i, layer in enumerate(eager):
            layers[i] = layer


def weight_gib(model: nn.Module) -> float:
    """GiB of ``model``'s parameters and buffers, each storage once; a tensor subclass (torchao's
    quantized weights) counts the tensors it is made of, not the float tensor it stands for."""
    storages: dict[int, int] = {}

    def add(t: torch.Tensor) -> None:
        if hasattr(t, "__tensor_flatten__"):
            names, _ = t.__tensor_flatten__()
            for name in names:
                add(getattr(t, name))
        else:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()

    for t in [*model.parameters(), *model.buffers()]:
        add(t)
    return sum(storages.values()) / 2**30


def _time_generate(
    model: PreTrainedModel,
    prompt: torch.Tensor,
    new: int,
    reps: int,
    graph: bool,
    device: torch.device | str,
    kv_cache: str = "float",
) -> list[float]:
    """Milliseconds per new token of ``generate``: runs of ``3`` and ``3 + new`` tokens taken
    in turns, each pair's difference over ``new`` (3: the capture and one replay in both)."""
    from llmsys.hf import generate

    def seconds(tokens: int) -> float:
        synchronize(device)
        start = time.perf_counter()
        generate(model, prompt, tokens, cuda_graph=graph, kv_cache=kv_cache)
        synchronize(device)
        return time.perf_counter() - start

    seconds(3 + new)  # warm-up
    times = [(seconds(3 + new) - seconds(3)) * 1e3 / new for _ in range(reps)]
    if statistics.median(times) <= 0:  # never a negative time: say the runs were too short
        raise RuntimeError(
            f"the runs' difference ({new} tokens) is within the timing noise: raise "
            "--generate-tokens or --reps"
        )
    return times


def run(args: argparse.Namespace) -> list[results.Row]:
    transformers = _transformers()
    device, on_cuda = args.device, torch.device(args.device).type == "cuda"
    sizes = TINY if args.quick else MODELS[args.model]
    default = SIZES["quick" if args.quick else "full"]

    def given(name: str) -> Any:
        value = getattr(args, name)
        return default[name] if value is None else value

    prefill, decode, gen = given("prefill"), given("decode"), given("generate")
    context, new = given("context"), given("generate_tokens")
    if gen and context + 3 + new > sizes["max_position_embeddings"]:  # only if generate runs
        raise SystemExit(f"--context {context} leaves no room for generate's tokens")
    if on_cuda:
        allow_a_compile_per_layer()
    gpu, stamp = results.device_name(device), results.timestamp()
    version = f"torch {torch.__version__}, transformers {transformers.__version__}"
    rows: list[results.Row] = []
    out = Path(args.out)

    def emit(row: results.Row) -> None:  # a run cut off keeps its rows and their speed-ups
        row.gpu, row.timestamp, row.version = gpu, stamp, version
        rows.append(row)
        _with_speedups(rows)
        results.write_csv(rows, out / "serve.csv")

    torch.manual_seed(0)
    fp16 = build_llama(sizes, device, torch.float16).eval()
    models: dict[str, nn.Module] = {}
    missing: dict[str, str] = {}
    for name in args.providers:
        try:
            if SHARED.get(name) in models:  # the same weights: one copy
                models[name] = models[SHARED[name]]
                continue
            with torch.no_grad():
                models[name] = quantized(name, fp16)
        except ImportError as error:
            missing[name] = f"not run: {error} (pip install torchao)"
        except Exception as error:  # torchao's float8 on a GPU without float8, say
            missing[name] = f"not run: quantizing failed: {type(error).__name__}: {error}"
    label = (
        f"{sum(p.numel() for p in fp16.parameters()) / 1e9:.2f}B params, "
        f"{sizes['num_hidden_layers']} layers, float16, SDPA"
    )

    def modes(name: str, phase: str) -> list[str]:
        if not on_cuda:
            return ["eager"]
        graph = [] if name.startswith("torchao") else ["cuda-graph"]
        compiled = ["compiled"] if name in args.compile else []
        if compiled and graph and phase == "decode":
            compiled.append("compiled+graph")
        return ["eager", *graph, *compiled]

    cases = [("prefill", shape) for shape in prefill] + [("decode", b) for b in decode]
    cases += [("generate", b) for b in gen]
    for phase, size in progress(cases, "serve", lambda c: f"{c[0]} {c[1]}"):
        x = _case(phase, size, context)
        for name in args.providers:
            if name in missing:
                emit(_failed(phase, name, "-", x, missing[name]))
                continue
            model = models[name]
            kv_cache = KV_CACHES.get(name, "float")
            settings = f"{label}; {name}, weights {weight_gib(model):.2f} GiB"
            if phase != "prefill":
                float_cache = DTYPES.get(name, "float16")  # the model's dtype
                settings += f", KV cache {'int8' if kv_cache == 'int8' else float_cache}"
            if name.startswith("torchao") and on_cuda:
                emit(_failed(phase, name, "cuda-graph", x, NO_GRAPH))
            for mode in modes(name, phase):
                if phase != "generate":
                    emit(_step_row(model, name, phase, mode, size, x, context, args, settings,
                                   kv_cache))  # fmt: skip
                elif mode in ("eager", "cuda-graph"):  # generate captures its own graph
                    emit(_generate_row(model, name, mode, size, x, context, new, args, settings,
                                       kv_cache))  # fmt: skip
                gc.collect()  # the case's CUDA graph and its memory pool (compiled code stays)
                if on_cuda:
                    torch.cuda.empty_cache()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("serve: matplotlib is not installed; no plot")
    else:
        if rows:
            print(f"wrote {plot(rows, out / 'serve.png')}")
    return rows


def _case(phase: str, size: Any, context: int) -> str:  # size: (B, T) for prefill, else B
    """The CSV's ``x`` of a case: ``BxT`` (prefill), else the batch and the cached tokens."""
    if phase == "prefill":
        return f"{size[0]}x{size[1]}"
    return f"batch {size}, {'context' if phase == 'decode' else 'prompt'} {context}"


def _step_row(
    model: PreTrainedModel,
    name: str,
    phase: str,
    mode: str,
    size: Any,
    x: str,
    context: int,
    args: argparse.Namespace,
    settings: str,
    kv_cache: str = "float",
) -> results.Row:
    """One prefill or decode case of one provider in one mode, timed (decode over a
    ``kv_cache`` cache: "float" or "int8")."""
    device, vocab = args.device, model.config.vocab_size
    generator = torch.Generator(device).manual_seed(1)
    settings += f"; warmup={args.warmup} reps={args.reps}"
    try:
        with torch.no_grad():
            if phase == "prefill":
                batch, tokens = size
                ids = torch.randint(0, vocab, size, device=device, generator=generator)

                def fn() -> Any:
                    return model(ids, use_cache=False, logits_to_keep=1)

                done = batch * tokens
            else:  # the cache filled eagerly, outside the compiled layers (no extra shape)
                room = args.warmup + args.reps + 8
                fn = decode_step(model, size, context, room=room, kv_cache=kv_cache)
                done = size

            with compiled_layers(model) if mode.startswith("compiled") else nullcontext():
                if mode in GRAPH_MODES:
                    fn = cuda_graph(fn)
                times = call_times_ms(fn, reps=args.reps, warmup=args.warmup, device=device)
    except Exception as error:  # a provider that fails on a case is a result too
        return _failed(phase, name, mode, x, _why(settings, error, device))
    return _row(phase, name, mode, x, times, done, settings)


def decode_step(
    model: PreTrainedModel, batch: int, context: int, room: int, kv_cache: str = "float"
) -> Callable[[], object]:
    """One decode step of ``batch`` sequences over a static KV cache filled with ``context``
    random tokens, with ``room`` slots more (newer transformers advance the cache on every
    call, so each call needs one): a ``transformers.StaticCache``, or with ``kv_cache="int8"``
    an ``llmsys.hf.kv_cache.Int8StaticCache`` (which only llmsys' attention reads)."""
    from llmsys.hf import cached_forward

    cache_class: Any = _transformers().StaticCache
    if kv_cache == "int8":
        from llmsys.hf.kv_cache import Int8StaticCache

        cache_class = Int8StaticCache
    cache = cache_class(config=model.config, max_cache_len=context + room)
    call = cached_forward(model, cache)
    device = next(model.parameters()).device
    history = torch.randint(0, model.config.vocab_size, (batch, context), device=device)
    call(history, torch.arange(context, device=device).expand(batch, context), logits_to_keep=1)
    token = history[:, -1:].clone()
    position = torch.full((batch, 1), context, device=device)
    return lambda: call(token, position)


def _generate_row(
    model: PreTrainedModel,
    name: str,
    mode: str,
    batch: int,
    x: str,
    context: int,
    new: int,
    args: argparse.Namespace,
    settings: str,
    kv_cache: str = "float",
) -> results.Row:
    reps = min(args.reps, 4)
    settings += f"; runs of 3 and {3 + new} new tokens, {reps} pairs"
    ids = torch.randint(0, model.config.vocab_size, (batch, context), device=args.device)
    try:
        with torch.no_grad():
            graph = mode == "cuda-graph"
            times = _time_generate(model, ids, new, reps, graph, args.device, kv_cache)
    except Exception as error:
        return _failed("generate", name, mode, x, _why(settings, error, args.device))
    return _row("generate", name, mode, x, times, batch, settings)


def _row(
    phase: str, name: str, mode: str, x: str, times: list[float], tokens: int, settings: str
) -> results.Row:
    p20, p50, p80 = results.quantiles(times)
    return results.Row(
        kernel=f"serve/{phase}", provider=name, mode=mode, x=x,
        dtype=DTYPES.get(name, "float16"), p20=p20, p50=p50, p80=p80,
        throughput=tokens / (p50 / 1e3), throughput_unit="tok/s", config=settings,
    )  # fmt: skip


def _why(settings: str, error: Exception, device: torch.device | str) -> str:
    """The row's note for a case that raised ``error`` (the device drained first, so the next
    case starts clean)."""
    synchronize(device)
    first = (str(error).strip().splitlines() or [""])[0]
    return f"{settings}; failed: {type(error).__name__}: {first}"


def _failed(phase: str, name: str, mode: str, x: str, why: str) -> results.Row:
    return results.Row(
        kernel=f"serve/{phase}", provider=name, mode=mode, x=x,
        dtype=DTYPES.get(name, "float16"), p20=math.nan, p50=math.nan, p80=math.nan,
        config=why[:400],
    )  # fmt: skip


def _with_speedups(rows: list[results.Row]) -> None:
    """Prefill and decode over fp16's fastest compiled or CUDA-graph row of the case (its eager
    row where it has no other); generate over fp16 in the same mode."""
    timed = [r for r in rows if r.provider == "fp16" and not math.isnan(r.p50)]
    for r in rows:
        if math.isnan(r.p50):
            continue
        same = [b for b in timed if (b.kernel, b.x) == (r.kernel, r.x)]
        if r.kernel == "serve/generate":
            same = [b for b in same if b.mode == r.mode]
        else:
            same = [b for b in same if b.mode != "eager"] or same
        if same:
            r.speedup_vs_baseline = min(b.p50 for b in same) / r.p50


def plot(rows: list[results.Row], path: Path) -> Path:
    """Speed-ups over the fp16 baseline: one panel per phase, a bar per case, mode and
    provider."""
    from matplotlib.figure import Figure  # no pyplot: no global backend, renders with Agg

    kinds = {r.kernel for r in rows}
    phases = [p for p in ("serve/prefill", "serve/decode", "serve/generate") if p in kinds]
    providers = list(dict.fromkeys(r.provider for r in rows))
    fig = Figure(figsize=(5 * len(phases), 4.5), layout="constrained")
    for ax, phase in zip(fig.subplots(1, len(phases), squeeze=False)[0], phases, strict=True):
        shown = [r for r in rows if r.kernel == phase and r.speedup_vs_baseline]
        groups = list(dict.fromkeys((r.x, r.mode) for r in shown))
        width = 0.8 / max(len(providers), 1)
        for k, provider in enumerate(providers):
            mine = {(r.x, r.mode): r.speedup_vs_baseline for r in shown if r.provider == provider}
            xs = [i + k * width for i, g in enumerate(groups) if g in mine]
            ax.bar(xs, [mine[g] for g in groups if g in mine], width, label=provider)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ticks = [f"{x}\n{mode}" for x, mode in groups]
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], ticks, fontsize="x-small")
        ax.tick_params(axis="x", labelrotation=60)
        ax.set(title=phase.split("/")[1], ylabel="speed-up over fp16 (median time ratio)")
    handles, labels = fig.axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside upper center", ncols=len(labels), fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
