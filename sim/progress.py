"""A progress bar for simulations that take more than a second (tqdm on stderr).

Hidden when `quiet` is set or stderr is not a terminal, and never drawn for work that finishes
within its 1 s delay, so scripted and piped use stays clean.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
QUIET = False  # set by the CLI's --quiet


def progress(items: Iterable[T], *, desc: str, total: int | None = None) -> Iterator[T]:
    if QUIET or not sys.stderr.isatty():
        yield from items
        return
    from tqdm import tqdm

    yield from tqdm(items, desc=desc, total=total, delay=1.0, leave=False, file=sys.stderr)
