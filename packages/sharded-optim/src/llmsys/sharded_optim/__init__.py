"""ZeRO stage 1 for ``torch.distributed``: each data-parallel rank keeps the optimizer state of
only the parameters it owns, steps them, and broadcasts them to the other ranks."""

from .optimizer import ShardedOptimizer
from .ownership import Ownership, assign_owners

__version__ = "0.1.0"

# The earlier names, kept for users.
ShardPlan = Ownership
plan_shards = assign_owners

__all__ = [
    "Ownership",
    "ShardPlan",
    "ShardedOptimizer",
    "__version__",
    "assign_owners",
    "plan_shards",
]
