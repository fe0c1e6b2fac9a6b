"""docs/validation.md's generated tables are what the code now produces: a handful of rows
across the sections recomputed with the scripts' own code (a held-out MaxText run on one and on
four slices, a run no rule or fit used, an XLA peak-HBM row from its cache, an imported HLO
fixture's table, the energy and twisted-tori sections whole, the saved fit's objective on
v5e's fit half) and compared with the committed text, about 6 CPU-s; `python -m
validation.check` regenerates every section (validation/README.md gives its cost). And the
check itself: it names a stale section, and each script's splice leaves the rest of the
document as it is."""

from __future__ import annotations

import pytest

from validation import (
    check,
    energy,
    hlo_import,
    maxtext_doc,
    maxtext_predict,
    maxtext_runs,
    serving_jetstream,
    twisted,
    xla_compile,
    xla_memory,
    xla_memory_programs,
)
from validation import maxtext_unfitted as mu

DOC = (check.ROOT / check.VALIDATION_MD).read_text(encoding="utf-8")
LINES = DOC.splitlines()
# Held out of the fit (even-indexed): a v6e run on one host and a v5e run over 4 slices (DCN).
HELD_OUT = ("tpu-recipes-v6e-mistral-7b-v6e-8", "maxtext-v5e-32b-4x-v5e-256")
UNFITTED = "maxtext-v5p-32b-2x-v5p-128"  # 2 slices, with a later script's layout
PEAK = "v5e64_fsdp64_full_s2048_l2"  # compiled after its rules, as their check
FIXTURE = "train_fsdp_tp_v5e16"


def committed(row: str) -> list[str]:
    """The document's lines that start with `row`'s first cell (what a stale row shows)."""
    first = row.split(" | ")[0]
    return [ln for ln in LINES if ln.startswith(first + " |")]


def assert_row(row: str) -> None:
    assert row in LINES, f"stale row:\n  recomputed: {row}\n  committed:  {committed(row)}"


@pytest.mark.parametrize("run_id", HELD_OUT)
def test_held_out_maxtext_rows_are_current(run_id):
    cases, _ = maxtext_runs.load_cases(maxtext_runs.RUNS_FILE)
    case = next(c for c in cases if c.id == run_id)
    assert not case.fit_subset and not case.low_quality
    row = maxtext_doc._runs_table([maxtext_predict.predict(case)]).splitlines()[-1]
    assert_row(row)


def test_an_unfitted_row_is_current():
    runs, _ = mu.load_runs()
    run = next(r for r in runs if r.case.id == UNFITTED)
    assert run.later is not None
    assert_row(mu.table_md([mu.predict_with_later(run)]).splitlines()[-1])


def test_a_peak_hbm_row_from_the_xla_cache_is_current():
    cache = xla_compile.load_cache(xla_memory_programs.CACHE)
    table, errs = xla_memory.table({PEAK: cache[PEAK]})
    assert set(errs) == {PEAK}
    assert_row(table.splitlines()[-1])


def test_an_imported_hlo_fixtures_table_is_current():
    lines = hlo_import.fixture_lines(FIXTURE)
    assert lines[0].startswith(f"### {FIXTURE}:") and len(lines) > 5
    start = LINES.index(lines[0])
    assert LINES[start:start + len(lines)] == lines


def test_the_energy_and_twisted_sections_are_current():
    assert energy.updated(DOC) == DOC
    assert twisted.updated(DOC) == DOC


def test_the_check_names_a_stale_section_with_its_diff():
    block = DOC[DOC.index(twisted.BEGIN):DOC.index(twisted.END)]
    line = next(ln for ln in block.splitlines() if ln.startswith("| 1,024 KiB |"))
    cells = line.split(" | ")
    cells[1] = f"{float(cells[1]) + 1:.3f}"
    edited = DOC.replace(line, " | ".join(cells))
    r = check.run_section("twisted", {check.VALIDATION_MD: edited})
    assert check.is_stale(r) and r["stale"] == [check.VALIDATION_MD]
    diff = check.short_diff(edited, r["new"][check.VALIDATION_MD], check.VALIDATION_MD)
    assert f"-{' | '.join(cells)}" in diff and f"+{line}" in diff
    assert r["new"][check.VALIDATION_MD] == DOC
    assert not check.is_stale(check.run_section("twisted", {check.VALIDATION_MD: DOC}))


def test_every_section_of_the_document_sits_between_its_own_markers_in_order():
    markers = [(hlo_import.MARKER, hlo_import.END),
               (xla_memory_programs.MARKER, xla_memory_programs.END),
               ("<!-- chakra -->", "<!-- /chakra -->"),
               (serving_jetstream.MARKER, serving_jetstream.END),
               (twisted.BEGIN, twisted.END),
               ("<!-- int8 -->", "<!-- /int8 -->"),
               (mu.BEGIN, mu.END),
               ("<!-- logits-dtype -->", "<!-- /logits-dtype -->")]
    at = 0
    for begin, end in markers:
        assert DOC.count(begin) == 1 and DOC.count(end) == 1, begin
        assert at < DOC.index(begin) < DOC.index(end), begin
        at = DOC.index(end)
    assert DOC.index(maxtext_doc.TAIL_MARKER) == DOC.index(hlo_import.MARKER)


@pytest.mark.parametrize("module", [hlo_import, xla_memory, serving_jetstream])
def test_a_spliced_section_leaves_the_rest_of_the_document_as_it_is(module):
    begin = module.MARKER
    end = module.END
    new = module.updated(DOC, f"{begin}\nnew text\n{end}")
    i, j = DOC.index(begin), DOC.index(end) + len(end)
    assert new == DOC[:i] + f"{begin}\nnew text\n{end}" + DOC[j:]
    assert new.count("<!-- ") == DOC.count("<!-- ")


def test_every_section_has_a_command_and_its_files_exist():
    for s in check.SECTIONS:
        assert s.command.startswith("python -m validation."), s.name
        assert all((check.ROOT / f).is_file() for f in s.files), s.name


def test_every_generated_section_of_the_docs_is_one_the_check_regenerates():
    for path in (check.VALIDATION_MD, check.HLO_MD):
        text = (check.ROOT / path).read_text(encoding="utf-8")
        assert check.unregistered(path, text) == [], path
    assert check.unregistered(check.VALIDATION_MD, DOC + "\n<!-- new-table -->\n") == [
        "<!-- new-table -->"]


def test_the_saved_fit_holds_on_the_current_code_and_a_moved_objective_is_stale():
    # v5e's fit half (its runs are the cheapest to predict, about 2 CPU-s): at the shipped
    # preset, which is the saved fit's point, the objective is the saved one.
    import dataclasses

    from validation.maxtext_fit import subset_cases

    fit = next(f for f in maxtext_doc.load_fits() if (f.generation, f.subset, f.custom_remat)
               == ("v5e", "odd", maxtext_runs.NAMED))
    cases, _ = maxtext_runs.load_cases(maxtext_runs.RUNS_FILE)
    preds = [maxtext_predict.predict(c) for c in subset_cases(cases, "v5e", "odd")]
    assert maxtext_doc.stale_fits([fit], cases, preds) == []
    moved = maxtext_doc.stale_fits([dataclasses.replace(fit, objective=fit.objective + 1e-3)],
                                   cases, preds)
    assert len(moved) == 1 and moved[0].startswith("STALE v5e odd half")
    tiny = maxtext_doc.stale_fits([dataclasses.replace(fit, objective=fit.objective + 1e-8)],
                                  cases, preds)
    assert len(tiny) == 1 and "below the 4 decimals" in tiny[0]
