"""The smallest use of the package: one process, no torchrun (a world of one rank, so nothing is
sharded and nothing is sent), the same code that shards AdamW's state under torchrun."""

import torch

from llmsys.sharded_optim import ShardedOptimizer

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
x, y = torch.randn(64, 16), torch.randn(64, 1)
for step in range(5):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()  # under torchrun: DDP (or an all-reduce) averages the gradients here
    norm = optimizer.clip_grad_norm_(1.0)
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step}: loss {loss.item():.4f}, gradient norm {norm.item():.4f}")
optimizer.consolidate_state_dict(to=0)
saved = optimizer.state_dict()["state"]
print(f"ok: rank {optimizer.rank} of {optimizer.world_size}, state of {len(saved)} tensors saved")
