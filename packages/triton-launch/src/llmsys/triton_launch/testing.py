"""A test helper for the kernel packages: capture a call in a CUDA graph and replay it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def replay_in_cuda_graph(fn: Callable, inputs: Sequence, fresh: Sequence):
    """Capture ``fn(*inputs)`` in a CUDA graph, copy ``fresh`` into the tensor ``inputs``, replay.

    ``fn`` runs once first on a side stream (compiling and tuning kernels, as
    ``torch.cuda.graph`` requires). The capture fails if ``fn`` synchronizes with the host.
    Returns the captured call's outputs after the replay: they were computed from ``fresh``.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn(*inputs)
    for static, value in zip(inputs, fresh, strict=True):
        if isinstance(static, torch.Tensor):
            static.copy_(value)
    graph.replay()
    torch.cuda.synchronize()
    return outputs
