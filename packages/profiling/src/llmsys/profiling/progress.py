"""A progress bar over a sweep's cases: tqdm when it is installed, else one line per case."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress(cases: Iterable[T], desc: str, label: Callable[[T], str] = str) -> Iterator[T]:
    """Yield ``cases`` while showing how far the sweep is and ``label(case)`` of the current one,
    from the moment it starts (on stderr, so stdout stays a table)."""
    cases = list(cases)
    try:
        from tqdm import tqdm
    except ImportError:
        for i, case in enumerate(cases, 1):
            print(f"{desc}: {i}/{len(cases)} {label(case)}", file=sys.stderr, flush=True)
            yield case
        return
    with tqdm(cases, desc=desc, unit="case", file=sys.stderr) as bar:
        for case in bar:
            bar.set_postfix_str(label(case))  # drawn now: a long case is named while it runs
            yield case
