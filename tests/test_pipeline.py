"""Pipeline schedules on the per-chip engine (sim/engine/pipeline.py): GPipe, 1F1B and interleaved
1F1B against the textbook bubble and the stage-level simulation, the in-flight memory rule, sends
over ICI and DCN, slow chips, links and brute force, errors."""

from __future__ import annotations

import numpy as np
import pytest

from sim.chips import get_chip
from sim.cli import main
from sim.engine.perchip import PerChipConfig
from sim.engine.pipeline import (
    check_schedule,
    simulate_pipeline_chips,
    stage_of_chips,
    stage_order,
)
from tests.conftest import make_topology
from tests.pipeline_reference import simulate_pipeline
from topologies.errors import TpusimError
from topologies.mesh import parse_mesh
from workloads.training import TrainingConfig, compile_pipeline_chunk, parse_remat
from workloads.zoo import model_from_dict

# Tiny vocabulary: the embedding and the loss add little to the first and last stage.
PP = {"name": "pp", "num_layers": 8, "d_model": 1024, "num_heads": 8, "num_kv_heads": 8,
      "head_dim": 128, "d_ff": 4096, "mlp": "swiglu", "vocab_size": 256}
P = 4
SMALL = {**PP, "num_layers": 4, "d_model": 512, "num_heads": 4, "num_kv_heads": 4,
         "d_ff": 1024}  # for the many-chip runs


def _fast_links():
    # Communication made negligible (1000x the ICI bandwidth, ~no hop latency): what is left of
    # the bubble is the schedule's.
    v5e = get_chip("v5e")
    return v5e.with_overrides(ici_link_bytes_per_s=v5e.ici_link_bytes_per_s * 1000,
                              ici_hop_latency_s=1e-12)


def _args(schedule, m, v, chip, mesh, shape, slices, dcn, remat="full", model=PP):
    chip = chip or _fast_links()
    topo = make_topology(chip, shape, slices=slices)
    cfg = TrainingConfig(seq_len=512, batch_per_chip=m, microbatches=m,
                         pipeline_schedule=schedule, virtual_stages=v, remat=parse_remat(remat))
    return model_from_dict(model), parse_mesh(mesh, dcn), chip, topo, cfg


def _run(schedule: str, m: int, v: int = 1, chip=None, mesh: str = "pipeline=4",
         shape: str = "4x1", slices: int = 1, dcn: str | None = None, base=None, remat="full",
         model=PP):
    """(StepResult, PipelineResult) of the schedule on the per-chip engine."""
    return simulate_pipeline_chips(*_args(schedule, m, v, chip, mesh, shape, slices, dcn, remat,
                                          model), base=base)


def _pipe(*a, **kw):
    return _run(*a, **kw)[1]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("m", [4, 8])
def test_bubble_is_the_textbook_fraction_when_communication_is_negligible(schedule, m):
    r = _pipe(schedule, m)
    assert r.send_s < 1e-6
    assert r.bubble_fraction == pytest.approx((P - 1) / (m + P - 1), abs=0.015)


def test_interleaving_divides_the_bubble_by_about_the_virtual_stages():
    m = 8
    plain = _pipe("1f1b", m)
    inter = _pipe("interleaved", m, v=2)
    assert inter.bubble_fraction == pytest.approx((P - 1) / (2 * m + P - 1), abs=0.015)
    # The idle time itself: (p - 1) passes of a whole stage vs of a half-stage chunk.
    assert plain.bubble_s / inter.bubble_s == pytest.approx(2, rel=0.1)
    assert inter.step_time_s < plain.step_time_s


def test_1f1b_holds_at_most_p_microbatches_and_gpipe_holds_all():
    m = 8
    one = _pipe("1f1b", m)
    gp = _pipe("gpipe", m)
    assert one.peak_inflight == [P - s for s in range(P)]
    assert gp.peak_inflight == [m] * P
    # The engine's HBM events (not the count above): without remat a stage keeps exactly one
    # chunk's activations per microbatch in flight, so its most saved activations at once are
    # P - s microbatches' worth under 1F1B and all m under GPipe.
    args = _args("1f1b", m, 1, None, "pipeline=4", "4x1", 1, None, remat="none", model=SMALL)
    per_mb = compile_pipeline_chunk(args[0], args[1], 4, args[4], first=False,
                                    last=False).meta.activation_bytes_estimate
    one_n = _pipe("1f1b", m, remat="none", model=SMALL).stage_saved_activations_peak_bytes
    gp_n = _pipe("gpipe", m, remat="none", model=SMALL).stage_saved_activations_peak_bytes
    assert one_n == pytest.approx([(P - s) * per_mb for s in range(P)], rel=1e-9)
    assert gp_n == pytest.approx([m * per_mb] * P, rel=1e-9)
    # Memory follows: stage 0 keeps 4 microbatches' activations under 1F1B, 8 under GPipe.
    assert all(a < b for a, b in zip(one.stage_hbm_peak_bytes, gp.stage_hbm_peak_bytes,
                                     strict=True))
    # Same work, same bubble: the two schedules take the same time.
    assert one.step_time_s == pytest.approx(gp.step_time_s, rel=0.02)


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_every_stage_runs_each_pass_once_forward_before_backward(schedule, v):
    m = 8
    for s in range(P):
        order = stage_order(schedule, P, s, m, v)
        keys = [(x.kind, x.chunk, x.microbatch) for x in order]
        assert len(keys) == len(set(keys)) == 2 * m * v
        assert {x.chunk % P for x in order} == {s}
        for x in order:
            if x.kind == "B":
                assert keys.index(("F", x.chunk, x.microbatch)) < keys.index(
                    ("B", x.chunk, x.microbatch))


def test_first_stage_holds_the_embedding_and_the_last_the_loss():
    chip = get_chip("v5e")
    mesh = parse_mesh("pipeline=4")
    cfg = TrainingConfig(seq_len=512, batch_per_chip=4, microbatches=4)
    first = compile_pipeline_chunk(model_from_dict(PP), mesh, 4, cfg, first=True, last=False)
    last = compile_pipeline_chunk(model_from_dict(PP), mesh, 4, cfg, first=False, last=True)
    names = lambda t: {o.name for o in t.ops}  # noqa: E731
    assert "embed_lookup" in names(first) and "softmax_xent" not in names(first)
    assert "softmax_xent" in names(last) and "embed_lookup" not in names(last)
    assert not any(o.collective == "collective-permute" for o in first.ops + last.ops)
    del chip


def test_stage_to_stage_sends_cross_dcn_when_the_pipeline_axis_spans_slices():
    chip = get_chip("v5e")
    ici = _pipe("1f1b", 4, chip=chip, mesh="pipeline=2,fsdp=2", shape="2x2")
    dcn = _pipe("1f1b", 4, chip=chip, mesh="fsdp=2", shape="2x1", slices=2, dcn="pipeline=2")
    assert dcn.send_s > ici.send_s > 0


@pytest.mark.parametrize("args,needle", [
    (("1f1b", 1, 4, 1), "needs a pipeline axis"),
    (("1f1b", 4, 2, 1), "needs at least as many microbatches as stages"),
    (("interleaved", 4, 6, 2), "not a multiple"),
])
def test_schedules_the_mesh_cannot_run_are_one_line_errors(args, needle):
    with pytest.raises(TpusimError, match=needle):
        check_schedule(*args)


def test_cli_pipeline_errors_and_json(capsys):
    base = ["train", "--chip", "v5e", "--shape", "4x1", "--model", "llama3-8b", "--seq-len",
            "256", "--batch-per-chip", "4"]
    assert main(base + ["--mesh", "fsdp=4", "--pipeline-schedule", "gpipe"]) == 2
    # The library's error names the Python arguments; the CLI spells them as flags.
    assert ("--pipeline-schedule gpipe needs a pipeline axis of 2 or more stages, but the mesh "
            "has none; add pipeline=P to --mesh (or --dcn) or drop --pipeline-schedule"
            in capsys.readouterr().err)
    with pytest.raises(TpusimError, match="^pipeline_schedule gpipe needs a pipeline axis"):
        check_schedule("gpipe", 1, 4, 1)
    assert main(base + ["--mesh", "pipeline=4", "--microbatches", "4", "--pipeline-schedule",
                        "interleaved", "--virtual-stages", "3"]) == 2
    assert "not divisible by pipeline x virtual stages = 4 x 3" in capsys.readouterr().err
    assert main(base + ["--mesh", "pipeline=4", "--microbatches", "4", "--virtual-stages",
                        "2"]) == 2
    assert "needs --pipeline-schedule interleaved" in capsys.readouterr().err


@pytest.mark.parametrize("schedule,m,v", [("gpipe", 4, 1), ("1f1b", 8, 1), ("interleaved", 4, 2)])
def test_per_chip_engine_equals_the_stage_level_simulation_on_a_healthy_pipeline(schedule, m, v):
    # Same passes, same sends (one hop each way; on a ring, so that the interleaved send from
    # the last stage back to stage 0 is one hop too): the engine's schedule is the stage-level
    # one.
    args = list(_args(schedule, m, v, get_chip("v5e"), "pipeline=4", "4x1", 1, None))
    args[3] = make_topology(args[2], "4x1", wrap="x")
    old = simulate_pipeline(*args)
    res, new = simulate_pipeline_chips(*args)
    assert res.num_chip_classes == P
    assert new.step_time_s == pytest.approx(old.step_time_s, rel=1e-9)
    assert new.bubble_s == pytest.approx(old.bubble_s, rel=1e-9)
    assert new.send_s == pytest.approx(old.send_s, rel=1e-9)
    assert res.step_time_s == new.step_time_s


def test_a_slow_stage_stretches_gpipe_by_the_bottleneck_closed_form():
    # GPipe with stage k running f times slower and no communication: the flow shop's span is
    # (P - 1 + m f)(t_F + t_B) (every other stage waits on the bottleneck), against
    # (P - 1 + m)(t_F + t_B) healthy. The first and last stages differ by the embedding and the
    # loss (a tiny vocabulary keeps that under 2%).
    m, f = 4, 2.0
    _res, healthy = _run("gpipe", m)
    chip_of_stage = {int(s): c for c, s in enumerate(stage_of_chips(
        parse_mesh("pipeline=4"), make_topology(_fast_links(), "4x1"))[0])}
    speed = np.ones(4)
    speed[chip_of_stage[1]] = 1 / f
    res, slow = _run("gpipe", m, base=PerChipConfig(speed=speed))
    t = healthy.forward_s[1][0] + healthy.backward_s[1][0]
    assert healthy.span_s == pytest.approx((P - 1 + m) * t, rel=0.02)
    assert slow.span_s == pytest.approx((P - 1 + m * f) * t, rel=0.02)
    assert slow.stage_busy_s[1] == pytest.approx(f * healthy.stage_busy_s[1], rel=1e-3)
    assert slow.stage_busy_s[2] == pytest.approx(healthy.stage_busy_s[2], rel=1e-9)
    assert res.num_chip_classes == P


@pytest.mark.parametrize("shape,mesh,slices,dcn,schedule,v", [
    ("4x2", "pipeline=2,fsdp=4", 1, None, "1f1b", 1),
    ("2x2", "fsdp=4", 2, "pipeline=2", "interleaved", 2),
])
def test_brute_force_agrees_with_classes_on_a_pipeline_with_a_slow_chip(shape, mesh, slices, dcn,
                                                                       schedule, v):
    chip = get_chip("v5e")
    topo = make_topology(chip, shape, slices=slices)
    speed = np.ones(topo.num_chips)
    speed[3] = 0.7
    runs = [_run(schedule, 4, v, chip, mesh, shape, slices, dcn, model=SMALL,
                 base=PerChipConfig(speed=speed, mode=mode)) for mode in ("auto", "per-chip")]
    (ra, pa), (rb, pb) = runs
    assert ra.num_chip_classes < rb.num_chip_classes == topo.num_chips
    assert ra.step_time_s == pytest.approx(rb.step_time_s, rel=1e-9)
    assert ra.chips.finish_s.to_numpy() == pytest.approx(rb.chips.finish_s.to_numpy(), rel=1e-9)
    assert pa.stage_finish_s == pytest.approx(pb.stage_finish_s, rel=1e-9)
    healthy = _run(schedule, 4, v, chip, mesh, shape, slices, dcn, model=SMALL)[0]
    assert ra.step_time_s > healthy.step_time_s


def test_slow_and_dead_links_between_stages_delay_the_sends():
    chip = get_chip("v5e")
    topo = make_topology(chip, "4x2")
    mesh = "pipeline=4,fsdp=2"
    stage, nxt, _prv = stage_of_chips(parse_mesh(mesh), topo)
    healthy_res, healthy = _run("1f1b", 4, 1, chip, mesh, "4x2", model=SMALL)
    # Slow both directions of every link between neighbouring stages by 100x.
    links = {}
    for c in range(topo.num_chips):
        if stage[c] == 3:
            continue
        a = int(np.flatnonzero(np.asarray(topo.coords(c)) != np.asarray(topo.coords(nxt[c])))[0])
        links[topo.ici_link_id(c, a, +1)] = 0.01
        links[topo.ici_link_id(int(nxt[c]), a, -1)] = 0.01
    slow_res, slow = _run("1f1b", 4, 1, chip, mesh, "4x2", model=SMALL,
                          base=PerChipConfig(link_factors=links))
    assert slow.send_s > 50 * healthy.send_s
    assert slow_res.step_time_s > healthy_res.step_time_s + 2 * (P - 1) * 50 * healthy.send_s
    # A dead link between stage 0 and 1 of one pipeline: that pipeline's sends detour.
    c0 = int(np.flatnonzero(stage == 0)[0])
    a = int(np.flatnonzero(np.asarray(topo.coords(c0)) != np.asarray(topo.coords(nxt[c0])))[0])
    dead_res, _dead = _run("1f1b", 4, 1, chip, mesh, "4x2", model=SMALL,
                           base=PerChipConfig(dead_links=(topo.ici_link_id(c0, a, +1),)))
    assert dead_res.step_time_s > healthy_res.step_time_s
    assert dead_res.num_chip_classes > healthy_res.num_chip_classes


def test_replay_of_a_compiled_pipeline_trace_runs_the_schedule(tmp_path, capsys):
    import json

    import yaml

    model = tmp_path / "pp.yaml"
    model.write_text(yaml.safe_dump(SMALL))
    pod = ["--chip", "v5e", "--shape", "4x1"]
    flags = ["--model", str(model), "--seq-len", "512", "--batch-per-chip", "4", "--mesh",
             "pipeline=4", "--microbatches", "4", "--pipeline-schedule", "gpipe"]
    slow = ["--slow-chip", "2,0:0.5"]

    def run(argv):
        assert main(argv) == 0
        out = json.loads(capsys.readouterr().out)
        return out.get("summary", out)

    trace = tmp_path / "pp.trace"
    assert main(["compile", *pod, *flags, "-o", str(trace)]) == 0
    capsys.readouterr()
    steps = []
    for extra in ([], slow):
        trained = run(["train", *pod, *flags, *extra, "--json"])
        replayed = run(["replay", str(trace), *pod, *extra, "--json"])
        assert replayed["step_time_s"] == trained["step_time_s"]
        assert replayed["pipeline"] == trained["pipeline"]
        steps.append(trained["step_time_s"])
    varied = run(["train", *pod, *flags, "--chip-variation", "0.05", "--seed", "1", "--json"])
    # Perturbations apply to pipeline runs (never silently ignored).
    assert steps[1] > steps[0] != varied["step_time_s"]
    # A trace that does not record its model and settings cannot be composed into stages.
    doc = json.loads(trace.read_text())
    del doc["meta"]["pipeline_compile"]
    trace.write_text(json.dumps(doc))
    assert main(["replay", str(trace), *pod]) == 2
    assert "recompile it with tpusim compile" in capsys.readouterr().err


def test_perfetto_shows_one_process_per_stage_class_named_with_its_stage_and_chips(tmp_path):
    import json

    from sim.export.perfetto import export_step

    res, _pipe_ = _run("1f1b", 4, model=SMALL, chip=get_chip("v5e"))
    path = export_step(res, tmp_path / "pp.json")
    events = json.loads(path.read_text())["traceEvents"]
    names = sorted(e["args"]["name"] for e in events
                   if e.get("ph") == "M" and e.get("name") == "process_name")
    stage = stage_of_chips(parse_mesh("pipeline=4"), make_topology(get_chip("v5e"), "4x1"))[0]
    assert len(names) == P
    for s in range(P):
        (name,) = [n for n in names if n.startswith(f"pipeline stage {s}/{P}")]
        chip = int(np.flatnonzero(stage == s)[0])
        assert f"1 chip(s) ({chip}, 0)" in name
    assert "(embedding)" in names[0] and "(loss)" in names[-1]
    assert set(res.memory.chip) == set(range(P))  # every stage's HBM timeline in the table
    # Each process shows its own stage's program: stage 0 sends activations, the last stage
    # only receives them.
    by_pid = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M"
              and e.get("name") == "process_name"}
    ops = {}
    for e in events:
        if e.get("ph") == "X":
            ops.setdefault(by_pid[e["pid"]].split(",")[0], set()).add(e["name"])
    assert "pipeline_send_fwd" in ops[f"pipeline stage 0/{P} (embedding)"]
    # ... on the link its route leaves by (the class's own collectives' links, not the slowest
    # stage's labels for the same op id).
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    lanes = {threads[(e["pid"], e["tid"])].rsplit(" ", 1)[0] for e in events
             if e.get("ph") == "X" and e["name"] == "pipeline_send_fwd"}
    assert "ICI x+ link" in lanes
    assert "pipeline_send_fwd" not in ops[f"pipeline stage {P - 1}/{P} (loss)"]
    assert "softmax_xent" in ops[f"pipeline stage {P - 1}/{P} (loss)"]


def test_pftrace_joins_each_send_to_the_receive_it_completes(tmp_path):
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace, TrackEvent

    from sim.export.perfetto import export_step

    m = 4
    res, _pipe_ = _run("gpipe", m, model=SMALL, chip=get_chip("v5e"))
    pf = Trace()
    pf.ParseFromString(export_step(res, tmp_path / "pp.pftrace", chips=[0, 1, 2, 3])
                       .read_bytes())
    begins = [p.track_event for p in pf.packet if p.HasField("track_event")
              and p.track_event.type == TrackEvent.TYPE_SLICE_BEGIN]
    starts = {f: ev.name for ev in begins for f in ev.flow_ids}
    ends = {f: ev.name for ev in begins for f in ev.terminating_flow_ids}
    sends = {f for f, n in starts.items() if n.startswith("pipeline_send")}
    # GPipe over 4 stages: m forward sends on each of 3 links, m backward sends back.
    assert len(sends) == 2 * (P - 1) * m
    assert {ends[f] for f in sends if starts[f] == "pipeline_send_fwd"} == {"pipeline_recv_fwd"}
    assert {ends[f] for f in sends if starts[f] == "pipeline_send_bwd"} == {"pipeline_recv_bwd"}


def test_an_uneven_moe_router_loads_each_stages_hot_expert_chips():
    from workloads.moe import MoeConfig

    moe = {**SMALL, "name": "moe-pp", "num_layers": 2, "num_experts": 8, "experts_per_token": 2}
    chip = get_chip("v5e")
    topo = make_topology(chip, "2x2")
    mesh = parse_mesh("pipeline=2,expert=2")

    def run(skew, mode="auto"):
        cfg = TrainingConfig(seq_len=512, batch_per_chip=2, microbatches=2,
                             moe=MoeConfig(expert_skew=skew, seed=1))
        return simulate_pipeline_chips(model_from_dict(moe), mesh, chip, topo, cfg,
                                       base=PerChipConfig(mode=mode))[0]

    uniform, skewed, brute = run(0.0), run(2.0), run(2.0, "per-chip")
    assert uniform.num_chip_classes == 2 < skewed.num_chip_classes
    # Within each stage the chip holding the hot experts computes more than its partner.
    stage = stage_of_chips(mesh, topo)[0]
    busy = skewed.chips.mxu_busy_s.to_numpy()
    for s in range(2):
        a, b = busy[stage == s]
        assert max(a, b) > 1.05 * min(a, b)
    assert skewed.step_time_s > uniform.step_time_s
    assert brute.step_time_s == pytest.approx(skewed.step_time_s, rel=1e-9)
    assert brute.chips.finish_s.to_numpy() == pytest.approx(skewed.chips.finish_s.to_numpy(),
                                                            rel=1e-9)


def test_a_slow_link_splits_only_the_chips_whose_sends_or_groups_cross_it():
    chip = get_chip("v5e")
    topo = make_topology(chip, "4x4")
    mesh = "pipeline=4,fsdp=4"
    stage, nxt, _prv = stage_of_chips(parse_mesh(mesh), topo)
    c = int(np.flatnonzero(stage == 1)[0])
    a = int(np.flatnonzero(np.asarray(topo.coords(c)) != np.asarray(topo.coords(nxt[c])))[0])
    res = _run("1f1b", 4, 1, chip, mesh, "4x4", model=SMALL,
               base=PerChipConfig(link_factors={topo.ici_link_id(c, a, +1): 0.5}))[0]
    # The sender, its receiver and their FSDP groups split off; the other 3 pipelines stay
    # one class per stage.
    assert P < res.num_chip_classes < topo.num_chips


def _reference_stage_programs(model, mesh, num_chips, config):
    """`build_stage_programs` written the plain way (every op copied with
    `dataclasses.replace`, every dependency mapped one by one, each program validated by
    `Trace`): the oracle of the template-based composition."""
    import dataclasses

    from sim.engine.pipeline import BWD_CHANNEL, FWD_CHANNEL, _tag
    from workloads.trace import Op, OpKind, Trace

    p, v, m = mesh.size("pipeline"), config.virtual_stages, config.microbatches
    chunks = p * v
    cache = {}

    def chunk_trace(c):
        key = (c == 0, c == chunks - 1)
        if key not in cache:
            cache[key] = compile_pipeline_chunk(model, mesh, num_chips, config, first=key[0],
                                                last=key[1])
        return cache[key]

    send_bytes = float(chunk_trace(0).meta.pipeline_send_bytes)
    out = []
    for s in range(p):
        ops, events, stage_passes, sends, recvs, fmap, grad_colls = [], [], [], {}, {}, {}, []
        gate = None

        def add(op, deps, _ops=ops):
            _ops.append(dataclasses.replace(op, id=len(_ops), deps=tuple(sorted(set(deps)))))
            return len(_ops) - 1

        def p2p(name, phase, deps=(), _add=add):
            return _add(Op(id=0, name=name, kind=OpKind.COLLECTIVE, collective="send",
                           mesh_axes=("pipeline",), bytes=send_bytes, phase=phase), deps)

        for ps in stage_order(config.pipeline_schedule, p, s, m, v):
            c, i, fwd = ps.chunk, ps.microbatch, ps.kind == "F"
            tr = chunk_trace(c)
            ids = [o.id for o in tr.ops if o.phase in (("fwd", "loss") if fwd else ("bwd",))
                   and not (not fwd and i < m - 1 and o.name.startswith("dp_grad_allreduce"))]
            recv = -1
            if (fwd and c > 0) or (not fwd and c < chunks - 1):
                recv = p2p("pipeline_recv_" + ("fwd" if fwd else "bwd"), "fwd" if fwd else "bwd")
                recvs[_tag(ps.kind, c, i, chunks, m)] = recv
            mapping, outer = {}, ({} if fwd else fmap.pop((c, i)))
            for old in ids:
                op = tr.ops[old]
                deps = [mapping.get(d, outer.get(d)) for d in op.deps
                        if d in mapping or d in outer]
                if not any(d in mapping for d in op.deps) and gate is not None:
                    deps.append(gate)
                if recv >= 0 and op.name in ("stage_input", "stage_grad_input"):
                    deps.append(recv)
                mapping[old] = add(op, deps)
                if not fwd and op.kind == OpKind.COLLECTIVE and "grad" in op.name:
                    grad_colls.append(mapping[old])
            for op_id, cat, delta in tr.meta.memory_events or ():
                if op_id in mapping and not (cat == "gradients" and i > 0):
                    events.append([mapping[op_id], cat, delta / v if cat == "gradients"
                                   else delta])
            core = [mapping[o] for o in ids if tr.ops[o].kind == OpKind.COMPUTE]
            stage_passes.append((ps, recv, min(core), max(core)))
            gate = max(core)
            if fwd:
                fmap[(c, i)] = mapping
            if fwd and c < chunks - 1:
                sends[p2p("pipeline_send_fwd", "fwd", [gate])] = (
                    FWD_CHANNEL, _tag("F", c + 1, i, chunks, m))
            elif not fwd and c > 0:
                sends[p2p("pipeline_send_bwd", "bwd", [gate])] = (
                    BWD_CHANNEL, _tag("B", c - 1, i, chunks, m))
        first = chunk_trace(s)
        for op in first.ops:
            if op.phase == "optimizer":
                upd = add(op, [gate] + grad_colls)
                events += [[upd, cat, d] for op_id, cat, d in first.meta.memory_events
                           if op_id == op.id]
        out.append((Trace(mesh=first.mesh, ops=tuple(ops), meta={}), events,
                    tuple(stage_passes), sends, recvs))
    return out


@pytest.mark.parametrize("schedule, m, v, mesh", [
    ("gpipe", 3, 1, "pipeline=2,fsdp=2"),
    ("1f1b", 4, 1, "pipeline=4"),
    ("interleaved", 4, 2, "pipeline=2,tensor=2"),
])
def test_stage_programs_equal_the_plain_composition_and_pass_validation(schedule, m, v, mesh):
    from sim.engine.pipeline import build_stage_programs
    from workloads.trace import Trace

    model, lmesh, _chip, topo, cfg = _args(schedule, m, v, None, mesh, "4x1", 1, None,
                                           model=SMALL)
    sp = build_stage_programs(model, lmesh, topo.num_chips, cfg)
    ref = _reference_stage_programs(model, lmesh, topo.num_chips, cfg)
    for prog, passes, snd, rcv, (rtrace, revents, rpasses, rsends, rrecvs) in zip(
            sp.programs, sp.passes, sp.sends, sp.recvs, ref, strict=True):
        assert prog.ops == rtrace.ops and prog.meta.memory_events == revents
        assert (passes, snd, rcv) == (rpasses, rsends, rrecvs)
        # The composed program is one the validating constructor accepts as it is.
        assert Trace(mesh=prog.mesh, ops=prog.ops, meta=prog.meta).ops == prog.ops


@pytest.mark.parametrize("schedule, m, v", [("gpipe", 3, 1), ("interleaved", 4, 2)])
def test_a_stage_casts_its_weights_once_per_step_whatever_its_passes(schedule, m, v):
    # --param-dtype fp32 --gather-dtype bf16: a whole step casts the local shard once (one
    # weight_cast op of p flops, 6 bytes per parameter) before its first forward; a pipeline
    # stage's program, made of m x v copies of its chunks' passes, still casts once (it was
    # once per pass), first, and the pass-level schedule starts each stage after its cast.
    import dataclasses

    from sim.engine.pipeline import build_stage_programs
    from workloads.trace import OpKind

    model, lmesh, _chip, topo, cfg = _args(schedule, m, v, None, "pipeline=2,fsdp=2", "4x1", 1,
                                           None, model=SMALL)
    cfg = dataclasses.replace(cfg, param_dtype="fp32", gather_dtype="bf16")
    sp = build_stage_programs(model, lmesh, topo.num_chips, cfg)
    for prog in sp.programs:
        (upd,) = [o for o in prog.ops if o.name == "adam_update"]
        (cast,) = [o for o in prog.ops if o.name == "weight_cast"]
        p = upd.flops / 12  # Adam's 12 VPU ops per parameter of the stage's shard
        assert (cast.flops, cast.hbm_bytes) == (pytest.approx(p), pytest.approx(6 * p))
        assert (cast.id, cast.deps, cast.phase) == (0, (), "fwd")
        assert all(o.deps for o in prog.ops[1:] if o.kind == OpKind.COMPUTE)
    first = {}
    for c in (cfg, dataclasses.replace(cfg, param_dtype="bf16", gather_dtype=None)):
        pipe = simulate_pipeline(model, lmesh, _chip, topo, c)
        first[c.param_dtype] = min(t[4] for t in pipe.timeline if t[0] == 0)
    assert first["bf16"] == 0.0 < first["fp32"]
    # Each chunk's forward pass holds no cast (it is copied per microbatch).
    for c in range(2 * v):
        chunk = compile_pipeline_chunk(model, lmesh, topo.num_chips, cfg, first=c == 0,
                                       last=c == 2 * v - 1)
        assert [o.phase for o in chunk.ops if o.name == "weight_cast"] == ["optimizer"]
