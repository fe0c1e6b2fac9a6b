"""The `tpusim` command's progress callback: each task's updates as a tqdm bar on stderr.

Set for a command's run by `sim.cli.dispatch` when stderr is a terminal and `--quiet` is not
given (never otherwise: a pipe, a file, a script and `--json` consumers see nothing of it; the
bars never touch stdout). Bars appear only once the command has run for `delay_s` (1 s; the
environment variable `TPUSIM_PROGRESS_DELAY_S` sets another, e.g. 0 to see every task), so a
command that is done within it draws nothing; each shows
done/total, the rate and the time left where the total is known, and the task's detail line,
and is erased when the task ends, so the command's own output follows on a clean screen.
"""

from __future__ import annotations

import os
import sys
import time
from typing import IO, Any

from topologies.progress import ProgressUpdate

DELAY_ENV = "TPUSIM_PROGRESS_DELAY_S"


def terminal_delay_s() -> float:
    """The delay before a bar appears: `TPUSIM_PROGRESS_DELAY_S` if set to a number >= 0,
    else 1 s."""
    try:
        v = float(os.environ.get(DELAY_ENV, "1"))
    except ValueError:
        return 1.0
    return v if v >= 0 else 1.0


class TerminalProgress:
    """A `ProgressCallback` drawing one bar per running task on `stream` (stderr)."""

    def __init__(self, stream: IO[str] | None = None, delay_s: float | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.delay_s = terminal_delay_s() if delay_s is None else delay_s
        self._t0 = time.monotonic()
        self._bars: dict[str, Any] = {}

    def __call__(self, u: ProgressUpdate) -> None:
        try:
            self._show(u)
        except (OSError, ValueError):  # a closed or broken terminal: the run goes on
            pass

    def _show(self, u: ProgressUpdate) -> None:
        bar = self._bars.get(u.task)
        if bar is None:
            if u.finished:
                return
            from tqdm import tqdm  # only when a task reports: tqdm costs start-up time

            tqdm.monitor_interval = 0  # no monitor thread: updates come from the run itself
            # A terminal that reports no size (a fresh pseudo-terminal: tqdm would draw
            # nothing there) gets 80 columns and 24 rows.
            width = {} if all(_size(self.stream)) else {"ncols": 80, "nrows": 24,
                                                         "dynamic_ncols": False}
            bar = self._bars[u.task] = tqdm(
                total=u.total, initial=u.done, desc=u.task, unit=f" {u.unit}",
                unit_scale=u.unit == "byte",
                file=self.stream, delay=max(0.0, self._t0 + self.delay_s - time.monotonic()),
                leave=False, miniters=1,
                mininterval=0.1, position=len(self._bars), **{"dynamic_ncols": True, **width})
        if u.total is not None and bar.total != u.total:
            bar.total = u.total
        if u.detail:
            bar.set_postfix_str(u.detail, refresh=False)
        if u.done != bar.n:
            bar.update(u.done - bar.n)
        if u.finished:
            bar.close()
            del self._bars[u.task]

    def close(self) -> None:
        """Erase every bar still drawn (a run stopped by an error or Ctrl-C)."""
        for bar in list(self._bars.values()):
            try:
                bar.close()
            except (OSError, ValueError):
                pass
        self._bars.clear()


def _size(stream: IO[str]) -> tuple[int, int]:
    try:
        return tuple(os.get_terminal_size(stream.fileno()))  # type: ignore[return-value]
    except (AttributeError, OSError, ValueError):
        return (0, 0)


def terminal_progress(quiet: bool) -> TerminalProgress | None:
    """The command's callback: bars on stderr, or None with `--quiet` or when stderr is not a
    terminal."""
    if quiet:
        return None
    try:
        tty = sys.stderr.isatty()
    except (AttributeError, ValueError):
        tty = False
    return TerminalProgress() if tty else None


__all__ = ["DELAY_ENV", "TerminalProgress", "terminal_progress"]
