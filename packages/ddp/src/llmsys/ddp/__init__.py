"""Data-parallel training on torch.distributed: from one all-reduce per parameter to bucketed
overlap.

    from llmsys.ddp import DDPBucketed, init_distributed
    init_distributed()                        # torchrun's environment; a plain run is rank 0 of 1
    model = DDPBucketed(model, bucket_size_mb=25.0)
    loss_fn(model(x), y).backward()
    model.finish_gradient_synchronization()   # gradients now hold the mean over ranks
    optimizer.step()
"""

from .base import DataParallel, DataParallelBase
from .buckets import group_buckets, plan_buckets
from .fsdp import FSDP
from .process_group import init_distributed, local_device, rank_and_world_size
from .wrappers import DDPBucketed, DDPFlat, DDPIndividualParameters, DDPNaive

__version__ = "0.2.0"

__all__ = [
    "FSDP",
    "DDPBucketed",
    "DDPFlat",
    "DDPIndividualParameters",
    "DDPNaive",
    "DataParallel",
    "DataParallelBase",
    "__version__",
    "group_buckets",
    "init_distributed",
    "local_device",
    "plan_buckets",
    "rank_and_world_size",
]
