"""HBM occupancy over XLA's schedule, read from a compile's dump (how the memory rules of
docs/model.md "Memory" were read off the `validation/xla_memory.py` programs).

`xla_memory.py --compile --dump DIR` keeps, per program, XLA's buffer assignment
(`*after_optimizations-buffer-assignment.txt`: every value's allocation, offset, size and
shape) and live ranges (`*after_optimizations-live-range.txt`: every value's first and last
position in the flattened schedule). This script sums, at each position, the sizes of the live
values (values that share an allocation offset, e.g. a loop's carried buffer and its body
parameter, counted once), leaving out constants and the values of other memory spaces: host
memory (`S(5)`, what `offload` sends to pinned host memory), VMEM (`S(1)`, allocation color
1) and SMEM. The maximum (`hbm_peak`) equals
`compiled.memory_analysis().peak_memory_in_bytes` to 0.01% on every dumped dense training
program of `xla_memory.py`; the decode step's `peak_memory_in_bytes` also counts the VMEM
values live at its peak (52 MiB of 0.44 GB), and the MoE step's is not its HBM peak either,
so `xla_memory.py` compares tpusim with `hbm_peak`. XLA's own "Live ranges at N (peak)"
listing in the live-range file counts host buffers too, so under `offload` it points at the
wrong place.

Run (no jax needed):
    python -m validation.xla_live_ranges DUMP/v5e_fsdp_offload_s2048          # the peak
    python -m validation.xla_live_ranges DUMP/PROGRAM --at 2404 --top 40       # one position
    python -m validation.xla_live_ranges DUMP/PROGRAM --min-mib 256 --list     # big buffers
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

_VALUE = re.compile(r" value: <\d+ ([\w.\-]+)(\{[\d,]*\})?(?: \(phi\))? @\d+> "
                    r"\(size=(\d+),offset=(\d+)\): (\S+)")
_ALLOC = re.compile(r"allocation (\d+): size \d+(.*)")
_RANGE = re.compile(r"\s*([\w.\-]+\{[\d,]*\}):(\d+)-(\d+)")
_POS = re.compile(r"\s*(\d+):([\w.\-]+)")
_OPNAME = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = .*op_name=\"([^\"]*)\"")


def _one(directory: Path, pattern: str) -> Path:
    found = sorted(p for p in directory.glob(pattern) if "buffer-assignment" not in p.name
                   or "buffer-assignment" in pattern)
    if not found:
        sys.exit(f"xla_live_ranges: no {pattern} in {directory}; give a directory written by "
                 f"xla_memory.py --compile --dump DIR (one subdirectory per program)")
    return found[0]


def load(directory: Path) -> tuple[dict, dict, dict, dict]:
    """(values, ranges, positions, op names): values name -> (allocation, offset, size, off
    HBM, kind, shape); ranges name -> (first, last); positions index -> instruction."""
    values: dict[str, tuple] = {}
    alloc, kind, color = None, "temp", 0
    for line in _one(directory, "*after_optimizations-buffer-assignment.txt").read_text() \
            .splitlines():
        m = _ALLOC.match(line)
        if m:
            alloc, rest = int(m.group(1)), m.group(2)
            c = re.search(r"color (\d+)", rest)
            color = int(c.group(1)) if c else 0
            kind = "param" if "parameter" in rest else "const" if "constant" in rest else "temp"
            continue
        m = _VALUE.match(line)
        if m and alloc is not None:
            # Off HBM: host memory (color / layout S(5)), VMEM (1), SMEM and other spaces.
            host = color != 0 or re.search(r"S\([1-9]\d*\)", m.group(5)) is not None
            values[m.group(1) + (m.group(2) or "{}")] = (alloc, int(m.group(4)),
                                                         int(m.group(3)), host, kind,
                                                         m.group(5))
    text = _one(directory, "*after_optimizations-live-range.txt").read_text()
    head, rest = text.split("BufferLiveRange:", 1)
    rest = rest.split("Live ranges at", 1)[0]
    positions = {int(m.group(1)): m.group(2) for m in map(_POS.match, head.splitlines()) if m}
    ranges = {m.group(1): (int(m.group(2)), int(m.group(3)))
              for m in map(_RANGE.match, rest.splitlines()) if m}
    names: dict[str, str] = {}
    for line in _one(directory, "*after_optimizations.txt").read_text().splitlines():
        m = _OPNAME.match(line)
        if m:
            names[m.group(1)] = m.group(2)
    return values, ranges, positions, names


def live_at(values: dict, ranges: dict, t: int) -> dict[tuple[int, int], tuple[int, str]]:
    """(allocation, offset) -> (bytes, value) of the HBM values live at position t."""
    out: dict[tuple[int, int], tuple[int, str]] = {}
    for n, (s, e) in ranges.items():
        v = values.get(n)
        if v is None or v[3] or v[4] == "const" or not s <= t <= e:
            continue
        key = (v[0], v[1])
        if v[2] > out.get(key, (0, ""))[0]:
            out[key] = (v[2], n)
    return out


def occupancy(values: dict, ranges: dict) -> list[int]:
    """HBM bytes live at every position of the schedule."""
    starts: dict[int, list[str]] = {}
    ends: dict[int, list[str]] = {}
    for n, (s, e) in ranges.items():
        v = values.get(n)
        if v is None or v[3] or v[4] == "const":
            continue
        starts.setdefault(s, []).append(n)
        ends.setdefault(e + 1, []).append(n)
    live: dict[tuple[int, int], dict[str, int]] = {}
    out = []
    for t in range(max((e for _, e in ranges.values()), default=-1) + 1):
        for n in ends.get(t, ()):
            v = values[n]
            live[(v[0], v[1])].pop(n, None)
        for n in starts.get(t, ()):
            v = values[n]
            live.setdefault((v[0], v[1]), {})[n] = v[2]
        out.append(sum(max(g.values(), default=0) for g in live.values()))
    return out


def hbm_peak(directory: Path) -> int:
    """The program's HBM peak in bytes: the maximum of `occupancy` over its schedule."""
    values, ranges, _, _ = load(Path(directory))
    return max(occupancy(values, ranges), default=0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dump", type=Path, help="one program's dump directory")
    ap.add_argument("--at", type=int, help="schedule position (default: the HBM peak)")
    ap.add_argument("--top", type=int, default=30, help="buffers listed (default %(default)s)")
    ap.add_argument("--list", action="store_true",
                    help="list every HBM value of at least --min-mib with its live range")
    ap.add_argument("--min-mib", type=float, default=64.0)
    args = ap.parse_args()
    values, ranges, positions, names = load(args.dump)
    if args.list:
        rows = sorted((s, e, n) for n, (s, e) in ranges.items() if n in values
                      and not values[n][3] and values[n][2] >= args.min_mib * 2**20)
        for s, e, n in rows:
            v = values[n]
            print(f"{s:6d}-{e:6d} {v[2] / 2**20:8.1f} MiB {n:36s} {v[5][:48]:48s} "
                  f"{names.get(n.split('{')[0], '')[-60:]}")
        return 0
    occ = occupancy(values, ranges)
    peak_t = max(range(len(occ)), key=occ.__getitem__) if occ else 0
    t = peak_t if args.at is None else args.at
    print(f"HBM peak {occ[peak_t] / 1e9:.4f} GB at {peak_t} ({positions.get(peak_t, '?')})")
    live = live_at(values, ranges, t)
    print(f"at {t} ({positions.get(t, '?')}): {sum(b for b, _ in live.values()) / 1e9:.4f} GB")
    for size, n in sorted(live.values(), reverse=True)[:args.top]:
        s, e = ranges[n]
        print(f"  {size / 2**20:8.1f} MiB {n:36s} [{s}-{e}] {values[n][4]:5s} "
              f"{values[n][5][:48]:48s} {names.get(n.split('{')[0], '')[-60:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
