"""The smallest use of the package: `python smallest.py` (one process: a world of one rank, so
nothing is sharded and nothing is sent) or, sharding AdamW's state over 2 CPU ranks,

    torchrun --nproc-per-node 2 smallest.py
"""

import os

import torch
import torch.distributed as dist

from llmsys.sharded_optim import ShardedOptimizer

if "RANK" in os.environ and not dist.is_initialized():  # started by torchrun: join its group
    dist.init_process_group("gloo")
torch.manual_seed(0)  # the same model on every rank
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
x, y = torch.randn(64, 16), torch.randn(64, 1)
for step in range(5):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    if dist.is_initialized():  # average the gradients across ranks (DDP would do this)
        for p in model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
    norm = optimizer.clip_grad_norm_(1.0)
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step}: loss {loss.item():.4f}, gradient norm {norm.item():.4f}")
owned = len(optimizer.state)  # before consolidating: this rank's shard
optimizer.consolidate_state_dict(to=0)  # every rank takes part; rank 0 receives the whole state
print(f"ok: rank {optimizer.rank} of {optimizer.world_size}, owns the state of {owned} tensors")
if optimizer.rank == 0:
    saved = optimizer.state_dict()["state"]
    print(f"rank 0 consolidated the state of {len(saved)} tensors")
if dist.is_initialized():
    dist.destroy_process_group()
