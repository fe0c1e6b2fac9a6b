"""Tests for the plan search (sim/studies/plan_*.py) and `tpusim plan`: the winner is at least
as good as every configuration of its search space tried by hand (brute force on a small pod),
memory pruning and the lower bound never drop a configuration that would win, and the CLI's
outputs and errors."""

from __future__ import annotations

import itertools
import json
import pickle
from pathlib import Path

import pytest

from sim.chips import get_chip
from sim.cli import main, request_from_argv
from sim.studies import plan_bounds
from sim.studies.plan_jobs import lower_bounds, pipeline_bounds, refine_and_run
from sim.studies.plan_report import explain
from sim.studies.plan_search import run_plan
from sim.studies.plan_space import PlanConfig, enumerate_candidates
from sim.studies.points import run_point
from topologies.errors import TpusimError
from topologies.mesh import LogicalMesh
from topologies.slices import resolve_topology
from workloads.training import (
    Remat,
    TrainingConfig,
    compile_training_step,
    estimate_training_memory,
)
from workloads.zoo import load_model


@pytest.fixture
def tiny_model(tmp_path: Path) -> str:
    path = tmp_path / "tiny.yaml"
    path.write_text("base: llama3-8b\nname: tiny\nnum_layers: 2\n", encoding="utf-8")
    return str(path)


def _req(argv: list[str]):
    """The typed request of a `tpusim train ...` command line (what the plan's jobs take)."""
    return request_from_argv(argv)


def _base(model: str, pod_flags: list[str]):
    """The pod and model every candidate of a plan shares (its own settings replace the rest)."""
    return _req(["train", *pod_flags, "--model", model, "--seq-len", "1", "--batch-per-chip",
                 "1", "--mesh", "fsdp=1"])


def _pod(shape: str = "2x2"):
    chip = get_chip("v5e")
    topo = resolve_topology(chip_name="v5e", wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape=shape)
    return chip, topo


def test_memory_estimate_is_the_compilers_and_never_above_the_simulated_peak(tiny_model):
    from sim.engine.replay import replay

    chip, topo = _pod()
    model = load_model(tiny_model)
    for mesh, remat, mb in [(("fsdp", 4),), "full", 1], [(("fsdp", 2), ("tensor", 2)), "none", 2], \
            [(("pipeline", 2), ("tensor", 2)), "minimal", 2]:
        cfg = TrainingConfig(seq_len=1024, batch_per_chip=2, remat=Remat(remat), microbatches=mb)
        est = estimate_training_memory(model, LogicalMesh(axes=mesh), 4, cfg)
        trace = compile_training_step(model, LogicalMesh(axes=mesh), 4, cfg)
        assert est["static_bytes"] == trace.meta.static_hbm_bytes
        assert est["activations_bytes"] == trace.meta.activation_bytes_estimate
        peak = replay(trace, chip, topo).hbm_peak_bytes
        assert est["static_bytes"] + est["activations_bytes"] <= peak
        argv = ["train", "--chip", "v5e", "--shape", "2x2", "--model", tiny_model, "--seq-len",
                "1024", "--batch-per-chip", "2", "--mesh", ",".join(f"{a}={v}" for a, v in mesh),
                "--remat", remat, "--microbatches", str(mb)]
        bound = lower_bounds((_req(argv), [mesh]))["lower_bounds_s"][0]
        assert 0 < bound <= run_point(_req(argv))["result"]["step_time_s"]


def test_plan_beats_or_ties_every_configuration_of_its_space_by_brute_force(tiny_model):
    chip, topo = _pod()
    model = load_model(tiny_model)
    cfg = PlanConfig(seq_len=1024, global_batch=8, top=3, axes=("data", "fsdp", "tensor",
                     "pipeline"), remat=("full", "none"), microbatches=(1, 2))
    res = run_plan(_base(tiny_model, ["--chip", "v5e", "--shape", "2x2"]), model, topo, chip, cfg,
                   workers=1, quiet=True)
    assert res.counts["bound_violated"] == 0
    best = res.best
    # By hand: every factorization of 4 chips into these axes, in every axis order, every
    # remat policy and every microbatch count, each simulated as `tpusim train`.
    sizes = {"data": [1, 2, 4], "fsdp": [1, 2, 4], "tensor": [1, 2, 4], "pipeline": [1, 2]}
    tried = []
    for combo in itertools.product(*sizes.values()):
        if combo[0] * combo[1] * combo[2] * combo[3] != 4:
            continue
        axes = [(a, v) for a, v in zip(sizes, combo, strict=True) if v > 1]
        for order, remat, mb in itertools.product(itertools.permutations(axes), cfg.remat,
                                                  cfg.microbatches):
            mesh = ",".join(f"{a}={v}" for a, v in order)
            o = run_point(_req(["train", "--chip", "v5e", "--shape", "2x2", "--model", tiny_model,
                                "--seq-len", "1024", "--batch-per-chip", "2", "--mesh", mesh,
                                "--remat", remat, "--microbatches", str(mb)]))
            r = o.get("result")
            if r and r["fits_in_hbm"]:
                tried.append((r["step_time_s"], mesh, remat, mb))
    assert len(tried) > 20
    assert best["step_time_s"] <= min(tried)[0]
    # The winner is one of the configurations tried by hand, with the same step time.
    assert any(t[0] == best["step_time_s"] and t[2] == best["remat"] for t in tried)
    times = list(res.top(3)["step_time_s"])
    assert times == sorted(times) and len(times) == 3
    # Simulating in bound order and stopping early changes nothing in the top K: every
    # candidate of the plan's space (skipped ones included) ranked by its brute-force step
    # gives the same top K.
    assert res.counts["skipped_by_bound"] > 0
    by_hand = {(m, r, b): t for t, m, r, b in tried}
    cands = res.table.to_dict("records")
    ranked = sorted((by_hand[(c["mesh"], c["remat"], c["microbatches"])], k)
                    for k, c in enumerate(cands) if (c["mesh"], c["remat"], c["microbatches"])
                    in by_hand)
    assert len(ranked) >= 10
    assert [t for t, _k in ranked[:3]] == times
    # No pipeline candidate could enter the top K: none built its stage programs.
    assert res.table["mesh"].str.contains("pipeline").sum() > 10
    assert res.counts["pipeline_groups_bounded_in_full"] == 0


def test_pipeline_groups_bounded_in_full_only_when_they_reach_the_front(tiny_model):
    # A top K that needs pipeline candidates: their groups get the stage programs' bounds
    # (and HBM bound) before they are simulated, and the plan equals the brute-force oracle.
    chip, topo = _pod()
    model = load_model(tiny_model)
    cfg = PlanConfig(seq_len=1024, global_batch=8, top=4, axes=("fsdp", "pipeline"),
                     remat=("full",), microbatches=(1, 2))
    flags = ["--chip", "v5e", "--shape", "2x2"]
    fast = run_plan(_base(tiny_model, flags), model, topo, chip, cfg, workers=1, quiet=True)
    oracle = run_plan(_base(tiny_model, flags), model, topo, chip, cfg, workers=1, quiet=True,
                      prune_by_bound=False, refuse_by_hbm_bound=False,
                      stop_out_of_memory=False)
    groups = {(r["mesh"].replace("pipeline=2,", "").replace(",pipeline=2", ""), r["remat"],
               r["microbatches"]) for r in oracle.table.to_dict("records")
              if "pipeline" in r["mesh"]}
    assert oracle.counts["pipeline_groups_bounded_in_full"] == len(groups) == 2
    assert fast.counts["pipeline_groups_bounded_in_full"] >= 1
    cols = ["mesh", "placement", "remat", "microbatches", "step_time_s", "hbm_peak_bytes"]
    assert fast.top(4)["mesh"].str.contains("pipeline").any()
    assert fast.top(4)[cols].equals(oracle.top(4)[cols])
    # A simulated pipeline's bound is its stage programs' bound, as in the oracle.
    pipe = fast.top(4)[fast.top(4)["mesh"].str.contains("pipeline")]
    assert pipe["lower_bound_s"].equals(oracle.top(4).loc[pipe.index, "lower_bound_s"])


def test_memory_pruning_drops_only_what_cannot_fit(tiny_model):
    chip, topo = _pod()
    model = load_model(tiny_model)
    cfg = PlanConfig(seq_len=8192, global_batch=32, remat=("none", "full"),
                     microbatches=(1,), axes=("fsdp", "tensor"))
    cands, counts = enumerate_candidates(model, topo, chip, cfg)
    assert counts["pruned_by_memory"] > 0
    assert {c.remat for c in cands} == {"full"}
    assert all(c.hbm_estimate_bytes <= chip.hbm_bytes for c in cands)


def test_plan_optimizer_reaches_every_candidates_estimate_and_train_flags(tiny_model):
    chip, topo = _pod()
    model = load_model(tiny_model)
    cfg = dict(seq_len=1024, global_batch=16, remat=("full",), microbatches=(1,),
               axes=("fsdp",), placements=False)
    adam, _ = enumerate_candidates(model, topo, chip, PlanConfig(**cfg))
    sgd, _ = enumerate_candidates(model, topo, chip, PlanConfig(**cfg, optimizer="sgd"))
    assert [c.mesh for c in sgd] == [c.mesh for c in adam]
    for a, s in zip(adam, sgd, strict=True):
        # No fp32 moments: 8 bytes per local parameter fewer in the memory estimate.
        assert s.hbm_estimate_bytes < a.hbm_estimate_bytes
        assert s.train_settings()["optimizer"] == "sgd"
        assert a.train_settings()["optimizer"] == "adam"
    with pytest.raises(TpusimError, match="optimizer 'sgdd' is not an optimizer"):
        PlanConfig(**cfg, optimizer="sgdd")
    # SGD has no state: a list of state dtypes would only repeat every candidate.
    with pytest.raises(TpusimError, match="optimizer_dtype 'fp32,bf16' with optimizer sgd"):
        PlanConfig(**cfg, optimizer="sgd", optimizer_dtypes=("fp32", "bf16"))


def test_plan_gather_dtype_reaches_every_candidates_step(capsys, tiny_model):
    # f32 master weights gathered in bf16 (MaxText's default): the plan's step is `tpusim
    # train`'s with the same flags, and faster than gathering the f32 weights whole.
    pod = ["--chip", "v5e", "--shape", "2x2", "--model", tiny_model, "--seq-len", "1024"]

    def best(*extra: str) -> dict:
        rc = main(["plan", *pod, "--global-batch", "8", "--top", "1", "--workers", "1",
                   "--axes", "fsdp", "--remat", "full", "--microbatches", "1",
                   "--default-placement", "--param-dtype", "fp32", "--json", "--out", "",
                   *extra])
        captured = capsys.readouterr()
        assert rc == 0, captured.err
        return json.loads(captured.out)["best"]

    cast, whole = best("--gather-dtype", "bf16"), best()
    assert cast["mesh"] == whole["mesh"] == "fsdp=4"
    # Each row says what its train command ran: the dtype weights are gathered in and the rule.
    assert (cast["gather_dtype"], whole["gather_dtype"]) == ("bf16", "fp32")
    assert cast["optimizer"] == whole["optimizer"] == "adam"
    rc = main(["train", *pod, "--batch-per-chip", "2", "--mesh", "fsdp=4", "--remat", "full",
               "--param-dtype", "fp32", "--gather-dtype", "bf16", "--json"])
    train = json.loads(capsys.readouterr().out)
    assert rc == 0 and cast["step_time_s"] == train["step_time_s"]
    assert cast["step_time_s"] < whole["step_time_s"]
    with pytest.raises(TpusimError, match="^gather_dtype 'bf17' is not a known dtype"):
        PlanConfig(seq_len=1024, global_batch=8, gather_dtype="bf17")


def test_every_microbatch_count_whose_estimate_fits_is_a_candidate(tiny_model):
    # The estimate is a lower bound of the simulated peak: a count that fits on paper may not
    # fit when simulated, so the larger counts must stay in the search, not only the fewest.
    chip, topo = _pod()
    model = load_model(tiny_model)
    cfg = PlanConfig(seq_len=1024, global_batch=16, remat=("full",), microbatches=(1, 2, 4),
                     axes=("fsdp",), placements=False)
    cands, _counts = enumerate_candidates(model, topo, chip, cfg)
    per_mesh: dict = {}
    for c in cands:
        per_mesh.setdefault((c.mesh, c.placement), set()).add(c.microbatches)
    assert per_mesh and all(v == {1, 2, 4} for v in per_mesh.values())


def test_plan_cli_prints_the_top_k_and_writes_the_frontier(tmp_path, capsys, tiny_model):
    out = tmp_path / "plan"
    rc = main(["plan", "--chip", "v5e", "--shape", "2x2", "--model", tiny_model,
               "--seq-len", "1024", "--global-batch", "8", "--top", "2", "--workers", "1",
               "--axes", "fsdp,tensor", "--remat", "full", "--json", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    s = json.loads(captured.out)
    assert len(s["top"]) == 2 and s["top"][0]["rank"] == 1
    assert s["top"][0]["step_time_s"] <= s["top"][1]["step_time_s"]
    assert s["best"]["mesh"] == s["top"][0]["mesh"] and s["explanation"]
    assert "\n" not in s["explanation"]
    assert (out / "frontier.png").stat().st_size > 0
    assert (out / "candidates.parquet").is_file() and (out / "summary.json").is_file()


def test_plan_exhaustive_simulates_everything_and_gives_the_same_top_k(capsys, tiny_model):
    def plan(*extra: str) -> dict:
        rc = main(["plan", "--chip", "v5e", "--shape", "2x2", "--model", tiny_model,
                   "--seq-len", "1024", "--global-batch", "8", "--top", "3", "--workers", "1",
                   "--axes", "fsdp,tensor,pipeline", "--remat", "full", "--microbatches", "1",
                   "--json", "--out", "", *extra])
        captured = capsys.readouterr()
        assert rc == 0, captured.err
        return json.loads(captured.out)

    fast, brute = plan(), plan("--exhaustive")
    n = brute["searched"]["candidates"]
    assert brute["searched"]["simulated"] == n == fast["searched"]["candidates"]
    assert brute["searched"]["skipped_by_bound"] == 0
    assert fast["searched"]["simulated"] < n
    # The same rows apart from their lower bounds (the default sharpens the ones it needs).
    drop = ("lower_bound_s",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in fast["top"]] == \
        [{k: v for k, v in r.items() if k not in drop} for r in brute["top"]]


@pytest.mark.parametrize("objective", ["energy", "cost"])
def test_plan_by_energy_or_cost_ranks_by_it_and_matches_the_exhaustive_search(
        capsys, tiny_model, objective):
    def plan(*extra: str) -> dict:
        rc = main(["plan", "--chip", "v5e", "--shape", "2x2", "--model", tiny_model,
                   "--seq-len", "1024", "--global-batch", "8", "--top", "3", "--workers", "1",
                   "--axes", "fsdp,tensor", "--remat", "full,none", "--microbatches", "1",
                   "--objective", objective, "--json", "--out", "", *extra])
        captured = capsys.readouterr()
        assert rc == 0, captured.err
        return json.loads(captured.out)

    fast, brute = plan(), plan("--exhaustive")
    assert fast["objective"] == objective
    key = "energy_j" if objective == "energy" else "cost_per_million_tokens_usd"
    values = [r[key] for r in brute["top"]]
    assert values == sorted(values)  # ranked by the objective, not the step time
    ok = [r for r in brute["top"] if r["status"] == "ok"]
    assert ok[0][key] == min(r[key] for r in ok)
    drop = ("lower_bound_s",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in fast["top"]] == \
        [{k: v for k, v in r.items() if k not in drop} for r in brute["top"]]


def test_plan_by_cost_needs_a_price(capsys, tiny_model):
    rc = main(["plan", "--chip", "v5e", "--shape", "2x2", "--model", tiny_model, "--seq-len",
               "1024", "--global-batch", "8", "--objective", "cost", "--out", "",
               "--set", "usd_per_chip_hour=none"])
    err = capsys.readouterr().err
    assert rc == 2 and "no list price" in err and err.count("\n") == 1


def test_plan_exhaustive_refuses_more_candidates_than_max_simulations_before_running(
        capsys, tiny_model, monkeypatch, tmp_path):
    from sim.studies import plan_search

    def plan(*extra: str) -> tuple[int, str, str]:
        rc = main(["plan", "--chip", "v5e", "--shape", "2x2", "--model", tiny_model,
                   "--seq-len", "1024", "--global-batch", "8", "--top", "2", "--workers", "1",
                   "--axes", "fsdp,tensor", "--remat", "full,none", "--microbatches", "1",
                   "--json", "--out", "", *extra])
        captured = capsys.readouterr()
        return rc, captured.out, captured.err

    rc, out, _err = plan()
    n = json.loads(out)["searched"]["candidates"]
    assert rc == 0 and n > 2
    # One over the limit: refused, with the count, the limit and the flag, before any bound
    # or simulation runs.
    monkeypatch.setattr(plan_search, "JobPool", lambda *a: pytest.fail("ran something"))
    rc, out, err = plan("--exhaustive", "--max-simulations", str(n - 1))
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert (f"plan --exhaustive would simulate {n} candidates to the end, over the limit of "
            f"{n - 1}") in err and f"--max-simulations {n} to run them all" in err
    # Nothing written: not even the output directory.
    rc, out, err = plan("--exhaustive", "--max-simulations", str(n - 1),
                        "--out", str(tmp_path / "plan-out"))
    assert rc == 2 and out == "" and not (tmp_path / "plan-out").exists()
    # The default limit applies without the flag.
    monkeypatch.setattr(plan_search, "EXHAUSTIVE_MAX_SIMULATIONS", n - 1)
    rc, _out, err = plan("--exhaustive")
    assert rc == 2 and f"over the limit of {n - 1}" in err
    monkeypatch.undo()
    # At the limit it runs every candidate.
    rc, out, err = plan("--exhaustive", "--max-simulations", str(n))
    assert rc == 0, err
    assert json.loads(out)["searched"]["simulated"] == n


@pytest.mark.parametrize("argv, message", [
    (["--axes", "fsdp,bogus"], "--axes: 'bogus' is not a mesh axis"),
    (["--max-simulations", "5"], "--max-simulations 5 limits --exhaustive only"),
    (["--exhaustive", "--max-simulations", "0"], "--max-simulations 0 must be a positive "
                                                 "integer"),
    (["--remat", "sometimes"], "--remat 'sometimes' is not a remat policy"),
    (["--microbatches", "1,x"], "--microbatches '1,x' must list integers"),
    (["--global-batch", "0"], "--global-batch 0 must be a positive integer"),
    (["--set", "nonsense=1"], "nonsense"),
    (["--shape", "16x16", "--max-tensor", "256", "--max-data", "256", "--max-sequence", "256",
      "--param-dtype", "bf16,fp32,int8", "--grad-dtype", "bf16,fp32", "--optimizer-dtype",
      "fp32,bf16"], "plan would consider 34,992 combinations of axis sizes and settings, over "
                    "the limit of 10,000"),
    (["--dask", "tcp://127.0.0.1:9"], "--dask tcp://127.0.0.1:9: no Dask scheduler answered"),
])
def test_plan_bad_input_is_one_line(capsys, tiny_model, argv, message):
    base = {"--chip": "v5e", "--shape": "2x2", "--model": tiny_model, "--seq-len": "1024",
            "--global-batch": "8"}
    switches = [a for a in argv if a == "--exhaustive"]
    argv = [a for a in argv if a != "--exhaustive"]
    for k, v in zip(argv[::2], argv[1::2], strict=True):
        base[k] = v
    rc = main(["plan", *itertools.chain.from_iterable(base.items()), *switches, "--out", ""])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1


def test_plan_config_needs_a_batch_axis():
    with pytest.raises(TpusimError, match="must include fsdp or data"):
        PlanConfig(seq_len=8, global_batch=8, axes=("tensor",))


def test_python_api_plan_takes_names_or_objects_and_matches_the_cli(capsys, tiny_model):
    import sim

    model = load_model(tiny_model)
    kw = dict(shape="2x2", seq_len=1024, global_batch=8, top=2, axes=("fsdp", "tensor"),
              remat=("full",), overrides={"hbm_bytes_per_s": "x2"})
    by_object = sim.plan(model=model, chip=sim.get_chip("v5e"), **kw)
    by_name = sim.plan(model=tiny_model, chip="v5e", **kw)
    assert by_object.best["step_time_s"] == by_name.best["step_time_s"]
    rc = main(["plan", "--chip", "v5e", "--shape", "2x2", "--model", tiny_model, "--seq-len",
               "1024", "--global-batch", "8", "--top", "2", "--axes", "fsdp,tensor", "--remat",
               "full", "--set", "hbm_bytes_per_s=x2", "--workers", "1", "--json", "--out", ""])
    cli_best = json.loads(capsys.readouterr().out)["best"]
    assert rc == 0 and cli_best["step_time_s"] == by_name.best["step_time_s"]
    assert cli_best["mesh"] == by_name.best["mesh"]


@pytest.mark.parametrize("chip_name, shape", [("v5e", "16x4"), ("v5p", "4x4x4")])
def test_collective_floor_never_exceeds_the_simulated_collective(chip_name, shape):
    # The closed form plan bounds candidates with: (N-1)/N of V through two links per axis
    # spanned, at least one hop; every simulated algorithm (ring, bidirectional, multi-axis,
    # auto) on wrapped and unwrapped axes and strided factors takes at least that long.
    from sim.engine.costs import cost_collective
    from sim.studies.plan_bounds import collective_floor_s
    from topologies.groups import axis_factor

    chip = get_chip(chip_name)
    topo = resolve_topology(chip_name=chip_name, wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape=shape)
    dims = dict(zip("xyz", topo.shape, strict=False))
    groups = [(axis_factor(topo, "x", dims["x"], 1),),
              (axis_factor(topo, "x", 2, 1),),
              (axis_factor(topo, "x", 2, dims["x"] // 2),),
              (axis_factor(topo, "x", dims["x"], 1), axis_factor(topo, "y", dims["y"], 1))]
    checked = 0
    for gaxes in groups:
        for kind in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all",
                     "collective-permute"):
            for nbytes in (4096, 64 * 2**20):
                floor = collective_floor_s(chip, topo, kind, gaxes, nbytes)
                sim_t = cost_collective(chip, topo, kind, gaxes, nbytes).time_s
                assert 0 < floor <= sim_t * (1 + 1e-12), (kind, gaxes, nbytes, floor, sim_t)
                checked += 1
    assert checked == 40


def test_compiled_traces_are_reused_across_axis_orders_and_equal_a_fresh_compile(tiny_model):
    # plan's placements and a sweep's hardware grid share one compile per worker process.
    from workloads import training

    model = load_model(tiny_model)
    cfg = TrainingConfig(seq_len=1024, batch_per_chip=2, remat=Remat.FULL)
    a = LogicalMesh(axes=(("fsdp", 2), ("tensor", 2)))
    b = LogicalMesh(axes=(("tensor", 2), ("fsdp", 2)))
    first = compile_training_step(model, a, 4, cfg)
    again = compile_training_step(model, b, 4, cfg)
    assert again.mesh == b and again.ops is first.ops  # reused, on the order asked for
    fresh = training.program_compiler(model, b, 4, cfg).build()
    assert fresh.ops == again.ops and fresh.meta == again.meta


def _four_layer_train(tmp_path, flags: list[str]) -> tuple[list[str], tuple]:
    """`train` argv of a 4-layer LLaMA-3-8B on a v5e 2x2 with `flags` (`--mesh` first), and
    that mesh as (axis, size) pairs."""
    model = tmp_path / "four.yaml"
    model.write_text("base: llama3-8b\nname: four\nnum_layers: 4\n", encoding="utf-8")
    argv = ["train", "--chip", "v5e", "--shape", "2x2", "--model", str(model), "--seq-len",
            "1024", "--batch-per-chip", "2", *flags]
    mesh = tuple((a, int(v)) for a, v in (x.split("=") for x in flags[1].split(",")))
    return argv, mesh


@pytest.mark.parametrize("flags", [
    ["--mesh", "pipeline=2,fsdp=2", "--microbatches", "4", "--pipeline-schedule", "gpipe"],
    ["--mesh", "fsdp=2,pipeline=2", "--microbatches", "2", "--pipeline-schedule", "1f1b"],
    # f32 weights gathered in bf16: each stage casts its shard once, before its first pass.
    ["--mesh", "pipeline=2,fsdp=2", "--microbatches", "2", "--param-dtype", "fp32",
     "--gather-dtype", "bf16"],
    ["--mesh", "pipeline=2,tensor=2", "--microbatches", "4", "--pipeline-schedule",
     "interleaved", "--virtual-stages", "2"],
    ["--mesh", "tensor=2,pipeline=2", "--microbatches", "4", "--no-overlap"],
    ["--mesh", "sequence=2,tensor=2", "--remat", "minimal", "--no-overlap"],
])
def test_lower_bound_never_exceeds_the_simulated_step(tmp_path, flags):
    argv, mesh = _four_layer_train(tmp_path, flags)
    bound = lower_bounds((_req(argv), [mesh]))["lower_bounds_s"][0]
    step = run_point(_req(argv))["result"]["step_time_s"]
    # Valid (never above the simulation) and not vacuous (the pipeline bound holds the bubble).
    assert 0.5 * step < bound <= step
    if "pipeline" in flags[1]:
        # The pass-level bound (chunk programs only) is a relaxation of the stage programs'
        # schedule: never above it, and on these steps within 0.1% of it.
        cheap = pipeline_bounds((_req(argv), [mesh, mesh[::-1]]))["lower_bounds_s"]
        full = lower_bounds((_req(argv), [mesh, mesh[::-1]]))["lower_bounds_s"]
        for c, f in zip(cheap, full, strict=True):
            assert 0.999 * f <= c <= f * (1 + 1e-12)


@pytest.mark.parametrize("flags", [
    ["--mesh", "sequence=2,tensor=2", "--remat", "minimal", "--no-overlap"],
    ["--mesh", "fsdp=2,tensor=2", "--microbatches", "2"],
    ["--mesh", "data=2,fsdp=2", "--remat", "none"],
])
def test_the_sharper_bound_lies_between_the_plain_bound_and_the_simulated_step(tmp_path, flags):
    """Collectives at their exact time alone on the pod: never above the simulation (the engine
    runs them at that time or slower), never below the closed-form bound; a threshold at or
    under it prunes the candidate without simulating it."""
    argv, mesh = _four_layer_train(tmp_path, flags)
    plain = lower_bounds((_req(argv), [mesh]))["lower_bounds_s"][0]
    o = refine_and_run((_req(argv), mesh, float("inf")))
    step = o["result"]["step_time_s"]
    assert o["result"] == run_point(_req(argv))["result"]
    assert plain <= o["lower_bound_s"] <= step
    assert refine_and_run((_req(argv), mesh, o["lower_bound_s"])) == {
        "pruned": True, "lower_bound_s": o["lower_bound_s"]}


def _hbm_trace(deltas: list[tuple[str, list[int], float]], overlap: bool = True):
    """A trace of compute (`c`) and collective (`g`) ops with dependencies and one memory event
    each (`saved_activations` for compute, `gathered_weights` for collectives), static 100."""
    from workloads.trace import Op, OpKind, Trace, Unit

    ops, events = [], []
    for i, (kind, deps, delta) in enumerate(deltas):
        if kind == "c":
            ops.append(Op(id=i, name=f"c{i}", kind=OpKind.COMPUTE, unit=Unit.MXU, flops=1e9,
                          deps=tuple(deps)))
            events.append([i, "saved_activations", delta])
        else:
            ops.append(Op(id=i, name=f"g{i}", kind=OpKind.COLLECTIVE, collective="all-gather",
                          mesh_axes=("fsdp",), bytes=1e6, deps=tuple(deps)))
            events.append([i, "gathered_weights", delta])
    return Trace(mesh=LogicalMesh(axes=(("fsdp", 4),)), ops=tuple(ops),
                 meta={"static_hbm_bytes": 100.0, "memory_events": events, "overlap": overlap})


def test_hbm_peak_bound_counts_earlier_core_ops_and_their_ancestors_only():
    from sim.studies.plan_bounds import hbm_peak_lower_bound

    # c0 +10; g1 +5 (needed by c3 only); c2 +1; c3 -5 (frees g1's weights); c4 +2.
    # In core order: after c0 110, after c2 111, after c3 (g1 and c3 in) 111, after c4 113.
    ops = [("c", [], 10.0), ("g", [], 5.0), ("c", [0], 1.0), ("c", [1, 2], -5.0),
           ("c", [3], 2.0)]
    assert hbm_peak_lower_bound(_hbm_trace(ops)) == 113.0
    # Without overlap the collective is on the core: after g1 115, after c2 116 (the peak).
    assert hbm_peak_lower_bound(_hbm_trace(ops, overlap=False)) == 116.0
    # An op off the core that frees memory might end before any other: it is counted freed
    # from the start (95), so after c0 105 and after c2 106, which every schedule reaches (g1
    # ending first is the lowest one: 95, 105, 106).
    freeing = [("c", [], 10.0), ("g", [], -5.0), ("c", [0], 1.0)]
    assert hbm_peak_lower_bound(_hbm_trace(freeing)) == 106.0


@pytest.mark.parametrize("flags", [
    ["--mesh", "fsdp=2,tensor=2", "--remat", "minimal"],
    # The gathered input table's gradient is held to the update (no free on a collective).
    ["--mesh", "fsdp=4", "--remat", "minimal", "--embed-lookup", "all-gather",
     "--mlp-act-dtype", "fp32"],
    ["--mesh", "tensor=4", "--remat", "none", "--microbatches", "4"],
    ["--mesh", "data=2,tensor=2", "--remat", "full", "--no-overlap"],
    ["--mesh", "fsdp=2,pipeline=2", "--remat", "full", "--microbatches", "2"],
    ["--mesh", "pipeline=2,tensor=2", "--remat", "minimal", "--microbatches", "8"],
    # v6e fuses the scores with the exponentials: the bound must compile as train does
    # (compiled as v5e's, this bound is 22.4 GB against a 17.3 GB peak).
    ["--mesh", "fsdp=4", "--remat", "minimal", "--microbatches", "4", "--attention", "dot",
     "--chip", "v6e"],
])
def test_hbm_peak_bound_never_exceeds_the_simulated_peak(tiny_model, flags):
    argv = ["train", "--chip", "v5e", "--shape", "2x2", "--model", tiny_model, "--seq-len",
            "8192", "--batch-per-chip", "4", *flags]
    mesh = tuple((a, int(v)) for a, v in (x.split("=") for x in flags[1].split(",")))
    b = lower_bounds((_req(argv), [mesh]))
    r = run_point(_req(argv))["result"]
    assert b["hbm_capacity_bytes"] == r["hbm_capacity_bytes"]
    # Valid, and not vacuous: within 15% of the simulated peak on these steps.
    assert 0.85 * r["hbm_peak_bytes"] < b["hbm_lower_bound_bytes"] \
        <= r["hbm_peak_bytes"] * (1 + 1e-12)


def test_candidates_refused_by_the_hbm_bound_are_out_of_memory_in_the_brute_force_plan(
        tiny_model):
    chip, topo = _pod()
    model = load_model(tiny_model)
    cfg = PlanConfig(seq_len=8192, global_batch=16, top=2, axes=("fsdp", "tensor", "pipeline"),
                     remat=("minimal",), microbatches=(1, 2, 4), placements=False)
    flags = ["--chip", "v5e", "--shape", "2x2"]
    fast = run_plan(_base(tiny_model, flags), model, topo, chip, cfg, workers=1, quiet=True)
    oracle = run_plan(_base(tiny_model, flags), model, topo, chip, cfg, workers=1, quiet=True,
                      prune_by_bound=False, refuse_by_hbm_bound=False,
                      stop_out_of_memory=False)
    assert oracle.counts["out_of_memory_by_hbm_bound"] == 0
    assert oracle.counts["out_of_memory_stopped_early"] == 0
    assert oracle.counts["simulated"] == oracle.counts["candidates"]
    refused = fast.counts["out_of_memory_by_hbm_bound"]
    assert 0 < refused < fast.counts["out_of_memory"] + 1
    key = ["mesh", "remat", "microbatches"]
    truth = oracle.table.set_index(key)["status"]
    for row in fast.table.to_dict("records"):
        if row["status"] == "does not fit":
            assert truth[tuple(row[k] for k in key)] == "does not fit"
    cols = ["mesh", "remat", "microbatches", "step_time_s", "hbm_peak_bytes"]
    assert fast.top(2)[cols].equals(oracle.top(2)[cols])


def test_a_simulation_seeded_with_the_sharper_bounds_costs_equals_a_cold_train(tmp_path,
                                                                             monkeypatch):
    # The worker that computes a sharper bound hands its collective costs to the worker that
    # simulates the candidate: the result must be the one `tpusim train` gives from scratch.
    from sim.engine import costs as engine
    from sim.studies.plan_jobs import sharper_bound, simulate

    argv, mesh = _four_layer_train(tmp_path, ["--mesh", "fsdp=2,tensor=2", "--remat", "full"])
    engine._COST_CACHE.clear()
    o = sharper_bound((_req(argv), mesh))
    assert o["lower_bound_s"] > 0 and o["costs"]
    assert all(k in engine._COST_CACHE for k in o["costs"])
    engine._COST_CACHE.clear()
    seeded = simulate((_req(argv), o["costs"], None))["result"]
    assert set(o["costs"]) <= set(engine._COST_CACHE)
    engine._COST_CACHE.clear()
    cold = run_point(_req(argv))["result"]
    assert seeded == cold
    assert o["lower_bound_s"] <= cold["step_time_s"]
    # Another worker's sharper bound of the same candidate, handed those costs, costs nothing
    # again and gives the same bound.
    engine._COST_CACHE.clear()
    monkeypatch.setattr(engine, "_cost_collective", lambda *a, **k: pytest.fail("recosted"))
    assert sharper_bound((_req(argv), mesh, o["costs"])) == o


def test_stage_programs_are_reused_across_axis_orders_and_equal_a_fresh_build(tiny_model):
    # A pipeline group's placements share one composition of the stage programs, each on the
    # mesh (axis order) it asks for.
    from sim.engine import pipeline

    model = load_model(tiny_model)
    cfg = TrainingConfig(seq_len=1024, batch_per_chip=2, remat=Remat.FULL, microbatches=4)
    a = LogicalMesh(axes=(("fsdp", 2), ("pipeline", 2), ("tensor", 2)))
    b = LogicalMesh(axes=(("pipeline", 2), ("tensor", 2), ("fsdp", 2)))
    first = pipeline.build_stage_programs(model, a, 8, cfg)
    again = pipeline.build_stage_programs(model, b, 8, cfg)
    assert all(x.ops is y.ops for x, y in zip(first.programs, again.programs, strict=True))
    assert {p.mesh for p in first.programs} == {a} and {p.mesh for p in again.programs} == {b}
    pipeline._STAGE_CACHE.clear()
    fresh = pipeline.build_stage_programs(model, b, 8, cfg)
    assert [p.ops for p in fresh.programs] == [p.ops for p in again.programs]
    assert [p.meta for p in fresh.programs] == [p.meta for p in again.programs]
    assert [p.mesh for p in fresh.programs] == [p.mesh for p in again.programs]
    assert (fresh.sends, fresh.recvs, fresh.passes, fresh.peak_inflight) == \
        (again.sends, again.recvs, again.passes, again.peak_inflight)


@pytest.mark.parametrize("flags", [
    ["--mesh", "fsdp=4", "--remat", "minimal", "--microbatches", "1"],
    ["--mesh", "fsdp=4", "--remat", "minimal", "--microbatches", "4"],
    ["--mesh", "fsdp=2,pipeline=2", "--remat", "full", "--microbatches", "2"],
    ["--mesh", "pipeline=2,tensor=2", "--remat", "full", "--microbatches", "8"],
])
def test_a_simulation_stopped_over_hbm_is_out_of_memory_and_one_that_fits_is_unchanged(
        tiny_model, flags):
    from sim.studies.plan_jobs import simulate

    argv = ["train", "--chip", "v5e", "--shape", "2x2", "--model", tiny_model, "--seq-len",
            "8192", "--batch-per-chip", "4", *flags]
    full = run_point(_req(argv))["result"]
    watched = simulate((_req(argv), {}, full["hbm_capacity_bytes"]))
    if full["fits_in_hbm"]:
        assert watched["result"] == full
    else:
        assert watched["out_of_memory"] is True
        assert full["hbm_capacity_bytes"] < watched["hbm_level_bytes"] <= full["hbm_peak_bytes"]
    # A capacity just under the peak always stops it, at the peak.
    low = simulate((_req(argv), {}, full["hbm_peak_bytes"] * (1 - 1e-6)))
    assert low["out_of_memory"] is True
    assert low["hbm_level_bytes"] == pytest.approx(full["hbm_peak_bytes"], rel=1e-9)


@pytest.mark.parametrize("flags", [
    ["--mesh", "pipeline=2,tensor=2", "--remat", "full", "--microbatches", "8"],
    ["--mesh", "fsdp=2,pipeline=2", "--remat", "minimal", "--microbatches", "4"],
])
def test_a_pipeline_over_hbm_within_its_prefix_gets_the_full_runs_verdict(
        tiny_model, flags, monkeypatch):
    # `simulate` first runs only the ops that can start before the prefix's horizon: its
    # verdict must be the full watched run's (same level), and without one it runs in full.
    from sim.engine.executors import stop_when_hbm_exceeds
    from sim.studies import plan_jobs

    argv = ["train", "--chip", "v5e", "--shape", "2x2", "--model", tiny_model, "--seq-len",
            "8192", "--batch-per-chip", "4", *flags]
    peak = run_point(_req(argv))["result"]["hbm_peak_bytes"]

    def full_watched(cap: float) -> dict:
        with stop_when_hbm_exceeds(cap) as watch:
            run_point(_req(argv))
        assert watch.exceeded
        return {"out_of_memory": True, "hbm_level_bytes": watch.level_bytes}

    for frac in (0.2, 0.5, 0.999):
        cap = frac * peak
        keep, horizon = plan_jobs.hbm_prefix(_req(argv), cap)
        # Closed under dependencies: an op in the prefix waits only for ops in it.
        chip, topo, model, mesh, tcfg = plan_jobs._bound_inputs(_req(argv))
        sp = plan_bounds.stage_programs(model, mesh, topo.num_chips, tcfg)
        for k, prog in enumerate(sp.programs):
            assert 0 < len(keep[k]) < len(prog.ops) or frac == 0.2
            assert all(d in keep[k] for i in keep[k] for d in prog.ops[i].deps)
        got = plan_jobs.simulate((_req(argv), {}, cap))
        assert got.pop("prefix") is True
        assert got == full_watched(cap)
        # The same instant too, not only the same level.
        with stop_when_hbm_exceeds(cap) as full:
            run_point(_req(argv))
        with stop_when_hbm_exceeds(cap, prefix=(keep, horizon)) as pre:
            with pytest.raises(TpusimError, match="out of memory"):
                plan_jobs._pipeline_run(_req(argv))
        assert pre.exceeded and not pre.prefix_ended
        assert (pre.time_s, pre.level_bytes) == (full.time_s, full.level_bytes) \
            and pre.time_s < horizon
    # A horizon before the step goes over decides nothing at first: the prefix grows
    # (PREFIX_HORIZON_GROWTH) until it decides, with the full run's verdict ...
    monkeypatch.setattr(plan_jobs, "PREFIX_HORIZON_FACTOR", 0.25)
    got = plan_jobs.simulate((_req(argv), {}, 0.999 * peak))
    assert got.pop("prefix") is True and got == full_watched(0.999 * peak)
    # ... and a prefix that would be the whole step is not run: the step runs in full.
    monkeypatch.setattr(plan_jobs, "PREFIX_HORIZON_GROWTH", 1e9)
    got = plan_jobs.simulate((_req(argv), {}, 0.999 * peak))
    assert "prefix" not in got and got == full_watched(0.999 * peak)
    # A step that fits is never stopped and gives `train`'s result.
    fits = plan_jobs.simulate((_req(argv), {}, 1.01 * peak))
    assert fits["result"] == run_point(_req(argv))["result"]


@pytest.mark.parametrize("flags", [
    ["--mesh", "fsdp=2,tensor=2", "--remat", "none"],
    ["--mesh", "tensor=2,data=2", "--remat", "none", "--microbatches", "2"],
])
def test_a_one_program_step_over_hbm_in_a_prefix_gets_the_full_runs_verdict(tiny_model, flags):
    # Without stages the step is one program: its prefix runs only the ops that can start
    # before the horizon, and grows until it decides. The oracle is the brute-force full run
    # (watched: its verdict and instant; unwatched: its peak bounds the level).
    from sim.engine.executors import stop_when_hbm_exceeds
    from sim.studies import plan_jobs

    argv = ["train", "--chip", "v5e", "--shape", "2x2", "--model", tiny_model, "--seq-len",
            "8192", "--batch-per-chip", "4", *flags]
    full_run = run_point(_req(argv))["result"]
    peak = full_run["hbm_peak_bytes"]
    prefixed = 0
    for frac in (0.5, 0.999):
        cap = frac * peak
        with stop_when_hbm_exceeds(cap) as full:
            run_point(_req(argv))
        assert full.exceeded and cap < full.level_bytes <= peak
        got = plan_jobs.simulate((_req(argv), {}, cap))
        first = plan_jobs.hbm_prefix(_req(argv), cap)
        if first is None:  # 2x the first crossing covers the whole step: no prefix
            assert got == {"out_of_memory": True, "hbm_level_bytes": full.level_bytes}
            continue
        prefixed += 1
        assert got == {"out_of_memory": True, "hbm_level_bytes": full.level_bytes,
                       "prefix": True}
        # The instant too, at the horizon that decides (the first, or a grown one).
        keep, horizon = first
        sched = plan_jobs.prefix_schedule(_req(argv), cap)
        while True:
            assert len(keep) == 1 and len(keep[0]) < len(sched.programs[0].ops)
            with stop_when_hbm_exceeds(cap, prefix=(keep, horizon)) as pre:
                run_point(_req(argv))
            if not pre.reached_horizon:
                break
            horizon *= plan_jobs.PREFIX_HORIZON_GROWTH
            keep = plan_jobs.prefix_ops(sched, horizon)[0]
        assert pre.exceeded and (pre.time_s, pre.level_bytes) == (full.time_s, full.level_bytes)
    assert prefixed
    # A step that fits is never stopped and gives `train`'s result.
    assert plan_jobs.simulate((_req(argv), {}, 1.01 * peak))["result"] == full_run


def test_a_prefix_run_has_the_full_runs_chip_classes_so_the_watch_applies_to_both_or_neither(
        tiny_model):
    # A prefix costs only the collectives that can start before its horizon; a slow link on
    # the data axis slows only the late data-parallel gradient all-reduces, splitting stage 0's
    # chips into two classes. The full run is then not watched (its classes are not one per
    # program) and reports its whole peak; its prefix once had the coarser classes of its own
    # collectives, was watched, and stopped at a lower level (14.2 GB against the 15.5 GB
    # peak). Its classes are now the full run's: no verdict, the step runs in full.
    from sim.engine.executors import stop_when_hbm_exceeds
    from sim.studies import plan_jobs

    argv = ["train", "--chip", "v5e", "--shape", "2x4", "--model", tiny_model, "--seq-len",
            "8192", "--batch-per-chip", "4", "--mesh", "pipeline=2,data=2,fsdp=2", "--axis-map",
            "pipeline=x,data=y:2,fsdp=y:2", "--remat", "full", "--microbatches", "8"]
    healthy = run_point(_req(argv))["result"]
    cap = 0.9 * healthy["hbm_peak_bytes"]
    # Slower links only delay ops: the healthy step's prefix is a valid prefix of both.
    keep, horizon = plan_jobs.hbm_prefix(_req(argv), cap)
    for link, classes in (("0,0:y+:0.5", 4), ("0,1:y+:0.5", 2)):  # data links; no group's
        slow = [*argv, "--slow-link", link]
        with stop_when_hbm_exceeds(cap) as full:
            out = run_point(_req(slow))
        with stop_when_hbm_exceeds(cap, prefix=(keep, horizon)) as pre:
            with pytest.raises(TpusimError):
                plan_jobs._pipeline_run(_req(slow))
        if classes > 2:
            assert out["result"]["num_chip_classes"] == classes and not full.exceeded
            assert out["result"]["hbm_peak_bytes"] == healthy["hbm_peak_bytes"] > cap
            assert pre.prefix_ended and not pre.exceeded
        else:  # a link no collective uses: one class per stage, both watched, one verdict
            assert full.exceeded and pre.exceeded and not pre.prefix_ended
            assert (pre.time_s, pre.level_bytes) == (full.time_s, full.level_bytes)


def test_explanation_says_a_tie_with_the_runner_up_is_a_tie():
    def row(mesh, placement, t):
        return {"mesh": mesh, "placement": placement, "remat": "full", "microbatches": 1,
                "step_time_s": t, "bound": "compute (MXU) 99%"}

    tie = explain([row("fsdp=64", "fsdp=x+y+z", 10.0), row("fsdp=64", "fsdp=z+y+x", 10.004)])
    assert tie.endswith("; as fast as the runner-up to within 0.05% (placement fsdp=z+y+x)")
    win = explain([row("fsdp=64", "fsdp=x+y+z", 10.0), row("fsdp=16,tensor=4", "t", 10.5)])
    assert win.endswith("; 5.0% faster than the runner-up (fsdp=16,tensor=4)")


def test_plan_in_a_directory_it_cannot_write_is_refused_before_the_search(monkeypatch, capsys):
    # access() says yes to root whatever the permission bits, and on /proc: plan run there
    # searched first and only then failed to make plan-out/ (hard10). Creating and removing a
    # probe file tells.
    from sim.cli import main
    from sim.studies import plan_search

    monkeypatch.setattr(plan_search, "run_plan", lambda *a, **k: pytest.fail("searched"))
    monkeypatch.chdir("/proc")
    rc = main(["plan", "--model", "llama3-8b", "--seq-len", "128", "--global-batch", "8",
               "--chip", "v5e", "--shape", "2x2", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert "output directory 'plan-out' cannot be created: '/proc' is not writable (" in err
    assert err.endswith("); give a path in a writable directory\n")


def test_plan_candidates_over_hbm_are_marked_and_never_ranked_or_on_the_frontier(
        tiny_model, tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from sim.studies.plots import plot_frontier

    chip, topo = _pod()
    model = load_model(tiny_model)
    cfg = PlanConfig(seq_len=2048, global_batch=32, top=2, axes=("fsdp", "tensor"),
                     remat=("full", "none"), microbatches=(1, 4), placements=False)
    res = run_plan(_base(tiny_model, ["--chip", "v5e", "--shape", "2x2"]), model, topo, chip,
                   cfg, workers=1, quiet=True, prune_by_bound=False, refuse_by_hbm_bound=False,
                   stop_out_of_memory=False)
    t = res.table
    assert set(t["status"]) <= {"ok", "does not fit", "error"}
    over = t["hbm_peak_bytes"] > res.hbm_capacity_bytes
    assert over.any() and (~over).any()
    assert list(t["fits_in_hbm"]) == list(~over)
    assert list(t["status"] == "does not fit") == list(over)
    assert t["rank"].notna().tolist() == list(~over)
    assert (res.top(10)["hbm_peak_bytes"] <= res.hbm_capacity_bytes).all()
    figs: list = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    plot_frontier(res, tmp_path / "f.png")
    ax = figs[0].axes[0]
    cap_gb = res.hbm_capacity_bytes / 1e9
    frontier = [line for line in ax.lines if line.get_linestyle() == "-"]
    assert frontier and all(x <= cap_gb for line in frontier for x in line.get_xdata())
    hollow = [c for c in ax.collections if c.get_label() == "does not fit in HBM"]
    assert len(hollow) == 1 and len(hollow[0].get_offsets()) == int(over.sum())


# -- slices searched: shapes and twisted wirings (issue 27) -------------------------------------
def test_slice_shapes_are_every_way_to_build_the_chip_count_from_cubes():
    from sim.studies.plan_space import slice_shapes

    # 256 v4 chips are 4 cubes: 1x1x4 or 1x2x2 of them.
    assert slice_shapes(get_chip("v4"), 256) == [(4, 4, 16), (4, 8, 8)]
    # 4096 chips, 64 cubes: a <= b <= c with abc = 64 (7 ways), each fitting the pod's 64.
    assert slice_shapes(get_chip("v4"), 4096) == [
        (4, 4, 256), (4, 8, 128), (4, 16, 64), (4, 32, 32), (8, 8, 64), (8, 16, 32),
        (16, 16, 16)]
    assert slice_shapes(get_chip("v4"), 32) == [(2, 4, 4)]  # below a cube: inside one
    assert slice_shapes(get_chip("v5e"), 64) == [(4, 16), (8, 8)]  # no switches: the box
    assert slice_shapes(get_chip("v4"), 96) == []


def _plan_json(capsys, *argv: str) -> dict:
    rc = main(["plan", *argv, "--json", "--out", "", "--workers", "1"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return json.loads(captured.out)


def test_plan_searches_the_twist_where_the_shape_can_twist_and_each_row_is_its_train_run(
        capsys, tmp_path):
    model = tmp_path / "one.yaml"
    model.write_text("base: llama3-8b\nname: one\nnum_layers: 1\n", encoding="utf-8")
    common = ["--chip", "v4", "--shape", "4x4x8", "--model", str(model), "--seq-len", "256",
              "--global-batch", "128", "--axes", "fsdp", "--remat", "full", "--microbatches",
              "1", "--top", "5"]
    s = _plan_json(capsys, *common)
    rows = {(r["shape"], r["twist"]): r for r in s["top"]}
    assert set(rows) == {("4x4x8", False), ("4x4x8", True)}
    assert s["searched"]["slices"] == 2 and s["pod"] == "4x4x8 plain and twisted v4"
    for (shape, twist), r in rows.items():
        rc = main(["train", "--chip", "v4", "--shape", shape, *(["--twist"] if twist else []),
                   "--model", str(model), "--seq-len", "256", "--batch-per-chip", "1",
                   "--mesh", r["mesh"], "--remat", "full", "--json", "--quiet"])
        out = capsys.readouterr().out
        assert rc == 0 and json.loads(out)["step_time_s"] == r["step_time_s"]
    # One wiring only: the pod as given, no slice columns.
    s = _plan_json(capsys, *common, "--wiring", "plain")
    assert "shape" not in s["top"][0] and "slices" not in s["searched"]
    s = _plan_json(capsys, *common, "--twist")
    assert "shape" not in s["top"][0] and s["pod"] == "4x4x8 twisted v4"


@pytest.mark.parametrize("argv, message", [
    (["--chip", "v4", "--shape", "4x4x8", "--shapes", "4x4x4"],
     "--shapes: 4x4x4 has 64 chips, not the pod's 128"),
    (["--chip", "v4", "--shape", "4x4x4", "--wiring", "twisted"], "cannot twist"),
    (["--chip", "v5e", "--shape", "2x2", "--twist"], "no optical circuit switches"),
    (["--chip", "v4", "--shape", "4x4x8", "--twist", "--wiring", "plain"], "drop one of them"),
    (["--chip", "v4", "--shape", "4x4x6", "--shapes", "all"],
     "builds no slice of 96 chips"),
    (["--chip", "v4", "--shape", "4x4x8", "--wiring", "sideways"], "--wiring"),
])
def test_plan_slice_search_bad_input_is_one_line(capsys, tiny_model, argv, message):
    rc = main(["plan", *argv, "--model", tiny_model, "--seq-len", "256", "--global-batch", "128",
               "--out", ""])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1


# -- the compute floor: a group's first bound without compiling its step ----------------------
_SMALL = ("name: small\nnum_layers: 8\nd_model: 512\nnum_heads: 8\nnum_kv_heads: 4\n"
          "head_dim: 64\nd_ff: 1536\nvocab_size: 8192\n")


@pytest.mark.parametrize("model_extra", [
    "mlp: swiglu\n",
    "mlp: gelu\ntied_embeddings: true\nparallel_block: true\n",
    "mlp: geglu\npost_norms: true\nqk_norm: true\n",
])
@pytest.mark.parametrize("flags", [
    ["--mesh", "fsdp=4", "--remat", "full", "--microbatches", "1"],
    ["--mesh", "fsdp=2,tensor=2", "--remat", "minimal", "--microbatches", "2"],
    ["--mesh", "tensor=2,sequence=2", "--remat", "none", "--microbatches", "1"],
    ["--mesh", "data=2,fsdp=2", "--remat", "offload", "--microbatches", "2",
     "--param-dtype", "fp32", "--gather-dtype", "bf16"],
    ["--mesh", "fsdp=4", "--remat", "full", "--microbatches", "2", "--optimizer", "sgd"],
    ["--mesh", "pipeline=2,fsdp=2", "--remat", "full", "--microbatches", "4"],
    ["--mesh", "fsdp=2,pipeline=2", "--remat", "minimal", "--microbatches", "2",
     "--pipeline-schedule", "gpipe"],
])
def test_compute_floor_is_the_compiled_steps_busiest_core(tmp_path, model_extra, flags):
    # Extrapolated from the same step with 2 and 3 layers per chunk, it equals the busiest
    # core's compute floor of the compiled step (every layer alike: exact up to the order of
    # the sums), so it never exceeds a simulated step, which runs those ops one at a time.
    from sim.studies.plan_bounds import (
        Floors,
        compute_floor,
        core_floor_s,
        floor_applies,
        stage_programs,
    )
    from sim.studies.plan_jobs import _bound_inputs
    from workloads.training import compile_training_step

    path = tmp_path / "small.yaml"
    path.write_text(_SMALL + model_extra, encoding="utf-8")
    req = _req(["train", "--chip", "v5e", "--shape", "2x2", "--model", str(path), "--seq-len",
                "1024", "--batch-per-chip", "2", *flags])
    chip, topo, model, mesh, tcfg = _bound_inputs(req)
    assert floor_applies(model, dict(mesh.axes))
    floor = compute_floor(model, mesh, 4, tcfg, chip, topo)
    floors = Floors(chip, topo, {})
    if mesh.size("pipeline") > 1:
        compiled = max(core_floor_s(p, floors)
                       for p in stage_programs(model, mesh, 4, tcfg).programs)
    else:
        compiled = core_floor_s(compile_training_step(model, mesh, 4, tcfg), floors)
    assert floor == pytest.approx(compiled, rel=1e-9)
    assert 0 < floor <= run_point(req)["result"]["step_time_s"] * (1 + 1e-9)


def test_the_compute_floor_applies_only_where_every_layer_is_alike(tmp_path):
    from sim.studies.plan_bounds import floor_applies

    dense = load_model("llama3-8b")
    assert floor_applies(dense, {"fsdp": 4}) and floor_applies(dense, {"pipeline": 4})
    assert not floor_applies(load_model("mixtral-8x7b"), {"fsdp": 4})  # experts
    assert not floor_applies(load_model("gemma3-12b"), {"fsdp": 4})  # local/global layers
    four = tmp_path / "four.yaml"
    four.write_text("base: llama3-8b\nname: four\nnum_layers: 4\n", encoding="utf-8")
    assert floor_applies(load_model(str(four)), {"fsdp": 4})
    assert not floor_applies(load_model(str(four)), {"pipeline": 2})  # 2 layers a chunk


def test_groups_ruled_out_by_their_floor_leave_the_top_k_of_the_brute_force_plan(tmp_path):
    # An 8-layer model: every group gets its compute floor first, and only those whose floor
    # could still enter the top K are bounded in full; the top K equals simulating everything.
    path = tmp_path / "small.yaml"
    path.write_text(_SMALL + "mlp: swiglu\n", encoding="utf-8")
    chip, topo = _pod()
    model = load_model(str(path))
    cfg = PlanConfig(seq_len=1024, global_batch=8, top=3, axes=("fsdp", "tensor", "pipeline"),
                     remat=("full", "minimal"), microbatches=(1, 2), placements=False,
                     max_pipeline=2)
    flags = ["--chip", "v5e", "--shape", "2x2"]
    fast = run_plan(_base(str(path), flags), model, topo, chip, cfg, workers=1, quiet=True)
    oracle = run_plan(_base(str(path), flags), model, topo, chip, cfg, workers=1, quiet=True,
                      prune_by_bound=False, refuse_by_hbm_bound=False,
                      stop_out_of_memory=False)
    assert fast.counts["bounded_by_compute_floor"] == fast.counts["bounded"]
    assert fast.counts["bounded_in_full"] < fast.counts["bounded"]
    assert fast.counts["compute_floor_violated"] == 0 and fast.counts["bound_violated"] == 0
    assert oracle.counts["bounded_by_compute_floor"] == 0
    cols = ["mesh", "remat", "microbatches", "step_time_s", "hbm_peak_bytes"]
    assert fast.top(3)[cols].equals(oracle.top(3)[cols])
    # Every candidate's recorded bound is below its brute-force step.
    truth = oracle.table.set_index(["mesh", "remat", "microbatches"])["step_time_s"]
    for row in fast.table.to_dict("records"):
        t = truth[(row["mesh"], row["remat"], row["microbatches"])]
        assert not row["lower_bound_s"] > t * (1 + 1e-9)


def test_plan_on_a_dask_cluster_ships_requests_and_gets_the_same_ranking(tiny_model):
    # The candidates travel to the Dask worker as typed requests (Dask pickles every task's
    # arguments, even for a worker in this process) and their bounds and simulations come
    # back as plain objects that pickle too (as from a worker elsewhere); the ranking equals
    # the one computed without Dask.
    distributed = pytest.importorskip("distributed")
    from sim.runs.requests import TrainRequest
    from sim.studies.plan_search import plan

    space = dict(model=tiny_model, chip="v5e", shape="2x2", seq_len=1024, global_batch=8,
                 top=2, axes=("fsdp", "tensor"), remat=("full", "none"), microbatches=(1,),
                 quiet=True)
    local = plan(workers=1, **space)

    class Recording:  # a client that records what it ships and what comes back
        def __init__(self, client):
            self.client, self.shipped, self.futures = client, [], []

        def submit(self, fn, arg, **kw):
            self.shipped.append((fn.__name__, arg))
            self.futures.append(self.client.submit(fn, arg, **kw))
            return self.futures[-1]

    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                                  dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client:
        rec = Recording(client)
        on_dask = plan(workers=2, dask=rec, **space)
        back = [f.result() for f in rec.futures]
    assert on_dask.table.equals(local.table) and on_dask.counts == local.counts
    kinds = {name for name, _arg in rec.shipped}
    assert "simulate" in kinds and kinds <= {"lower_bounds", "floor_bounds", "pipeline_bounds",
                                             "sharper_bound", "simulate"}
    assert all(isinstance(arg[0], TrainRequest) for _name, arg in rec.shipped)
    assert all(isinstance(o, dict) for o in back)
    simulated = [o for (name, _a), o in zip(rec.shipped, back, strict=True) if name == "simulate"]
    assert simulated and all(isinstance(o["result"]["step_time_s"], float) for o in simulated)
    for o in back:
        again = pickle.loads(pickle.dumps(o))
        assert sorted(again) == sorted(o)
        if "result" in o:
            assert json.dumps(again["result"]) == json.dumps(o["result"])


def test_the_cost_frontier_holds_the_candidates_nothing_beats_on_time_and_cost(
        tiny_model, tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from sim.studies.plots import cost_time_frontier, plot_cost_frontier

    chip, topo = _pod()
    model = load_model(tiny_model)
    cfg = PlanConfig(seq_len=1024, global_batch=16, top=2, axes=("fsdp", "tensor"),
                     remat=("full", "none"), microbatches=(1, 2), placements=False,
                     objective="cost")
    res = run_plan(_base(tiny_model, ["--chip", "v5e", "--shape", "2x2"]), model, topo, chip,
                   cfg, workers=1, quiet=True)
    ok = res.table[res.table["status"] == "ok"]
    pts = list(zip(ok["step_time_s"], ok["cost_per_million_tokens_usd"], strict=True))
    assert len(pts) >= 3
    # Brute force: a point is on the frontier when no other is at least as fast and as cheap
    # and better on one.
    brute = sorted(p for p in pts if not any(q[0] <= p[0] and q[1] <= p[1] and q != p
                                             for q in pts))
    assert sorted(cost_time_frontier(pts)) == brute
    figs: list = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    assert plot_cost_frontier(res, tmp_path / "c.png").stat().st_size > 0
    ax = figs[0].axes[0]
    line = next(ln for ln in ax.lines if ln.get_linestyle() == "-")
    assert list(zip(line.get_xdata(), line.get_ydata(), strict=True)) == sorted(brute)
    star = next(c for c in ax.collections if c.get_label().startswith("best by cost"))
    best = res.top(1).iloc[0]
    assert tuple(star.get_offsets()[0]) == pytest.approx(
        (best["step_time_s"], best["cost_per_million_tokens_usd"]))
