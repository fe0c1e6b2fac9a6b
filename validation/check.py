"""Are the generated sections of the docs what the code now produces? Every section a
`python -m validation.NAME --write` writes (docs/validation.md, docs/hlo.md) and the result
files they keep beside them are regenerated in memory and compared with the committed text;
nothing is written (unless `--write`) and nothing is compiled: XLA's side of a cross-check comes
from its cache in validation/results/, tpusim's side is recomputed, and the MaxText document is
rendered from the saved fit (validation/results/maxtext_fits.json), whose objectives are
re-evaluated at the saved factors to tell whether the fit itself is stale.

    .venv/bin/python -m validation.check                  # every section; exit 1 if any is stale
    .venv/bin/python -m validation.check --only hlo-import,twisted
    .venv/bin/python -m validation.check --jobs 2         # sections in 2 worker processes
    .venv/bin/python -m validation.check --write          # also rewrite the stale ones

Each stale section is named with the command that regenerates it and a short diff. The cost
of a whole check is measured in validation/README.md.
"""

from __future__ import annotations

import argparse
import difflib
import multiprocessing
import re
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VALIDATION_MD = "docs/validation.md"
HLO_MD = "docs/hlo.md"
DIFF_LINES = 24  # diff lines shown per stale file


@dataclass(frozen=True)
class Section:
    """One generated section: its files (repository-relative), the command that rewrites them
    and `regenerate`, which maps the committed texts of those files to what the code now
    writes, with notes (a stale input that no diff shows, or why the section was skipped)."""
    name: str
    files: tuple[str, ...]
    command: str
    regenerate: Callable[[dict[str, str]], tuple[dict[str, str], list[str]]]
    markers: tuple[str, ...] = ()  # the begin markers of what it writes (`<!-- name -->`)


# ---- the sections ------------------------------------------------------------------------------
# Function-level imports: a section's modules (and the simulator) load only when it is checked,
# so `--only` and the worker processes import what they use.


def _maxtext(texts: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    # deferred: the MaxText pipeline is the heaviest import; loaded only for its section
    from validation import maxtext_doc, maxtext_predict, maxtext_runs

    if not maxtext_doc.FITS_FILE.is_file():
        return texts, [f"skipped: no {maxtext_doc.FITS_FILE.relative_to(ROOT)} (written by "
                       "`python -m validation.maxtext --write`)"]
    fits = maxtext_doc.load_fits()
    cases, skips = maxtext_runs.load_cases(maxtext_runs.RUNS_FILE)
    preds = maxtext_predict.predict_all(cases)
    stats = maxtext_predict.summary(preds)
    new = maxtext_doc.updated(texts[VALIDATION_MD], cases, skips, preds, stats, fits)
    notes = [f"STALE fit ({n[6:]}): re-run the fit, `python -m validation.maxtext --write "
             "--jobs 2`" if n.startswith("STALE ") else f"fit: {n}"
             for n in maxtext_doc.stale_fits(fits, cases, preds)]
    return {VALIDATION_MD: new}, notes


def _energy(texts):
    # deferred: as every section's (above)
    from validation import energy

    return {VALIDATION_MD: energy.updated(texts[VALIDATION_MD])}, []


def _hlo_import(texts):
    # deferred: as every section's (above)
    from validation import hlo_import

    return {VALIDATION_MD: hlo_import.updated(texts[VALIDATION_MD])}, []


def _peak_hbm(texts):
    # deferred: as every section's (above)
    from validation import xla_memory

    return {VALIDATION_MD: xla_memory.updated(texts[VALIDATION_MD])}, []


def _chakra(texts):
    # deferred: as every section's (above)
    from validation import chakra

    if not (chakra.SHARED / "manifest.json").is_file():
        return texts, [f"skipped: the shared Chakra traces are not at {chakra.SHARED} "
                       "(third-party files, never in the repository)"]
    return {VALIDATION_MD: chakra.updated(texts[VALIDATION_MD])}, []


def _serving(texts):
    # deferred: as every section's (above)
    from validation import serving_jetstream

    return {VALIDATION_MD: serving_jetstream.updated(texts[VALIDATION_MD])}, []


def _twisted(texts):
    # deferred: as every section's (above)
    from validation import twisted

    return {VALIDATION_MD: twisted.updated(texts[VALIDATION_MD])}, []


def _int8(texts):
    # deferred: as every section's (above)
    from validation import xla_int8

    return {VALIDATION_MD: xla_int8.updated(texts[VALIDATION_MD])}, []


def _unfitted(texts):
    # deferred: as every section's (above)
    from validation import maxtext_unfitted as mu

    cache = mu.build_cache()
    cache_file = str(mu.CACHE_FILE.relative_to(ROOT))
    return {VALIDATION_MD: mu.updated(texts[VALIDATION_MD], cache),
            cache_file: mu.cache_text(cache)}, []


def _logits(texts):
    # deferred: as every section's (above)
    from validation import xla_logits

    return {VALIDATION_MD: xla_logits.updated(texts[VALIDATION_MD])}, []


def _cached_xla(module: str, texts):
    """A section of `validation.<module>` (its MARKER, END, CACHE and `section(cache)`): XLA's
    side from the cache, tpusim's recomputed; skipped while the document lacks it."""
    # deferred: as every section's (above)
    import importlib
    import importlib.util

    from validation import xla_compile
    from validation.template import splice

    if importlib.util.find_spec(f"validation.{module}") is None:
        return texts, [f"skipped: validation/{module}.py is not in this tree"]
    mod = importlib.import_module(f"validation.{module}")
    doc = texts[VALIDATION_MD]
    if mod.MARKER not in doc:
        return texts, ["skipped: not in the document yet (`--write` adds it)"]
    text = mod.section(xla_compile.load_cache(mod.CACHE))
    return {VALIDATION_MD: splice(doc, mod.MARKER, mod.END, text)}, []


def _program_flags(texts):
    return _cached_xla("xla_progflags", texts)


def _moe_dispatch(texts):
    return _cached_xla("xla_moe_dispatch", texts)


def _moe_decode(texts):
    return _cached_xla("xla_moe_decode", texts)


def _hlo_memory(texts):
    # deferred: as every section's (above)
    from validation import hlo_memory, xla_compile

    cache = hlo_memory.current_cache()
    return {HLO_MD: hlo_memory.updated(texts[HLO_MD], cache),
            str(hlo_memory.CACHE.relative_to(ROOT)): xla_compile.cache_text(cache)}, []


SECTIONS = (
    Section("maxtext", (VALIDATION_MD,),
            "python -m validation.maxtext --write --reuse-fits validation/results/"
            "maxtext_fits.json", _maxtext),
    Section("energy", (VALIDATION_MD,), "python -m validation.energy --write", _energy),
    Section("hlo-import", (VALIDATION_MD,), "python -m validation.hlo_import --write",
            _hlo_import, ("<!-- hlo-import -->",)),
    Section("peak-hbm", (VALIDATION_MD,), "python -m validation.xla_memory --write", _peak_hbm,
            ("<!-- peak-hbm -->",)),
    Section("chakra", (VALIDATION_MD,), "python -m validation.chakra --write", _chakra,
            ("<!-- chakra -->",)),
    Section("serving", (VALIDATION_MD,), "python -m validation.serving_jetstream --write",
            _serving, ("<!-- serving -->",)),
    Section("twisted", (VALIDATION_MD,), "python -m validation.twisted --write", _twisted,
            ("<!-- twisted -->",)),
    Section("int8", (VALIDATION_MD,), "python -m validation.xla_int8 --write", _int8,
            ("<!-- int8 -->",)),
    Section("unfitted", (VALIDATION_MD, "validation/results/maxtext_unfitted.json"),
            "python -m validation.maxtext_unfitted --write", _unfitted,
            ("<!-- unfitted -->", "<!-- unfitted-summary -->")),
    Section("logits-dtype", (VALIDATION_MD,), "python -m validation.xla_logits --write",
            _logits, ("<!-- logits-dtype -->",)),
    Section("program-flags", (VALIDATION_MD,), "python -m validation.xla_progflags --write",
            _program_flags, ("<!-- program-flags -->",)),
    Section("moe-dispatch", (VALIDATION_MD,), "python -m validation.xla_moe_dispatch --write",
            _moe_dispatch, ("<!-- moe-dispatch -->",)),
    Section("moe-decode", (VALIDATION_MD,), "python -m validation.xla_moe_decode --write",
            _moe_decode, ("<!-- moe-decode -->",)),
    Section("hlo-memory", (HLO_MD, "validation/results/hlo_memory.json"),
            "python -m validation.hlo_memory --write", _hlo_memory, ("<!-- hlo-memory -->",)),
)
BY_NAME = {s.name: s for s in SECTIONS}
# A begin marker: `<!-- name -->` on a line of its own or opening one (end markers: `/name`).
_MARKER = re.compile(r"<!-- ([a-z0-9-]+) -->")


def unregistered(path: str, text: str) -> list[str]:
    """The begin markers in `text` (the file `path`) that no section writes: a generated
    section this check would not see."""
    known = {m for s in SECTIONS if path in s.files for m in s.markers}
    return sorted({m.group(0) for m in _MARKER.finditer(text)} - known)


# ---- checking ----------------------------------------------------------------------------------


def _cpu_s() -> float:
    """CPU seconds (user + system) of this process and its finished children."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def run_section(name: str, texts: dict[str, str] | None = None) -> dict:
    """Regenerate section `name` from `texts` (else the committed files): its new texts, which
    files differ, its notes and its CPU and wall seconds."""
    sec = BY_NAME[name]
    texts = texts if texts is not None else {f: (ROOT / f).read_text(encoding="utf-8")
                                             for f in sec.files}
    cpu, wall = _cpu_s(), time.perf_counter()
    new, notes = sec.regenerate(texts)
    stale = sorted(f for f, t in new.items() if texts.get(f) != t)
    return {"name": name, "texts": texts, "new": new, "stale": stale, "notes": notes,
            "cpu_s": _cpu_s() - cpu, "wall_s": time.perf_counter() - wall}


def short_diff(old: str, new: str, path: str, limit: int = DIFF_LINES) -> list[str]:
    """At most `limit` lines of a unified diff (no context) of `old` against `new`."""
    lines = list(difflib.unified_diff(old.splitlines(), new.splitlines(), f"{path} (committed)",
                                      f"{path} (regenerated)", n=0, lineterm=""))
    cut = [ln if len(ln) <= 160 else ln[:157] + "..." for ln in lines[:limit]]
    if len(lines) > limit:
        cut.append(f"... {len(lines) - limit} more diff lines")
    return cut


def is_stale(result: dict) -> bool:
    return bool(result["stale"]) or any(n.startswith("STALE") for n in result["notes"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma list of sections (default: all): "
                                   + ", ".join(BY_NAME))
    ap.add_argument("--jobs", type=int, default=1,
                    help="worker processes, one section each at a time (results do not "
                         "depend on it)")
    ap.add_argument("--write", action="store_true",
                    help="also rewrite the stale files (one section after another)")
    args = ap.parse_args(argv)
    names = args.only.split(",") if args.only else list(BY_NAME)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown section(s) {', '.join(unknown)}; known: {', '.join(BY_NAME)}")
    if args.jobs < 1:
        ap.error(f"--jobs takes 1 or more, not {args.jobs}")
    cpu, wall = _cpu_s(), time.perf_counter()
    if args.jobs > 1 and not args.write:
        # The slow sections first, so that they do not start last.
        order = sorted(names, key=lambda n: n != "maxtext")
        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            got = {r["name"]: r for r in pool.imap_unordered(run_section, order)}
        results = [got[n] for n in names]
    else:
        results = []
        for n in names:
            # Under --write each section starts from the files as the ones before left them.
            results.append(run_section(n))
            if args.write:
                for f in results[-1]["stale"]:
                    (ROOT / f).write_text(results[-1]["new"][f], encoding="utf-8")
    stale = []
    for path in sorted({f for n in names for f in BY_NAME[n].files if f.startswith("docs/")}):
        for m in unregistered(path, (ROOT / path).read_text(encoding="utf-8")):
            stale.append(m)
            print(f"STALE {path}: {m} starts a section no entry of validation.check.SECTIONS "
                  "writes; add it there")
    for r in results:
        sec = BY_NAME[r["name"]]
        bad = is_stale(r)
        stale += [r["name"]] if bad else []
        print(f"{'STALE' if bad else 'ok':5} {r['name']:13} {r['cpu_s']:6.1f} CPU-s "
              f"{r['wall_s']:6.1f} s wall" + (f"  ({', '.join(r['stale'])})" if r["stale"]
                                               else ""))
        for note in r["notes"]:
            print(f"      {note}")
        for f in r["stale"]:
            print("\n".join("      " + ln for ln in short_diff(r["texts"][f], r["new"][f], f)))
        if r["stale"]:
            print(f"      {'rewritten' if args.write else 'regenerate with'}: `{sec.command}`")
    # The parent's own CPU plus its finished workers' (a pool's workers are reaped on exit).
    print(f"{len(results)} sections, {len(stale)} stale; {_cpu_s() - cpu:.1f} CPU-s, "
          f"{time.perf_counter() - wall:.1f} s wall")
    return 1 if stale and not args.write else 0


if __name__ == "__main__":
    sys.exit(main())
