"""llmsys-roofline: estimate before you measure.

    llmsys-roofline hardware  # H100 (the SXM part), H100 PCIe, H100 NVL, H200, B200, A100, A10
    llmsys-roofline linear --tokens 512 --in 4096 --out 8192 512 512 \\
        --bandwidth-tbs 2.4 --tflops 800 --min-kernel-us 10
    llmsys-roofline elementwise --shape 64 8192 8192 --bandwidth-tbs 2.4 --tflops 800
    llmsys-roofline attention --batch 8 --heads 32 --kv-heads 8 --q-len 1 --kv-len 4096  # decode
    llmsys-roofline collective all-reduce --mb 100 --gpus-per-node 8 --nodes 4  # ring and tree
    llmsys-roofline memory --ffn 16384 53248 126 --policy fp32-adamw --strategy fsdp --devices 1 38
    llmsys-roofline min-devices --ffn 16384 53248 126 --policy fp32-adamw --budget-gb 95
    llmsys-roofline hiding --size xl --strategy fsdp --gpus-per-node 8
    llmsys-roofline check packages/ddp/benchmarks/results/h200.csv \\
        packages/profiling/benchmarks/results/h100.csv  # from the repo root

Hardware is a built-in spec (`--gpu`, default H100: the SXM part; `hardware` lists them with
their sources) or your own (`--bandwidth-tbs` and `--tflops`, with `--min-kernel-us`); units are
decimal (1 TB/s = 1e12 bytes/s, 1 GB = 1e9 bytes) and times print in microseconds. `--help` on
each subcommand lists its options. The package README gives these same examples.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable

from llmsys.bench_harness.arguments import (
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)

from .config import SIZES, ModelConfig
from .infra import collectives, memory_model, roofline, roofline_check
from .infra.hardware import GB, HARDWARE, TB, TFLOPS, US, HardwareSpec, lookup


def _hardware_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("hardware")
    group.add_argument(
        "--gpu",
        help=f"built-in spec, one of {', '.join(HARDWARE)}, or a name containing one"
        " (default H100, the SXM part)",
    )
    rate, time = positive_float, non_negative_float
    group.add_argument("--bandwidth-tbs", type=rate, help="your own: memory bandwidth, TB/s")
    group.add_argument("--tflops", type=rate, help="your own: FLOP/s for every precision, TFLOP/s")
    group.add_argument("--min-kernel-us", type=time, help="minimum kernel time, us")
    group.add_argument("--nvlink-gbs", type=rate, help="NVLink GB/s per direction")
    group.add_argument("--network-gbs", type=rate, help="network GB/s per GPU and direction")
    group.add_argument("--latency-us", type=time, help="latency per collective step, us")


def _hardware(args: argparse.Namespace) -> HardwareSpec:
    custom = args.bandwidth_tbs is not None or args.tflops is not None
    if custom and (args.bandwidth_tbs is None or args.tflops is None):
        raise ValueError("your own hardware needs both --bandwidth-tbs and --tflops")
    if custom:
        spec = HardwareSpec.custom(
            "custom", memory_bandwidth=args.bandwidth_tbs * TB, flops=args.tflops * TFLOPS
        )
    else:
        spec = lookup(args.gpu or "H100")
    changes = {}
    if args.min_kernel_us is not None:
        changes["min_kernel_time"] = args.min_kernel_us * US
    if args.nvlink_gbs is not None:
        changes["nvlink_bandwidth"] = args.nvlink_gbs * GB
    if args.network_gbs is not None:
        changes["network_bandwidth"] = args.network_gbs * GB
    if args.latency_us is not None:
        changes["nvlink_latency"] = changes["network_latency"] = args.latency_us * US
    return spec.replace(**changes) if changes else spec


def _print_costs(costs: list[roofline.OpCost]) -> None:
    print("| op | FLOPs | bytes | FLOP/byte | compute us | memory us | time us | bound |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for c in costs:
        print(
            f"| {c.name} | {c.flops:.4g} | {c.bytes:.4g} | {c.intensity:.4g} | "
            f"{c.compute_time / US:.4g} | {c.memory_time / US:.4g} | {c.time / US:.4g} | "
            f"{c.bound} |"
        )
    if len(costs) > 1:
        print(f"\ntotal: {roofline.total_time(costs) / US:.4g} us")


def _shape(args: argparse.Namespace) -> memory_model.ModelShape:
    if args.ffn:
        return memory_model.ffn_only(*args.ffn)
    return memory_model.from_config(ModelConfig.named(args.size, context_length=args.context))


def _shape_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--size", default="small", choices=list(SIZES), help="a ModelConfig size")
    group.add_argument(
        "--context", type=positive_int, default=1024, help="context length (default 1024)"
    )
    group.add_argument(
        "--ffn", type=positive_int, nargs=3, metavar=("D_MODEL", "D_FF", "LAYERS"),
        help="an FFN-only model instead of --size",
    )  # fmt: skip
    group.add_argument(
        "--policy", default="mixed-adamw", choices=list(memory_model.POLICIES),
        help="dtypes: mixed-adamw (bf16 weights and grads, fp32 master and AdamW) or "
        "fp32-adamw (fp32 weights, grads and AdamW); bf16 activations",
    )  # fmt: skip


def _memory_arguments(parser: argparse.ArgumentParser) -> None:
    _shape_arguments(parser)
    parser.add_argument("--strategy", default="fsdp", choices=memory_model.STRATEGIES)
    parser.add_argument(
        "--tokens-per-device",
        type=non_negative_int,
        default=0,
        help="micro-batch tokens per device for activations (default 0: none)",
    )
    parser.add_argument("--checkpointing", action="store_true", help="per-layer checkpointing")


def cmd_hardware(args: argparse.Namespace) -> None:
    chosen = args.gpu or args.bandwidth_tbs is not None or args.tflops is not None
    specs = [_hardware(args)] if chosen else list(HARDWARE.values())
    print("| gpu | HBM TB/s | bf16 TFLOP/s | tf32 | fp32 | memory GB | SMs | L2 MB | L1 KB/SM "
          "| NVLink GB/s/dir | host link | source |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")

    def num(value: float | None, scale: float = 1.0) -> str:
        return "" if value is None else f"{value / scale:g}"

    for s in specs:
        peaks = [num(s.matmul_flops.get(p), TFLOPS) for p in ("bf16", "tf32", "fp32")]
        print(
            f"| {s.name} | {s.memory_bandwidth / TB:g} | {' | '.join(peaks)} | "
            f"{num(s.memory_capacity, GB)} | {num(s.sm_count)} | {num(s.l2_bytes, 1e6)} | "
            f"{num(s.l1_bytes_per_sm, 1e3)} | {num(s.nvlink_bandwidth, GB)} | "
            f"{s.host_link} {s.host_link_bandwidth / GB:g} GB/s/dir | {s.source} |"
        )


def cmd_matmul(args: argparse.Namespace) -> None:
    _print_costs([roofline.matmul(args.m, args.n, args.k, _hardware(args), args.dtype)])


def cmd_linear(args: argparse.Namespace) -> None:
    hw = _hardware(args)
    _print_costs([roofline.linear(args.tokens, args.inp, o, hw, args.dtype) for o in args.outs])


def cmd_elementwise(args: argparse.Namespace) -> None:
    hw = _hardware(args)
    elements = math.prod(args.shape)
    if args.reduce_to is not None:
        cost = roofline.reduction(elements, hw, args.dtype, out_elements=args.reduce_to,
                                  flops_per_element=args.flops_per_element)  # fmt: skip
    else:
        cost = roofline.elementwise(
            elements, hw, args.dtype, inputs=args.inputs, outputs=args.outputs,
            flops_per_element=args.flops_per_element,
        )  # fmt: skip
    _print_costs([cost])


def cmd_attention(args: argparse.Namespace) -> None:
    cost = roofline.attention(
        args.batch, args.heads, args.q_len, args.kv_len or args.q_len, args.head_dim,
        _hardware(args), args.dtype, kv_heads=args.kv_heads, causal=not args.no_causal,
    )  # fmt: skip
    _print_costs([cost])


def cmd_h2d(args: argparse.Namespace) -> None:
    _print_costs([roofline.host_to_device(args.mb * 1e6, _hardware(args))])


def cmd_collective(args: argparse.Namespace) -> None:
    hw = _hardware(args)
    nbytes, ranks = args.mb * 1e6, args.gpus_per_node * args.nodes
    print("| collective | algorithm | ranks | layout | MB | time us | busbw GB/s |")
    print("|---|---|---:|---|---:|---:|---:|")
    for algorithm in args.algorithm:
        seconds = collectives.collective_time(
            args.collective, nbytes, hw, gpus_per_node=args.gpus_per_node, nodes=args.nodes,
            algorithm=algorithm,
        )  # fmt: skip
        busbw = collectives.bus_bandwidth(args.collective, nbytes, ranks, seconds) if seconds else 0
        layout = f"{args.nodes} x {args.gpus_per_node}" + (
            " hierarchical" if args.nodes > 1 else ""
        )
        print(f"| {args.collective} | {algorithm} | {ranks} | {layout} | {args.mb:g} | "
              f"{seconds / US:.4g} | {busbw / GB:.4g} |")  # fmt: skip


def cmd_memory(args: argparse.Namespace) -> None:
    shape, policy = _shape(args), memory_model.POLICIES[args.policy]
    print(f"{shape.name}: {shape.num_params:,} parameters; {args.policy}; {args.strategy}; "
          f"{args.tokens_per_device} tokens/device"
          + ("; activation checkpointing" if args.checkpointing else ""))  # fmt: skip
    print("\n| devices | params | grads | master | optimizer | state | activations | gathered "
          "| total |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in args.devices:
        e = memory_model.training_memory(
            shape, policy, args.strategy, n, tokens_per_device=args.tokens_per_device,
            checkpointing=args.checkpointing,
        )  # fmt: skip
        parts = (e.params, e.grads, e.master, e.optimizer, e.state, e.activations, e.gathered)
        cells = " | ".join(memory_model.fmt_bytes(p) for p in (*parts, e.total))
        print(f"| {n} | {cells} |")


def cmd_min_devices(args: argparse.Namespace) -> None:
    shape, policy = _shape(args), memory_model.POLICIES[args.policy]
    n = memory_model.min_devices(
        shape, args.budget_gb * GB, policy, args.strategy, tokens_per_device=args.tokens_per_device,
        checkpointing=args.checkpointing, include=args.include,
    )  # fmt: skip
    what = f"{args.include} of {shape.name} ({args.policy}, {args.strategy})"
    if n is None:
        print(f"{what}: no device count fits {args.budget_gb:g} GB per device")
        return
    e = memory_model.training_memory(
        shape, policy, args.strategy, n, tokens_per_device=args.tokens_per_device,
        checkpointing=args.checkpointing,
    )  # fmt: skip
    per_device = memory_model.fmt_bytes(getattr(e, args.include))
    print(f"{what}: {n} devices, {per_device} per device (budget {args.budget_gb:g} GB)")


def cmd_hiding(args: argparse.Namespace) -> None:
    shape, policy, hw = _shape(args), memory_model.POLICIES[args.policy], _hardware(args)
    tokens = memory_model.hiding_tokens(
        shape, hw, args.strategy, gpus_per_node=args.gpus_per_node, nodes=args.nodes,
        policy=policy,
    )  # fmt: skip
    where = f"{args.strategy} over {args.nodes} x {args.gpus_per_node} {hw.name}"
    if tokens is None:
        print(f"{shape.name}, {where}: communication never hides behind compute")
        return
    batch = math.ceil(tokens / args.context)
    print(f"{shape.name}, {where}: communication hides from {math.ceil(tokens):,} tokens per "
          f"device, a batch of {batch} at context {args.context}")  # fmt: skip


def cmd_check(args: argparse.Namespace) -> None:
    for path in args.csv:
        checks = roofline_check.check(path)
        flagged = sum(c.flagged for c in checks)
        print(f"## {path}: {len(checks)} rows modelled, {flagged} more than "
              f"{roofline_check.FLAG_RATIO:g}x off\n")  # fmt: skip
        print(roofline_check.markdown(checks) + "\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmsys-roofline",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")

    def add(
        name: str,
        func: Callable[[argparse.Namespace], object],
        help: str,
        hardware: bool = True,
    ) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help)
        sub.set_defaults(func=func)
        if hardware:
            _hardware_arguments(sub)
        return sub

    dtypes = list(roofline.MATMUL_PRECISION)
    sub = add("hardware", cmd_hardware, "the built-in GPU specs and their sources")
    sub = add("matmul", cmd_matmul, "C = A @ B with A (m, k) and B (k, n)")
    for dim in ("m", "n", "k"):
        sub.add_argument(f"-{dim}", type=positive_int, required=True)
    sub.add_argument("--dtype", default="bf16", choices=dtypes)
    sub = add("linear", cmd_linear, "Linear layers (no bias) applied to x (tokens, in)")
    sub.add_argument("--tokens", type=positive_int, required=True, help="rows of x")
    sub.add_argument("--in", dest="inp", type=positive_int, required=True, help="in_features")
    sub.add_argument(
        "--out",
        dest="outs",
        type=positive_int,
        nargs="+",
        required=True,
        help="out_features, one per layer (several: one kernel each, summed)",
    )
    sub.add_argument("--dtype", default="bf16", choices=dtypes)
    sub = add("elementwise", cmd_elementwise, "an elementwise op or a reduction")
    sub.add_argument("--shape", type=positive_int, nargs="+", required=True, help="tensor shape")
    sub.add_argument("--inputs", type=non_negative_int, default=1, help="tensors read (default 1)")
    sub.add_argument(
        "--outputs", type=non_negative_int, default=1, help="tensors written (default 1)"
    )
    sub.add_argument("--flops-per-element", type=non_negative_float, default=1.0)
    sub.add_argument(
        "--reduce-to", type=positive_int, help="a reduction to this many outputs instead"
    )
    sub.add_argument("--dtype", default="bf16", choices=list(roofline.DTYPE_BYTES))
    sub = add("attention", cmd_attention, "a FlashAttention forward: prefill or decode")
    sub.add_argument("--batch", type=positive_int, default=1)
    sub.add_argument("--heads", type=positive_int, required=True)
    sub.add_argument("--kv-heads", type=positive_int, help="key/value heads (default --heads)")
    sub.add_argument("--q-len", type=positive_int, required=True, help="1 for decode")
    sub.add_argument("--kv-len", type=positive_int, help="keys (default --q-len: prefill)")
    sub.add_argument("--head-dim", type=positive_int, default=128)
    sub.add_argument("--no-causal", action="store_true")
    sub.add_argument("--dtype", default="bf16", choices=dtypes)
    sub = add("h2d", cmd_h2d, "a pinned host-to-device copy")
    sub.add_argument("--mb", type=positive_float, required=True, help="megabytes (1e6 bytes)")
    sub = add("collective", cmd_collective, "a collective with the alpha-beta model")
    sub.add_argument("collective", choices=collectives.COLLECTIVES)
    sub.add_argument(
        "--mb", type=positive_float, required=True, help="tensor megabytes (1e6 bytes)"
    )
    sub.add_argument("--gpus-per-node", type=positive_int, default=8)
    sub.add_argument("--nodes", type=positive_int, default=1)
    sub.add_argument("--algorithm", nargs="+", default=list(collectives.ALGORITHMS),
                     choices=collectives.ALGORITHMS)  # fmt: skip
    sub = add("memory", cmd_memory, "training memory per device", hardware=False)
    _memory_arguments(sub)
    sub.add_argument("--devices", type=positive_int, nargs="+", default=[1])
    sub = add("min-devices", cmd_min_devices, "the fewest devices that fit a budget", False)
    _memory_arguments(sub)
    sub.add_argument(
        "--budget-gb", type=positive_float, required=True, help="GB (1e9 bytes) per device"
    )
    sub.add_argument("--include", default="state", choices=("state", "total"),
                     help="model state only (default) or also activations")  # fmt: skip
    sub = add("hiding", cmd_hiding, "the per-device batch at which FSDP/TP communication hides")
    _shape_arguments(sub)
    sub.add_argument("--strategy", default="fsdp", choices=("fsdp", "zero3", "tp"))
    sub.add_argument("--gpus-per-node", type=positive_int, default=8)
    sub.add_argument("--nodes", type=positive_int, default=1)
    sub = add("check", cmd_check, "predicted vs measured for a results CSV", hardware=False)
    sub.add_argument("csv", nargs="+", help="results CSVs in the shared schema")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except (ValueError, OSError) as error:
        parser.exit(2, f"llmsys-roofline {args.command}: error: {error}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
