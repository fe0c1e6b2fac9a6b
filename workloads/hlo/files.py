"""HLO text as files hold it: reading a module's file (`.gz` too, size-checked before it is
read whole), telling HLO text from a trace file, the `// tpusim: partition_coords=` comment
(XLA's device assignment, written beside the module), and a lower bound on the trace ops of
the ENTRY computation read before the parse."""

from __future__ import annotations

import gzip
import os
import re

from topologies.errors import TpusimError
from workloads.hlo.opcodes import ELEMENTWISE, MOVEMENT, MXU_OPS
from workloads.hlo.parser import MAX_TEXT_BYTES

# The whole line after `=`: a comment whose coordinates do not parse (`1,-1`) used to be
# ignored, replaying the module on the default assignment instead of the one it names.
_PARTITION_COORDS_RE = re.compile(r"^// tpusim: partition_coords=(.*)$", re.M)


def read_partition_coords(text: str) -> list[tuple[int, ...]] | None:
    """The `// tpusim: partition_coords=...` comment that benchmarks/make_hlo_fixtures.py
    writes (XLA's device assignment, which `compiled.as_text()` does not print)."""
    m = _PARTITION_COORDS_RE.search(text[:1 << 16])
    if not m:
        return None
    text = m.group(1).strip()
    if not re.fullmatch(r"-?\d{1,9}(?:,-?\d{1,9})*(?: +-?\d{1,9}(?:,-?\d{1,9})*)*", text):
        raise TpusimError(
            f"the `// tpusim: partition_coords=` comment {text[:60]!r} is not a list of "
            f"chip coordinates such as 0,0 1,0; fix or delete that line")
    try:
        return [tuple(int(v) for v in c.split(",")) for c in text.split()]
    except ValueError:
        raise TpusimError(
            f"the `// tpusim: partition_coords=` comment {m.group(1)[:60]!r} is not a list of "
            f"chip coordinates such as 0,0 1,0; fix or delete that line"
        ) from None


_ENTRY_RE = re.compile(r"(?m)^ENTRY\b[^\n]*\{[ \t]*$")
_ENTRY_INS_RE = re.compile(
    r"(?m)^[ \t]*(?:ROOT[ \t]+)?%?[\w.\-]+[ \t]*=[ \t]*[a-z0-9]+\[([\d,]*)\]\S*[ \t]+"
    r"([a-z][\w\-]*)\(")


def entry_ops_lower_bound(text: str) -> int:
    """Trace ops the ENTRY computation's text alone is sure to lower to: its array-valued
    (more than one element) element-wise, data-movement and matmul instructions, each of which
    runs once and becomes one compute op. Read with two regular expressions before the parse,
    so a module too large to simulate is refused in well under a second (parsing 300,000
    instructions takes ~18 CPU-s, and lowering them ran to the op cap before refusing)."""
    m = _ENTRY_RE.search(text)
    if not m:
        return 0
    end = text.find("\n}", m.end())
    body = text[m.end():end if end >= 0 else len(text)]
    emitting = ELEMENTWISE | MOVEMENT | MXU_OPS
    n = 0
    for dims, opcode in _ENTRY_INS_RE.findall(body):
        if opcode in emitting and any(d.strip() not in ("", "0", "1") for d in
                                      dims.split(",")):
            n += 1
    return n


def is_hlo_text(head: str) -> bool:
    """Whether a file's first bytes look like HLO module text (rather than a trace)."""
    for line in head.splitlines():
        s = line.strip()
        if not s or s.startswith("//"):
            continue
        return s.startswith("HloModule")
    return False




def read_hlo_file(path: str) -> str:
    """The text of an HLO file (`.gz` too), refusing files over the parser's size limit before
    reading them whole."""
    if os.path.isdir(path):
        raise TpusimError(f"HLO file {path!r} is a directory; give one module's .txt file (an "
                          f"XLA dump directory, `xla_dump_to`, holds one per compiled program)")
    if not os.path.exists(path):
        raise TpusimError(f"HLO file {path!r} does not exist")
    if not os.path.isfile(path):
        raise TpusimError(f"HLO file {path!r} is not a regular file (a pipe or device); save the "
                          f"HLO text to a file first")
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                data = f.read(MAX_TEXT_BYTES + 1)
        else:
            size = os.path.getsize(path)
            if size > MAX_TEXT_BYTES:
                raise TpusimError(
                    f"{path} is {size / 2**20:.0f} MiB of HLO text; tpusim reads modules of at "
                    f"most {MAX_TEXT_BYTES >> 20} MiB (compile fewer layers or use a scanned "
                    f"model)")
            with open(path, "rb") as f:
                data = f.read()
    except OSError as exc:
        raise TpusimError(f"HLO file {path!r} cannot be read: {exc}") from None
    if len(data) > MAX_TEXT_BYTES:
        raise TpusimError(
            f"{path} decompresses to more than {MAX_TEXT_BYTES >> 20} MiB of HLO text; tpusim "
            f"reads modules of at most {MAX_TEXT_BYTES >> 20} MiB")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise TpusimError(f"{path} is not HLO text (not UTF-8); give the text of "
                          f"compiled.as_text()") from None
