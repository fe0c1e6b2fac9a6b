"""Peak HBM of imported HLO programs (`workloads/hlo/memory.py`) against XLA's own buffer
assignment.

Two sets of programs, both compiled deviceless by `jax[tpu]==0.10.2`:

* **the HLO fixtures** (`tests/fixtures/hlo/*.hlo.txt.gz`, `validation/make_hlo_fixtures.py`):
  `--compile` recompiles each fixture's program with XLA's dump on and records the HBM peak of
  its buffer assignment (`validation/xla_live_ranges.py`, HBM values only) and
  `compiled.memory_analysis().peak_memory_in_bytes`; the test suite holds tpusim's peak of each
  fixture file to the recorded XLA peak (tests/test_hlo_memory.py);
* **programs of `validation/xla_memory.py`** compiled with `--dump DIR`: `--dumps DIR/PROGRAM
  ...` reads each program's optimized module (`*after_optimizations.txt`) and its buffer
  assignment.

Which programs the rules were read off (`DEV`) and which were compiled after the rules were
committed, as their check (every other row), is recorded per row. Results are cached in
`validation/results/hlo_memory.json`; the table needs no jax:

    .venv/bin/python -m validation.hlo_memory --compile --jax-python /work/jaxvenv/bin/python
    .venv/bin/python -m validation.hlo_memory --dumps DUMPS/v5e_fsdp_full_s2048 ...
    .venv/bin/python -m validation.hlo_memory [--write]   # the table (into docs/hlo.md)
"""

from __future__ import annotations

import argparse
import gzip
import statistics
import sys
import tempfile
from pathlib import Path

from validation import xla_compile, xla_live_ranges
from validation.template import splice
from workloads.hlo.memory import hlo_memory
from workloads.hlo.parser import parse_hlo

REPO = xla_compile.REPO
CACHE = REPO / "validation" / "results" / "hlo_memory.json"
DOC = REPO / "docs" / "hlo.md"
FIXTURES = REPO / "tests" / "fixtures" / "hlo"
BEGIN, END = "<!-- hlo-memory -->", "<!-- /hlo-memory -->"
# The compiles the rules of workloads/hlo/memory.py were read off; every other row was
# compiled after those rules were committed.
DEV = ("v5e_fsdp_minimal_s2048", "decode_v5e_tp8_kv2048", "v5e_fsdp_tp_full_s2048",
       "train_fsdp_v5e16", "v5e_fsdp_full_s2048")


def tpusim_peak(text: str, source: str) -> dict:
    """tpusim's peak of one module's text."""
    mem = hlo_memory(parse_hlo(text, source=source))
    return {"tpusim_peak_bytes": mem.peak_bytes, "tpusim_parameter_bytes": mem.parameter_bytes,
            "tpusim_peak_at": mem.peak_at}


def worker(name: str) -> None:
    """(jax python) Compile fixture `name` with XLA's dump and emit its HBM peaks."""
    with tempfile.TemporaryDirectory() as dump:
        xla_compile.init_jax(dump)
        # After init_jax: XLA reads its dump flags when the compile loads jax.
        from validation.make_hlo_fixtures import build

        build(name, False)
        xla_compile.emit({"program": name, "kind": "fixture",
                          "xla_hbm_peak_bytes": int(xla_live_ranges.hbm_peak(Path(dump)))})


def from_dump(directory: Path) -> dict:
    """A `xla_memory.py --dump` program's row: tpusim's peak of its optimized module against
    the peak of its buffer assignment."""
    found = sorted(directory.glob("*after_optimizations.txt"))
    if not found:
        sys.exit(f"hlo_memory: no *after_optimizations.txt in {directory}; give a directory "
                 f"written by xla_memory.py --compile --dump DIR (DIR/PROGRAM)")
    return {"program": directory.name, "kind": "xla_memory",
            "xla_hbm_peak_bytes": int(xla_live_ranges.hbm_peak(directory)),
            **tpusim_peak(found[0].read_text(), str(found[0].name))}


def fixture_rows(cache: dict) -> None:
    """Fill tpusim's side of the fixture rows from the committed fixture files."""
    for name, row in cache.items():
        if row["kind"] == "fixture":
            path = FIXTURES / f"{name}.hlo.txt.gz"
            row.update(tpusim_peak(gzip.decompress(path.read_bytes()).decode(), path.name))


def table(cache: dict) -> str:
    rows = sorted(cache.values(), key=lambda r: (r["kind"], r["program"]))
    lines = ["| program | set | XLA HBM peak | tpusim | error | tpusim's peak at |",
             "|---|---|---:|---:|---:|---|"]
    errs: dict[str, list[float]] = {"dev": [], "check": []}
    for r in rows:
        role = "dev" if r["program"] in DEV else "check"
        err = r["tpusim_peak_bytes"] / r["xla_hbm_peak_bytes"] - 1
        errs[role].append(abs(err))
        lines.append(f"| `{r['program']}` ({r['kind'].replace('_', ' ')}) | {role} | "
                     f"{r['xla_hbm_peak_bytes'] / 1e9:.3f} GB | "
                     f"{r['tpusim_peak_bytes'] / 1e9:.3f} GB | {err:+.1%} | "
                     f"`{r['tpusim_peak_at'][:60]}` |")
    check = errs["check"]
    head = (f"On the {len(check)} check programs (compiled after the rules were written down) "
            f"the median absolute error is {statistics.median(check):.1%} and the largest "
            f"{max(check):.1%}; on the {len(errs['dev'])} programs the rules were read off, "
            f"{statistics.median(errs['dev']):.1%} and {max(errs['dev']):.1%}."
            if check and errs["dev"] else "")
    return "\n".join([head, "", *lines])


def updated(doc: str, cache: dict) -> str:
    """`doc` (docs/hlo.md's text) with the table of `cache` (after `fixture_rows`)."""
    return splice(doc, BEGIN, END, f"{BEGIN}\n{table(cache)}\n{END}")


def current_cache() -> dict:
    """The cache with tpusim's side of the fixture rows recomputed (XLA's side and the
    `xla_memory` rows, whose modules are not in the repository, as cached); not written."""
    cache = xla_compile.load_cache(CACHE)
    fixture_rows(cache)
    return dict(sorted(cache.items()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--compile", action="store_true",
                    help="compile the fixtures' programs with the jax python")
    ap.add_argument("--jax-python", default=xla_compile.DEFAULT_JAX_PYTHON)
    ap.add_argument("--only", help="comma list of fixtures to compile")
    ap.add_argument("--dumps", nargs="+", type=Path, metavar="DIR",
                    help="xla_memory.py dump directories (DIR/PROGRAM) to add")
    ap.add_argument("--write", action="store_true", help="rewrite the table in docs/hlo.md")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
        return 0
    cache = xla_compile.load_cache(CACHE)
    if args.compile:
        from validation.make_hlo_fixtures import FIXTURES as NAMES  # its jaxgen: jax's side

        names = args.only.split(",") if args.only else [
            n for n, c in NAMES.items() if not c.get("bench")]
        for name in names:
            r = xla_compile.run_worker("validation.hlo_memory", name, args.jax_python)
            cache[name] = {**cache.get(name, {}), **r}
            print(f"{name}: XLA {r['xla_hbm_peak_bytes'] / 1e9:.3f} GB", flush=True)
    for d in args.dumps or ():
        r = from_dump(d)
        cache[r["program"]] = r
    fixture_rows(cache)
    xla_compile.write_cache(CACHE, dict(sorted(cache.items())))
    text = table(cache)
    if args.write:
        doc = DOC.read_text()
        if BEGIN not in doc:
            sys.exit(f"hlo_memory: {DOC} has no {BEGIN} marker")
        DOC.write_text(updated(doc, cache))
        print(f"wrote {DOC.relative_to(REPO)}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
