"""ZeRO stage 1 for ``torch.distributed``: each data-parallel rank keeps the optimizer state of
only the parameters it owns, steps them, and broadcasts them to the other ranks."""

from .optimizer import ShardedOptimizer
from .plan import ShardPlan, plan_shards

__version__ = "0.1.0"

__all__ = ["ShardPlan", "ShardedOptimizer", "__version__", "plan_shards"]
