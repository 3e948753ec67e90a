"""argparse types for every llmsys command line: ``type=positive_int`` and the like.

A type refuses a bad value with ``argparse.ArgumentTypeError``, and argparse prints it after the
option's name (``argument --steps: must be a positive integer, got '0'``) and exits with status 2,
before anything runs. ``llmsys-bench``, ``llmsys-roofline``, ``sweep_arguments`` and the packages'
``benchmarks/*.py`` all take their types from here.
"""

from __future__ import annotations

import argparse
import math

import torch

__all__ = [
    "batch_by_tokens",
    "device",
    "non_negative_float",
    "non_negative_int",
    "positive_float",
    "positive_int",
]


def positive_int(text: str) -> int:
    """An int >= 1.

    Raises:
        argparse.ArgumentTypeError: ``text`` is an int below 1.
    """
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """An int >= 0.

    Raises:
        argparse.ArgumentTypeError: ``text`` is a negative int.
    """
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (NaN is refused too).

    Raises:
        argparse.ArgumentTypeError: ``text`` is a number that is not finite and > 0.
    """
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0.

    Raises:
        argparse.ArgumentTypeError: ``text`` is a number that is not finite and >= 0.
    """
    value = float(text)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def batch_by_tokens(text: str) -> tuple[int, int]:
    """A batch as ``BxT`` (sequences x tokens), both >= 1.

    Raises:
        argparse.ArgumentTypeError: ``text`` is not ``BxT`` with both >= 1.
    """
    try:
        batch, tokens = (int(n) for n in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be BxT, like 8x512; got {text!r}") from None
    if batch < 1 or tokens < 1:
        raise argparse.ArgumentTypeError(f"needs B and T >= 1, got {text!r}")
    return batch, tokens


def device(text: str) -> str:
    """A device this machine can run a benchmark on: ``cpu``, or ``cuda``/``cuda:N`` where there
    are more than N GPUs (``meta``, another device type or a GPU that is not there is refused
    here, not by the first tensor made on it). Returns ``text`` as given.

    Raises:
        argparse.ArgumentTypeError: ``text`` is not such a device.
    """
    try:
        parsed = torch.device(text)
    except (RuntimeError, TypeError):
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got {text!r}")
    if parsed.type == "cuda":
        count = torch.cuda.device_count()
        if count == 0:
            raise argparse.ArgumentTypeError(f"{text!r} needs a CUDA GPU, and there is none")
        if parsed.index is not None and parsed.index >= count:
            raise argparse.ArgumentTypeError(
                f"{text!r} needs GPU {parsed.index}, and there are {count}"
            )
    return text
