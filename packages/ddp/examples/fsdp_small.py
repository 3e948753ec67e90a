"""Train the profiling package's small Transformer LM with FSDP, on 2 CPU ranks or 2 GPUs:

    torchrun --nproc-per-node 2 packages/ddp/examples/fsdp_small.py
    torchrun --nproc-per-node 2 packages/ddp/examples/fsdp_small.py --size tiny --steps 30

Each rank keeps half of every weight matrix, its gradient and its AdamW state; the layers are
gathered as they run. Every rank sees its own half of one fixed batch, so the loss falls fast.
At the end the full weights are gathered and checked to be the same on every rank.
"""

import argparse

import torch
import torch.distributed as dist

from llmsys.ddp import FSDP, init_distributed, local_device

try:
    from llmsys.profiling import training
    from llmsys.profiling.config import ModelConfig
    from llmsys.profiling.model import TransformerLM, num_parameters
except ModuleNotFoundError as error:  # the model comes from another package: say which
    raise SystemExit(
        f"fsdp_small.py needs llmsys-profiling ({error}); install llmsys-ddp with its [examples] "
        "extra, as its README's Install section shows"
    ) from None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0].rstrip(":") + ".",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--size", default="small", help="a profiling model size")
    parser.add_argument("--steps", type=int, default=20, help="training steps")
    parser.add_argument("--context-length", type=int, default=64, help="tokens per sequence")
    args = parser.parse_args()
    rank, world_size = init_distributed()  # NCCL with a GPU per rank, else gloo on the CPU
    device = local_device()
    config = ModelConfig.named(args.size, context_length=args.context_length, checkpoint=True)
    torch.manual_seed(rank)  # every rank starts differently; FSDP takes rank 0's weights
    model = TransformerLM(config, device=device)
    if rank == 0:
        print(f"{args.size}: {num_parameters(model) / 1e6:.1f}M parameters", flush=True)
    compute = torch.bfloat16 if device.type == "cuda" else None
    model = FSDP(model, compute_dtype=compute)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    data = torch.Generator().manual_seed(0)  # one global batch of 4, the same on every rank
    tokens = torch.randint(0, config.vocab_size, (4, args.context_length + 1), generator=data)
    mine = tokens[rank * 4 // world_size : (rank + 1) * 4 // world_size].to(device)
    for step in range(args.steps):
        loss = training.lm_loss(model(mine[:, :-1]), mine[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        model.finish_gradient_synchronization()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"rank {rank}/{world_size} step {step:2d} loss {loss.item():.4f}", flush=True)

    full = torch.cat([p.flatten() for p in model.gather_full_params().values()])
    if world_size > 1:  # every rank must hold the same full model
        first = full.clone()
        dist.broadcast(first, src=0)
        assert torch.equal(full, first), "ranks diverged"
        dist.destroy_process_group()
    print(f"rank {rank}: done, {full.numel() / 1e6:.1f}M parameters gathered")


if __name__ == "__main__":
    main()
