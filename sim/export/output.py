"""Writing result tables and summaries to disk, atomically (no half-written outputs)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from topologies.errors import TpusimError


def atomic_write(path: str | Path, writer: Callable[[Path], None]) -> Path:
    """Run `writer(tmp_path)` then rename into `path`, so a failure leaves no partial file."""
    path = Path(path)
    check_output_file(path)
    parent = path.parent if str(path.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TpusimError(f"cannot create directory {str(parent)!r}: {exc.strerror}") from None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=parent)
    except OSError as exc:
        raise TpusimError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        writer(tmp_path)
        os.chmod(tmp_path, 0o644)  # mkstemp creates 0600; outputs are ordinary files
        os.replace(tmp_path, path)
    except OSError as exc:
        tmp_path.unlink(missing_ok=True)
        raise TpusimError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    return path


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


def check_output_file(path: str | Path) -> None:
    """Refuse an output file that cannot be written (before anything is simulated or written)."""
    p = Path(path)
    if p.is_dir():
        raise TpusimError(f"output file {str(p)!r} is a directory; give a file name")
    if p.exists() and not os.access(p, os.W_OK):
        raise TpusimError(f"output file {str(p)!r} is not writable")
    _check_creatable(p, "output file")


def check_output_dir(path: str | Path) -> None:
    """Refuse an output directory that is a file or cannot be created."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise TpusimError(f"output directory {str(p)!r} is an existing file; give a directory")
    if p.is_dir():
        if not os.access(p, os.W_OK | os.X_OK):
            raise TpusimError(f"output directory {str(p)!r} is not writable")
        return
    _check_creatable(p, "output directory")


def write_json(path: str | Path, obj: Any) -> Path:
    text = json.dumps(obj, indent=2, sort_keys=False) + "\n"
    return atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))


def write_tables(out_dir: str | Path, tables: dict[str, Any], summary: dict[str, Any]) -> Path:
    """`<out>/<name>.csv` and `<out>/<name>.parquet` for each table, plus `summary.json`."""
    out = Path(out_dir)
    for name, df in tables.items():
        atomic_write(out / f"{name}.csv", lambda p, df=df: df.to_csv(p, index=False))
        atomic_write(out / f"{name}.parquet", lambda p, df=df: df.to_parquet(p, index=False))
    write_json(out / "summary.json", summary)
    return out
