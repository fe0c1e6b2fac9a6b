"""Progress of long runs, as typed reports to a callback the caller gives; nothing here prints.

A run that can take more than a second (a plan, a sweep, a per-chip or vector step, an HLO
import, a long export, a serving run) opens a task and reports how far it is:

    def show(u: ProgressUpdate) -> None:
        print(f"{u.task}: {u.done}/{u.total} {u.unit} {u.detail}", file=sys.stderr)

    sim.run(request, progress=show)         # or sim.sweep(..., progress=show), sim.plan(...)

The callback is the caller's for the extent of the run (`reporting(callback)`, a context
variable: each thread and asyncio task sees only its own; nothing is left behind for the next
run), and the library code that reports asks for a task (`task(...)`), which is a no-op object
when no callback is set, so that a run nobody watches pays nothing but the check. One task
reports at a time: one started while another is open (a sweep's point, a plan's candidate, a
serving run's cost-model steps) is a no-op too, its progress being the outer task's. A task emits
at most one update per `Task.interval_s` of wall time (its first and last always), so a callback
is called a few times a second however fast the loop that reports is; the engine loops ask
`Task.due()` only every few thousand events. The `tpusim` command's callback draws the updates as
a bar on stderr when stderr is a terminal (`sim/cli/progress.py`); the CLI's quiet switch sets none.

Kept below every package that reports (the HLO parser in `workloads/` reports too); the run
layer (`sim.runs`) takes the callback and exports these types.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TypeVar

from topologies.errors import TpusimError
from topologies.validate import short_repr

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ProgressUpdate:
    """One report of a running task.

    Attributes:
        task: what runs (`plan`, `sweep`, `chip classes`, `vector classes`, `HLO parse`, ...).
        done: units done so far (whole units).
        total: units in all, or None where the total is not known in advance.
        unit: what a unit is (`candidate`, `point`, `op`, `instruction`, `request`, ...).
        detail: a short line of what else is known (`3 failed`, `best 22.22 s`, ...), or "".
        finished: the task's last update (it ended, or stopped on an error).
    """

    task: str
    done: int
    total: int | None
    unit: str
    detail: str = ""
    finished: bool = False

    @property
    def fraction(self) -> float | None:
        """done / total, or None without a total."""
        return None if not self.total else min(self.done / self.total, 1.0)


ProgressCallback = Callable[[ProgressUpdate], None]

_CALLBACK: ContextVar[ProgressCallback | None] = ContextVar("tpusim_progress", default=None)
# Whether a task is open here: one task reports at a time, the outermost (a sweep's points, a
# plan's candidates and a serving run's cost-model steps are the outer task's progress).
# A weak reference, so that a task dropped without `close()` does not silence later ones.
_OPEN: ContextVar[weakref.ref | None] = ContextVar("tpusim_progress_open", default=None)


def _task_open() -> bool:
    ref = _OPEN.get()
    t = ref() if ref is not None else None
    return t is not None and not t.closed


@contextlib.contextmanager
def reporting(callback: ProgressCallback | None) -> Iterator[None]:
    """Within the block, tasks report to `callback` (None: to nobody, e.g. the points a sweep
    runs in its own process, whose progress is the sweep's)."""
    if callback is not None and not callable(callback):
        raise TpusimError(f"progress={short_repr(callback)} is not a callable; give a function "
                          f"taking one ProgressUpdate, or None")
    token = _CALLBACK.set(callback)
    try:
        yield
    finally:
        _CALLBACK.reset(token)


def stop_reporting() -> None:
    """From now on, in this thread's context, report to nobody (a forked worker process, which
    inherits its parent's callback: the worker's progress is its parent's to report)."""
    _CALLBACK.set(None)


def current() -> ProgressCallback | None:
    """The callback the enclosing `reporting` block set (None outside one)."""
    return _CALLBACK.get()


class Task:
    """A running task's reporter (`task(...)`): `update`/`advance` while it runs, `close` at the
    end (or use it as a context manager). Updates closer together than `interval_s` are held
    back, except the first and the last."""

    __slots__ = ("__weakref__", "_cb", "_next_t", "_token", "closed", "detail", "done",
                 "interval_s", "name", "total", "unit")
    active = True

    def __init__(self, callback: ProgressCallback, name: str, *, total: int | None, unit: str,
                 done: int = 0, detail: str = "", interval_s: float = 0.1) -> None:
        self._cb = callback
        self.name, self.unit, self.total = name, unit, total
        self.done, self.detail = int(done), detail
        self.interval_s = interval_s
        self.closed = False
        self._next_t = 0.0
        self._token = _OPEN.set(weakref.ref(self))
        self._emit(False)

    def due(self) -> bool:
        """Whether an update now would be shown (the loops that report ask this before
        counting what they would report)."""
        return time.monotonic() >= self._next_t

    def update(self, done: int | None = None, *, total: int | None = None,
               detail: str | None = None, force: bool = False) -> None:
        """Set how much is done (and the total, the detail line); emitted if due or `force`."""
        if self.closed:
            return
        if done is not None:
            self.done = int(done)
        if total is not None:
            self.total = int(total)
        if detail is not None:
            self.detail = detail
        if force or time.monotonic() >= self._next_t:
            self._emit(False)

    def advance(self, n: int = 1, *, detail: str | None = None) -> None:
        """`n` more units done."""
        self.update(self.done + n, detail=detail)

    def close(self, *, detail: str | None = None) -> None:
        """The last update (`finished`); later calls do nothing."""
        if self.closed:
            return
        if detail is not None:
            self.detail = detail
        self.closed = True
        try:
            _OPEN.reset(self._token)
        except ValueError:  # closed from another context than the one it opened in
            _OPEN.set(None)
        self._emit(True)

    def _emit(self, finished: bool) -> None:
        self._next_t = time.monotonic() + self.interval_s
        self._cb(ProgressUpdate(task=self.name, done=self.done, total=self.total,
                                unit=self.unit, detail=self.detail, finished=finished))

    def __enter__(self) -> Task:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _NoTask:
    """The task of a run nobody watches: every call does nothing."""

    __slots__ = ()
    active = False
    closed = True
    done = 0
    total = None

    def due(self) -> bool:
        return False

    def update(self, done=None, *, total=None, detail=None, force=False) -> None:
        pass

    def advance(self, n: int = 1, *, detail=None) -> None:
        pass

    def close(self, *, detail=None) -> None:
        pass

    def __enter__(self) -> _NoTask:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


NO_TASK = _NoTask()


def task(name: str, *, total: int | None = None, unit: str = "it", done: int = 0,
         detail: str = "", interval_s: float = 0.1) -> Task | _NoTask:
    """A reporter for a task starting now: a `Task` sending its updates to the enclosing
    `reporting` block's callback, or `NO_TASK` when there is none or another task is open
    here (the outermost task reports; a task is closed by `close()` or its `with` block)."""
    cb = _CALLBACK.get()
    if cb is None or _task_open():
        return NO_TASK
    return Task(cb, name, total=total, unit=unit, done=done, detail=detail,
                interval_s=interval_s)


def tracked(items: Iterable[T], name: str, *, total: int | None = None,
            unit: str = "it") -> Iterator[T]:
    """`items`, reporting one unit per item taken (the task closes when they run out)."""
    if _CALLBACK.get() is None or _task_open():
        yield from items
        return
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with task(name, total=total, unit=unit) as t:
        for x in items:
            yield x
            t.advance()


__all__ = ["NO_TASK", "ProgressCallback", "ProgressUpdate", "Task", "current", "reporting",
           "stop_reporting", "task", "tracked"]
