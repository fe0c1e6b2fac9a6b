"""The runs no rule or fit used (docs/validation.md "Runs no rule or fit used",
validation/maxtext_unfitted.py, docs/reference/maxtext_runs_unfitted.json)."""

from __future__ import annotations

import json

import pytest

from sim.chips import efficiency_sources, get_chip
from tests.conftest import REFERENCE_DIR
from validation import maxtext_unfitted as mu
from validation.template import splice
from workloads.training import Remat
from workloads.training.config import Attention

RAWS = json.loads((REFERENCE_DIR / "maxtext_runs_unfitted.json").read_text())
FITTED = json.loads((REFERENCE_DIR / "maxtext_runs.json").read_text())
CACHE = mu.read_cache()
# Three small rows rebuilt from scratch (one per kind: a 2023 README table run on v5p, a v4
# multi-slice run, the int8 tpu-recipes run), about 6 CPU-s together.
REBUILT = ("maxtext-v5p-32b-1x-v5p-128", "maxtext-v4-22b-2x-v4-128",
           "tpu-recipes-v5p-gpt3-175b-int8-v5p-1024")


@pytest.fixture(scope="module")
def loaded():
    return mu.load_runs()


def test_at_least_ten_runs_none_of_them_in_the_fitted_reference(loaded):
    runs, skips = loaded
    ids = [r["id"] for r in RAWS]
    assert len(ids) == len(set(ids)) >= 10
    assert not skips, skips
    assert [r.case.id for r in runs] == ids
    assert not set(ids) & {r["id"] for r in FITTED}
    # No chip of these runs has a fitted factor: the check is out of sample.
    for chip in {r["hardware"]["tpu"] for r in RAWS}:
        assert all(v["kind"] != "fitted"
                   for v in efficiency_sources(get_chip(chip)).values()), chip
    for raw in RAWS:  # every run names its source and its grade
        assert raw["source_repo"] and raw["source_path"] and raw["source_commit"]
        assert raw["quality"] in ("high", "medium", "low") and raw["defaults_used"]


def test_each_run_is_rebuilt_with_its_own_settings(loaded):
    by_id = {r.case.id: r for r in loaded[0]}
    gpt3 = by_id["tpu-recipes-v5p-gpt3-175b-int8-v5p-1024"]
    assert gpt3.matmul_dtype == "int8" and gpt3.case.mesh == "fsdp=64,tensor=8"
    assert gpt3.case.fsdp_grad == "auto" and gpt3.case.step_source == "log"
    big = by_id["tpu-recipes-v5p-llama3.1-405b-v5p-1024"]
    assert big.case.remat == Remat.CUSTOM and big.remat_offload == ("context", "mlpwo")
    assert big.case.vocab_tiling == 4 and big.case.param_dtype == "fp32"
    v4 = by_id["maxtext-v4-52b-2x-v4-384"]
    assert v4.attention == Attention.DOT and v4.case.dcn == "data=2"
    assert v4.case.fsdp_grad == "reduce-scatter" and v4.case.dp_grad_split == "per-layer"
    v5p = by_id["maxtext-v5p-512b-1x-v5p-1024"]
    assert v5p.case.mesh == "fsdp=32,tensor=16" and v5p.case.remat == Remat.FULL
    assert v5p.later.case.mesh == "fsdp=64,tensor=8"
    assert v5p.later.case.measured_step_s == pytest.approx(v5p.case.measured_step_s)


def test_every_run_and_its_later_variant_compiles_on_its_slice(loaded):
    # Every row rebuilds (compiled, about 3 CPU-s for all); three are also simulated below.
    total = {r["id"]: r["hardware"]["total_chips"] for r in RAWS}
    variants = [(r, r.case.id) for r in loaded[0]] + [
        (r.later, r.case.id) for r in loaded[0] if r.later is not None]
    assert len(variants) > len(RAWS)
    for run, rid in variants:
        trace, topo, chip = mu.build(run)
        assert topo.num_chips == total[rid] and chip.name == run.case.chip
        assert trace.ops, rid


def test_derived_steps_are_the_era_formula_over_mfu_times_peak():
    # Closed form, from the stored dims alone: 6 P T (+ 6 H L D S T from November 2023) per
    # chip and step, over MFU x peak; P = the matmul weights and the tied embedding.
    for raw in RAWS:
        acct = raw.get("maxtext_flop_accounting")
        if not acct:
            assert raw["measured"]["step_time_s"]
            continue
        m, b = raw["model"], raw["batch"]
        L, E, H, D, F = (m[k] for k in ("num_layers", "emb_dim", "num_query_heads",
                                         "head_dim", "mlp_dim"))
        P = L * (4 * E * H * D + 2 * E * F) + m["vocab_size"] * E
        assert P == m["params_total_computed"]
        T = b["per_device_batch_size"] * b["seq_len"]
        attn = {"6P": 0, "6P+attn6": 6 * H * L * D * b["seq_len"] * T}[acct["formula_era"]]
        rate = raw["measured"]["mfu_pct"] / 100 * raw["hardware"][
            "peak_bf16_tflops_per_chip_used_by_maxtext"] * 1e12
        # MFU x peak agrees with the published (rounded) TFLOP/s
        assert rate / 1e12 == pytest.approx(raw["measured"]["tflops_per_sec_per_chip"], abs=0.6)
        assert acct["implied_step_time_s"] == pytest.approx((6 * P * T + attn) / rate, rel=1e-4)


def test_the_cache_is_current_and_rows_rebuild_to_it(loaded):
    assert CACHE["runs_file_sha256"] == mu.file_digest()
    assert [r["id"] for r in CACHE["rows"]] == [r["id"] for r in RAWS]
    cached = {r["id"]: r for r in CACHE["rows"]}
    for run in loaded[0]:
        if run.case.id in REBUILT:
            assert mu.predict_with_later(run) == cached[run.case.id], run.case.id
    # The document says the later 1024B layout on v5p-4096 (data=16 x tensor=8) does not fit.
    for n in (1, 2):
        later = cached[f"maxtext-v5p-1024b-{n}x-v5p-4096"]["later"]
        assert later["mesh"].startswith("data=16,fsdp=16,tensor=8")
        assert not later["fits_in_hbm"]
    for r in CACHE["rows"]:
        assert r["error"] == pytest.approx(
            (r["predicted_step_s"] - r["measured_step_s"]) / r["measured_step_s"], abs=2e-6)


def test_the_document_shows_the_cached_table_and_its_summary_line():
    doc = mu.DOC_FILE.read_text()
    assert mu.section(CACHE) in doc
    line = f"{mu.SUMMARY_BEGIN}{mu.summary_line(CACHE)}{mu.SUMMARY_END}"
    assert line in doc and doc.index(line) < doc.index("## How each run is rebuilt")
    assert mu.summary_block() == line
    s = mu.stats(CACHE["rows"])
    assert f"median |error| {100 * s['median_abs']:.1f}%" in line


def test_splice_replaces_between_markers_or_appends():
    assert splice("a <!-- x -->old<!-- /x --> b", "<!-- x -->", "<!-- /x -->",
                     "<!-- x -->new<!-- /x -->") == "a <!-- x -->new<!-- /x --> b"
    assert splice("a\n", "<!-- x -->", "<!-- /x -->", "T") == "a\n\nT\n"


def test_cached_mode_refuses_a_cache_older_than_the_runs_file(tmp_path, capsys):
    runs = tmp_path / "runs.json"
    runs.write_text(json.dumps(RAWS[:1]))
    assert mu.main(["--cached", "--runs", str(runs)]) == 1
    assert "stale" in capsys.readouterr().err


def test_implied_mxu_efficiency_is_the_preset_where_the_step_is_exact_and_scales_with_it():
    eff = get_chip("v5p").mxu_efficiency
    row = {"chip": "v5p", "measured_step_s": 12.0,
           "breakdown": {"mxu_compute_s": 10.0, "exposed_comm_s": 1.5, "hbm_bound_s": 0.4,
                         "vpu_s": 0.1}}
    assert mu.implied_mxu_efficiency(row) == pytest.approx(eff)
    # half the MXU-bound time measured: the matmuls would have to run twice as fast
    row["measured_step_s"] = 2.0 + 5.0
    assert mu.implied_mxu_efficiency(row) == pytest.approx(2 * eff)
    worst = mu.worst_md(CACHE["rows"]).splitlines()
    assert len(worst) == 2 + min(mu.WORST_SHOWN, len(CACHE["rows"]))
    assert mu.worst(CACHE["rows"])["id"] in worst[2]
