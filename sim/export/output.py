"""Writing result files safely: validated paths, no half-written outputs, and never replacing
anything that is not a regular file.

* A regular file (or a path that does not exist yet) is written to a temporary file next to it
  and renamed over it, so a failure leaves the old file (or nothing) behind.
* A FIFO or a character/block device (`/dev/null`, `/dev/stdout`, a named pipe) is written
  directly: renaming over it would replace the device node with a regular file.
* A symlink is followed, as a shell redirection does: the file it points to is written (by the
  two rules above) and the link itself is left in place. A dangling link creates its target; a
  loop of links is refused.
* Sockets, directories and paths whose directory cannot be created are refused before anything
  is simulated or written (`check_output_file`, `check_output_dir`).
"""

from __future__ import annotations

import errno
import io
import json
import os
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from topologies.errors import TpusimError
from topologies.validate import MAX_NAME_CHARS, MAX_PATH_CHARS, short_repr


def _target(path: Path) -> Path:
    """The path that is really written: symlinks resolved (followed), as documented above."""
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def _is_stream(path: Path) -> bool:
    """A FIFO or device: written in place, never renamed over."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISCHR(mode) or stat.S_ISBLK(mode)


def _hold_fifo(path: Path) -> int | None:
    """For a FIFO: a write end opened without blocking, held until the output is written (so
    a reader that is already there does not see end-of-file between this probe and the
    writer's own open), or None. With no reader yet the open would block with no word, so a
    one-line note on stderr says what the command waits for."""
    try:
        if not stat.S_ISFIFO(os.stat(path).st_mode):
            return None
    except OSError:
        return None
    try:
        return os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno != errno.ENXIO:  # ENXIO: no process has the FIFO open for reading
            return None
    sys.stderr.write(f"tpusim: note: {str(path)!r} is a FIFO with no reader yet; waiting for "
                     f"one to open it (Ctrl-C to stop)\n")
    sys.stderr.flush()
    return None


def atomic_write(path: str | Path, writer: Callable[[Path], None]) -> Path:
    """Run `writer(p)` so that `path` ends up holding the output and a failure leaves nothing
    half-written: temp file + rename for regular files, direct writes into FIFOs and devices.

    Returns `path` as given (a symlink stays a symlink; its target holds the output).
    """
    path = Path(path)
    check_output_file(path)
    target = _target(path)
    if _is_stream(path) or _is_stream(target):
        # Opened by the name given: /dev/stdout is a link to /proc/self/fd/1, whose resolved
        # name (pipe:[N] when stdout is a pipe) cannot be opened, though the link can.
        held = _hold_fifo(path)
        try:
            writer(path)
        except OSError as exc:
            raise TpusimError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None
        finally:
            if held is not None:
                os.close(held)
        return path
    parent = target.parent if str(target.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TpusimError(f"cannot create directory {str(parent)!r}: {exc.strerror}") from None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tpusim-", dir=parent)
    except OSError as exc:
        raise TpusimError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        writer(tmp_path)
        os.chmod(tmp_path, 0o644)  # mkstemp creates 0600; outputs are ordinary files
        # Re-check just before the rename: never rename over a path that became special.
        if target.exists() and not target.is_file():
            raise TpusimError(f"output {str(path)!r} is no longer a regular file; not replaced")
        os.replace(tmp_path, target)
    except OSError as exc:
        tmp_path.unlink(missing_ok=True)
        raise TpusimError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    return path


def write_bytes(path: str | Path, data: bytes) -> Path:
    """`data` into `path` (see `atomic_write`)."""
    def put(p: Path) -> None:
        with open(p, "wb") as f:
            f.write(data)

    return atomic_write(path, put)


def _check_not_empty(path: str | Path, what: str) -> None:
    # Path("") is ".": an empty name would write into the current directory, or nothing.
    if isinstance(path, str) and not path.strip():
        raise TpusimError(f"{what} {short_repr(path)} is empty; give a path")


def _check_name(p: Path, what: str) -> None:
    text = str(p)
    if not text.strip():
        raise TpusimError(f"{what} is empty; give a path")
    if "\x00" in text:
        raise TpusimError(f"{what} {short_repr(text)} contains a NUL character; give a path")
    if len(text) > MAX_PATH_CHARS:
        raise TpusimError(
            f"{what} {short_repr(text)} is {len(text)} characters long; the limit is "
            f"{MAX_PATH_CHARS}"
        )
    for part in p.parts:
        if len(part.encode("utf-8", "surrogateescape")) > MAX_NAME_CHARS:
            raise TpusimError(
                f"{what} {short_repr(text)} has a name of {len(part)} characters; names are "
                f"limited to {MAX_NAME_CHARS} bytes, give a shorter one"
            )


def _check_creatable(p: Path, what: str) -> None:
    """The nearest existing ancestor of `p` must be a writable directory."""
    anc = p.parent if str(p.parent) else Path(".")
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise TpusimError(
            f"{what} {str(p)!r} cannot be created: {str(anc)!r} is a file, not a directory"
        )
    if not os.access(anc, os.W_OK | os.X_OK):
        raise TpusimError(
            f"{what} {str(p)!r} cannot be created: no write permission in {str(anc)!r}"
        )
    _probe_writable(anc, p, what)


def _probe_writable(d: Path, p: Path, what: str) -> None:
    """Create and remove a file in `d`: access() passes for root whatever the permission bits,
    and on /proc or /sys, so `plan` run there searched for minutes before its `plan-out/`
    could not be made. Nothing is left behind."""
    where = str(d) if str(d) != "." else os.getcwd()
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tpusim-probe-", dir=d)
    except OSError as exc:
        raise TpusimError(
            f"{what} {str(p)!r} cannot be created: {where!r} is not writable "
            f"({exc.strerror or exc}); give a path in a writable directory") from None
    os.close(fd)
    os.unlink(tmp)


def check_output_file(path: str | Path, what: str = "output file") -> None:
    """Refuse an output file that cannot be written (before anything is simulated or written)."""
    _check_not_empty(path, what)
    p = Path(path)
    _check_name(p, what)
    text = os.fspath(path)
    if isinstance(text, str) and text.endswith("/") and not p.is_dir():
        # Path() drops the slash: `--perfetto out/` wrote a file named `out`.
        raise TpusimError(f"{what} {short_repr(text)} ends with '/', which names a directory; "
                          f"give a file name")
    if _is_stream(p):  # a FIFO or device, also through a link (/dev/stdout): written in place
        if not os.access(p, os.W_OK):
            raise TpusimError(f"{what} {str(p)!r} is not writable")
        return
    try:
        os.stat(p)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            # realpath() of a loop is the link itself, which the rename then replaced with a
            # regular file.
            raise TpusimError(f"{what} {str(p)!r} is a loop of symbolic links; give a file "
                              f"name or a link that points to one") from None
    t = _target(p)
    if t.is_dir():
        raise TpusimError(f"{what} {str(p)!r} is a directory; give a file name")
    if t.exists():
        mode = os.stat(t).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)
                or stat.S_ISBLK(mode)):
            raise TpusimError(f"{what} {str(p)!r} is a socket or other special file; give a "
                              f"file name")
        if not os.access(t, os.W_OK):
            raise TpusimError(f"{what} {str(p)!r} is not writable")
        if _is_stream(t):
            return  # written in place: its directory need not be writable
    _check_creatable(t, what)


def check_output_dir(path: str | Path, what: str = "output directory") -> None:
    """Refuse an output directory that is a file or cannot be created."""
    _check_not_empty(path, what)
    p = Path(path)
    _check_name(p, what)
    if p.exists() and not p.is_dir():
        raise TpusimError(f"{what} {str(p)!r} is an existing file, not a directory; give a "
                          f"directory")
    if p.is_dir():
        if not os.access(p, os.W_OK | os.X_OK):
            raise TpusimError(f"{what} {str(p)!r} is not writable")
        _probe_writable(p, p, what)
        return
    _check_creatable(p, what)


def write_json(path: str | Path, obj: Any) -> Path:
    text = json.dumps(obj, indent=2, sort_keys=False, allow_nan=False) + "\n"
    return write_bytes(path, text.encode("utf-8"))


TABLE_FILES = ("csv", "parquet")


def table_paths(out_dir: str | Path, names) -> list[Path]:
    """Every file `write_tables` writes into `out_dir` for tables `names`."""
    out = Path(out_dir)
    return [out / f"{n}.{ext}" for n in names for ext in TABLE_FILES] + [out / "summary.json"]


def write_tables(out_dir: str | Path, tables: dict[str, Any], summary: dict[str, Any]) -> Path:
    """`<out>/<name>.csv` and `<out>/<name>.parquet` for each table, plus `summary.json`.

    Every file is rendered in memory first, so a table that cannot be encoded fails before the
    first byte is written.
    """
    out = Path(out_dir)
    payloads: list[tuple[Path, bytes]] = []
    for name, df in tables.items():
        payloads.append((out / f"{name}.csv", df.to_csv(index=False).encode("utf-8")))
        buf = io.BytesIO()
        df.to_parquet(buf, index=False)
        payloads.append((out / f"{name}.parquet", buf.getvalue()))
    text = json.dumps(summary, indent=2, sort_keys=False, allow_nan=False) + "\n"
    payloads.append((out / "summary.json", text.encode("utf-8")))
    for path, data in payloads:
        write_bytes(path, data)
    return out
