"""Launch a compiled Triton kernel without ``JITFunction.run``'s per-call host cost."""

from .launcher import launch, runs_under_interpreter

__version__ = "0.2.0"

__all__ = ["__version__", "launch", "runs_under_interpreter"]
