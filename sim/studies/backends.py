"""Where a study's points and a plan's jobs run: in this process (one worker), on a local
pool of reused worker processes, or on a Dask cluster (`local`: a `LocalCluster` started for
the run; an address; or a `distributed.Client`). What travels to a worker is a picklable job
(a point's typed request, a plan candidate's request with its settings) and what comes back
is the job's result object; nothing goes through stdout, files or command lines.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any
from urllib.parse import urlsplit

from sim.studies.points import run_point
from topologies.errors import TpusimError
from topologies.progress import reporting, stop_reporting
from topologies.validate import MAX_WORKERS, range_text, short_repr

DASK_CONNECT_TIMEOUT_S = 5


def check_workers(workers: Any) -> None:
    """A worker count: a whole number in [0, MAX_WORKERS] (0 = one per core)."""
    if not isinstance(workers, int) or isinstance(workers, bool) \
            or not 0 <= workers <= MAX_WORKERS:
        raise TpusimError(
            f"{{workers}} {short_repr(workers)} must be "
            f"{range_text(0, MAX_WORKERS, integer=True)} (0 = one per core)", "workers"
        )


def check_dask(dask: Any) -> None:
    """A Dask backend: None, "local", a scheduler address or a `distributed.Client`."""
    if dask is not None and not isinstance(dask, str) \
            and not callable(getattr(dask, "submit", None)):
        raise TpusimError(
            f"dask={short_repr(dask)} is not a scheduler: give \"local\", an address "
            f"tcp://HOST:PORT or a distributed.Client"
        )
    if isinstance(dask, str) and dask != "local" \
            and not dask.startswith(("tcp://", "tls://", "inproc://")):
        raise TpusimError(
            f"{{dask}} {short_repr(dask)} is not a scheduler address; give local or "
            f"tcp://HOST:PORT", "dask"
        )


def num_workers(workers: int) -> int:
    """The worker count `workers` asks for (0: one per core)."""
    return workers or max(os.cpu_count() or 1, 1)


def worker_init() -> None:
    # Ctrl-C goes to the whole process group: the parent keeps finished rows and stops the
    # pool; workers finish (or drop) their point quietly instead of printing tracebacks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A forked worker inherits the parent's progress callback: the progress is the parent's
    # (one tick per point), so the worker's own runs report to nobody.
    stop_reporting()


# -- a study's points: every job submitted at once, results as they finish -------------------
def local_runner(n: int, fn: Callable[[Any], Any] = None):
    """Yields (index, fn(job)) as jobs finish on a pool of `n` reused worker processes
    (`fn` defaults to `run_point`; `n` = 1 runs them in this process)."""
    fn = fn or run_point

    def run(jobs: list[tuple[int, Any]]):
        if n == 1:
            for i, argv in jobs:
                with reporting(None):  # the point's own runs: the study's bar stands for them
                    out = fn(argv)
                yield i, out
            return
        ex = ProcessPoolExecutor(max_workers=n, initializer=worker_init)
        try:
            futs = {ex.submit(fn, argv): i for i, argv in jobs}
            pending = set(futs)
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for f in sorted(done, key=futs.__getitem__):
                    yield futs[f], f.result()
        finally:
            ex.shutdown(wait=True, cancel_futures=True)

    return run


def dask_client(dask: Any, n: int):
    """(client, closer) for `dask`: "local", an address, or a given distributed.Client."""
    if not isinstance(dask, str):
        return dask, lambda: None
    try:
        # Dask's client (half a second to import) only for a run on Dask.
        from distributed import Client, LocalCluster
    except ImportError:  # pragma: no cover - distributed is a dependency
        raise TpusimError("{dask} needs the `distributed` package; pip install distributed",
                          "dask") \
            from None
    if dask == "local":
        cluster = LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                               dashboard_address=None, silence_logs=logging.ERROR)
        client = Client(cluster)

        def close():
            client.close()
            cluster.close()

        return client, close
    try:
        if dask.startswith("tcp://"):
            # A plain TCP connect first: a port nobody listens on is refused at once (the Dask
            # client would retry until its timeout), a silent host times out as the client would.
            u = urlsplit(dask)
            if u.hostname and u.port:
                socket.create_connection((u.hostname, u.port),
                                         timeout=DASK_CONNECT_TIMEOUT_S).close()
        client = Client(dask, timeout=f"{DASK_CONNECT_TIMEOUT_S}s")
    except Exception as exc:  # refused, timed out, or something that does not speak Dask
        raise TpusimError(
            f"{{dask}} {dask if len(dask) <= 60 else dask[:57] + '...'}: no Dask scheduler "
            f"answered within "
            f"{DASK_CONNECT_TIMEOUT_S} s "
            f"({type(exc).__name__}); start one (`dask scheduler`) or use {{dask}} local", "dask"
        ) from None
    return client, client.close


def dask_runner(client, fn: Callable[[Any], Any] = None):
    """`local_runner`'s generator on a Dask client: every job submitted at once."""
    fn = fn or run_point

    def run(jobs: list[tuple[int, Any]]):
        from distributed import as_completed  # a Dask run: distributed is loaded already

        tag = time.time_ns()  # fresh task keys: a shared scheduler may hold an earlier sweep's
        futs = {client.submit(fn, argv, pure=False, key=f"tpusim-point-{tag}-{i}"): i
                for i, argv in jobs}
        try:
            for f in as_completed(list(futs)):
                yield futs[f], f.result()
        finally:
            client.cancel(list(futs))

    return run


# -- a plan's jobs: submitted one at a time, as earlier ones decide what runs next ------------
class JobPool:
    """Submit jobs one at a time and wait for any to finish, on the sweep's backends: this
    process (1 worker), a local process pool, or a Dask client."""

    def __init__(self, n: int, dask: Any):
        self.n = n
        self.closer = lambda: None
        self.ex = self.client = None
        if dask is not None:
            self.client, self.closer = dask_client(dask, n)
            self.tag = time.time_ns()
        elif n > 1:
            self.ex = ProcessPoolExecutor(max_workers=n, initializer=worker_init)

    def submit(self, fn, arg, key: str):
        if self.client is not None:
            return self.client.submit(fn, arg, pure=False, key=f"tpusim-{key}-{self.tag}")
        if self.ex is not None:
            return self.ex.submit(fn, arg)
        f: Future = Future()
        with reporting(None):  # the candidate's own runs: the plan's bar stands for them
            f.set_result(fn(arg))
        return f

    def wait_any(self, futs):
        if self.client is not None:
            from distributed import wait as dask_wait  # a Dask run: distributed is loaded

            return dask_wait(list(futs), return_when="FIRST_COMPLETED").done
        return wait(list(futs), return_when=FIRST_COMPLETED).done

    def close(self) -> None:
        if self.ex is not None:
            self.ex.shutdown(wait=True, cancel_futures=True)
        self.closer()


__all__ = ["DASK_CONNECT_TIMEOUT_S", "JobPool", "check_dask", "check_workers", "dask_client",
           "dask_runner", "local_runner", "num_workers", "worker_init"]
