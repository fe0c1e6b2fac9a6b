"""The serving plan search (`sim.plan_serving`, sim/serving/plan.py) against brute force: every
replica count of every combination run, the fewest that meet the SLO found by hand."""

from __future__ import annotations

import pytest

from sim.runs import ServeRequest, run
from sim.serving.plan import ServePlanConfig, plan_serving
from topologies.errors import Said, TpusimError
from workloads.models import MlpKind, TransformerSpec

TINY = TransformerSpec(name="serve-tiny", num_layers=2, d_model=1024, num_heads=8,
                       num_kv_heads=8, head_dim=128, d_ff=4096, mlp=MlpKind.SWIGLU,
                       vocab_size=8192)
# One 2x2 replica serves about 3,700 requests/s of these at batch 16: 9,000/s needs several.
BASE = ServeRequest(model=TINY, chip="v5e", shape="2x2", mesh="tensor=4", rate=9000.0,
                    requests=400, prompt_tokens="uniform:16,256", output_tokens="uniform:8,64",
                    max_batch=16, slo="ttft=0.002,tpot=0.0002", seed=1)


def _meets(s, attainment):
    return not s["saturated"] and s["slo_attainment"] >= attainment


def test_the_plan_finds_the_fewest_replicas_brute_force_finds_and_the_most_tokens_per_chip():
    cfg = ServePlanConfig(meshes=("tensor=4", "data=2,tensor=2"), splits=(None, (1, 1)),
                          max_replicas=6, attainment=0.95)
    plan = plan_serving(BASE, cfg)
    brute_runs = 0
    for row in plan.rows:
        split = None if row["split"] == "colocated" else (1, 1)
        unit = 1 if split is None else 2
        fewest = None
        for k in range(1, cfg.max_replicas // unit + 1):
            kw = {"mesh": row["mesh"], "replicas": k} if split is None else \
                {"mesh": row["mesh"], "prefill_replicas": k, "decode_replicas": k}
            brute_runs += 1
            if _meets(run(BASE.replace(**kw)).summary, cfg.attainment):
                fewest = k * unit
                break
        assert row["replicas"] == fewest, row
    found = [r for r in plan.rows if r["meets_slo"]]
    assert found and max(r["replicas"] for r in found) > 1  # not a trivial case
    best = max(found, key=lambda r: r["tokens_per_s_per_chip"])
    assert plan.best is not None
    assert plan.best["tokens_per_s_per_chip"] == best["tokens_per_s_per_chip"]
    assert plan.best["num_chips"] == min(r["num_chips"] for r in found)


def test_a_plan_that_cannot_meet_the_slo_says_why_and_has_no_best():
    plan = plan_serving(BASE.replace(slo="ttft=0.00001"),
                        ServePlanConfig(meshes=("tensor=4",), max_replicas=2))
    assert plan.best is None
    assert plan.rows[0]["meets_slo"] is False and "misses the SLO" in plan.rows[0]["note"]


def test_a_plan_without_a_rate_or_an_slo_is_refused_in_one_line():
    with pytest.raises(TpusimError, match="rate to serve") as e:
        plan_serving(BASE.replace(slo=None))
    assert "\n" not in str(e.value)
    with pytest.raises(TpusimError, match="attainment 1.5"):
        plan_serving(BASE, ServePlanConfig(attainment=1.5))


def _cli(capsys, *words):
    from sim.cli import main

    code = main(list(words))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_serve_on_the_command_line_is_the_library_search(tmp_path, capsys):
    import json

    import yaml

    model = tmp_path / "tiny.yaml"
    model.write_text(yaml.safe_dump(TINY.to_dict()))
    words = ["--model", str(model), "--chip", "v5e", "--shape", "2x2", "--rate", "9000",
             "--requests", "400", "--prompt-tokens", "uniform:16,256", "--output-tokens",
             "uniform:8,64", "--max-batch", "16", "--slo", "ttft=0.002,tpot=0.0002",
             "--seed", "1", "--mesh", "tensor=4", "--splits", "colocated,1:1",
             "--max-replicas", "4", "--attainment", "0.95"]
    code, out, _ = _cli(capsys, "plan", "--serve", *words, "--json")
    assert code == 0
    got = json.loads(out)
    want = plan_serving(BASE, ServePlanConfig(meshes=("tensor=4",), splits=(None, (1, 1)),
                                              max_replicas=4, attainment=0.95))
    assert got["rows"] == json.loads(json.dumps(want.rows))
    assert got["best"] == json.loads(json.dumps(want.best)) and got["runs"] == want.runs
    # `plan --serve` is `plan-serve`; the text report names the winner.
    code, text, _ = _cli(capsys, "plan-serve", *words, "--out", str(tmp_path / "o"))
    assert code == 0 and "best: 2x2 colocated tensor=4" in text
    assert text.startswith("plan --serve: serve-tiny at 9000 requests/s")
    assert (tmp_path / "o" / "candidates.csv").exists()


@pytest.mark.parametrize("extra, want", [
    (["--splits", "1:0"], "--splits entry '1:0' is not a deployment"),
    (["--max-batches", "16,,32"], "--max-batches '16,,32' has an empty entry"),
    (["--attainment", "2"], "--attainment 2.0 is not a share"),
])
def test_plan_serve_refuses_a_bad_search_space_in_one_line(capsys, extra, want):
    code, _, err = _cli(capsys, "plan", "--serve", "--model", "llama3-8b", "--slice", "v5e-4",
                        "--rate", "1", "--requests", "4", "--prompt-tokens", "fixed:16",
                        "--output-tokens", "fixed:2", "--slo", "ttft=1", *extra)
    assert code == 2 and want in err and err.count("\n") == 1


def test_the_plan_searches_replica_slices_as_separate_plans_would():
    # Searching two replica slices at once gives each slice's rows as a plan on that slice
    # alone gives them, and the winner is the better of the two; a shape keeps the base's chip.
    cfg = ServePlanConfig(meshes=("tensor=4",), max_replicas=4, attainment=0.95)
    both = plan_serving(BASE, ServePlanConfig(replica_slices=("2x2", "v5e-8"),
                                              meshes=("tensor=4", "tensor=8"), max_replicas=4,
                                              attainment=0.95))
    alone = {"2x2": plan_serving(BASE, cfg),
             "v5e-8": plan_serving(BASE.replace(slice="v5e-8", shape=None, chip=None,
                                                mesh="tensor=8"),
                                   ServePlanConfig(meshes=("tensor=8",), max_replicas=4,
                                                   attainment=0.95))}
    by = {(r["slice"], r["mesh"]): r for r in both.rows}
    assert set(by) == {("2x2", "tensor=4"), ("2x2", "tensor=8"), ("v5e-8", "tensor=4"),
                       ("v5e-8", "tensor=8")}
    for name, mesh in (("2x2", "tensor=4"), ("v5e-8", "tensor=8")):
        want = {k: v for k, v in alone[name].rows[0].items() if k != "slice"}
        got = {k: v for k, v in by[(name, mesh)].items() if k != "slice"}
        assert got == want
    # A mesh that does not cover a slice's chips is a row with the reason, not a failure.
    assert "covers 8 chips" in by[("2x2", "tensor=8")]["note"]
    # kept as a Said: the CLI writes the settings it names as flags (`ServePlan.table(spell)`)
    assert isinstance(by[("2x2", "tensor=8")]["note"], Said)
    assert not by[("v5e-8", "tensor=4")]["meets_slo"]
    met = [r for r in both.rows if r["meets_slo"]]
    assert both.best == max(met, key=lambda r: r["tokens_per_s_per_chip"])


def test_a_replica_slice_that_does_not_exist_is_refused_before_any_run():
    with pytest.raises(TpusimError, match="replica_slices entry 'v5e-3'"):
        plan_serving(BASE, ServePlanConfig(replica_slices=("v5e-3",)))


def test_a_candidate_whose_weights_leave_no_room_is_a_row_saying_so_never_the_best():
    # Nothing unrunnable presented as a result (issue 30): with HBM cut to 60 MB, the tiny
    # model's ~100 MB of weights on every chip of a data=4 replica leave no KV cache, while
    # tensor=4 (a quarter each) serves; the plan keeps the first as a row with the reason.
    plan = plan_serving(BASE.replace(overrides={"hbm_bytes": "6e7"}),
                        ServePlanConfig(meshes=("tensor=4", "data=4"), max_replicas=4,
                                        attainment=0.95))
    by = {r["mesh"]: r for r in plan.rows}
    unfit = by["data=4"]
    assert not unfit["meets_slo"] and unfit["replicas"] is None
    assert unfit["tokens_per_s_per_chip"] is None
    assert "does not fit a replica's KV cache" in str(unfit["note"])
    assert by["tensor=4"]["meets_slo"] and plan.best["mesh"] == "tensor=4"
