"""One line: what this package does. Re-export the public API here and nothing else."""

__version__ = "0.1.0"

__all__ = ["__version__"]
