"""A progress bar for simulations that take more than a second (tqdm on stderr).

Drawn only where a front end asks for bars (`showing_bars()`: the CLI, unless `--quiet`) and
stderr is a terminal, and never for work that finishes within its 1 s delay, so library calls,
workers, scripts and pipes stay clean. Whether bars are wanted is a context variable, set for
the extent of a `with`: no module state that one caller's run leaves behind for the next.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from typing import TypeVar

T = TypeVar("T")
_BARS: ContextVar[bool] = ContextVar("tpusim_progress_bars", default=False)


@contextlib.contextmanager
def showing_bars(on: bool = True) -> Iterator[None]:
    """Within the `with`, long loops draw a progress bar on a terminal (`on=False`: never)."""
    token = _BARS.set(on)
    try:
        yield
    finally:
        _BARS.reset(token)


def bars_wanted() -> bool:
    """Whether a bar may be drawn here: asked for, and stderr is a terminal."""
    return _BARS.get() and sys.stderr.isatty()


def progress(items: Iterable[T], *, desc: str, total: int | None = None) -> Iterator[T]:
    if not bars_wanted():
        yield from items
        return
    from tqdm import tqdm  # only when a bar is drawn: tqdm costs start-up time

    yield from tqdm(items, desc=desc, total=total, delay=1.0, leave=False, file=sys.stderr)
