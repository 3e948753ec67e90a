"""Train a small model with DDPBucketed: `python smallest.py` (one process) or, on 2 CPU ranks,

    torchrun --nproc-per-node 2 smallest.py

Each rank trains on its own slice of every batch; the gradients are averaged, so every rank
takes the step one process would take on the whole batch and the copies stay identical.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from llmsys.ddp import DDPBucketed, init_distributed, local_device


def main() -> None:
    rank, world_size = init_distributed()  # NCCL with a GPU per rank, else gloo on the CPU
    device = local_device()
    torch.manual_seed(rank)  # every rank starts differently; the wrapper takes rank 0's weights
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1)).to(device)
    model = DDPBucketed(model, bucket_size_mb=0.01)  # small buckets, so there are several
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    data = torch.Generator().manual_seed(0)  # the same global batches on every rank
    true_weights = torch.randn(32, 1, generator=data)
    for step in range(60):
        x = torch.randn(64, 32, generator=data)
        y = x @ true_weights
        mine = slice(rank * 64 // world_size, (rank + 1) * 64 // world_size)
        loss = F.mse_loss(model(x[mine].to(device)), y[mine].to(device))
        optimizer.zero_grad()
        loss.backward()
        model.finish_gradient_synchronization()
        optimizer.step()
        if rank == 0 and (step % 20 == 0 or step == 59):
            print(f"rank {rank}/{world_size} step {step:2d} loss {loss.item():.4f}", flush=True)

    if world_size > 1:  # every rank must hold the same weights after training
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        first = flat.clone()
        dist.broadcast(first, src=0)
        assert torch.equal(flat, first), "ranks diverged"
        dist.destroy_process_group()
    print(f"rank {rank}: done, {len(model.buckets)} buckets")


if __name__ == "__main__":
    main()
