"""Pipeline schedules simulated stage by stage (sim/pipeline.py): GPipe, 1F1B and interleaved
1F1B against the textbook bubble, the in-flight memory rule, sends over ICI and DCN, errors."""

from __future__ import annotations

import pytest

from sim.cli import main
from sim.hardware import get_chip
from sim.pipeline import check_schedule, simulate_pipeline, stage_order
from tests.conftest import make_topology
from topologies.errors import TpusimError
from topologies.mesh import parse_mesh
from workloads.models import model_from_dict
from workloads.training import TrainingConfig, compile_pipeline_chunk

# Tiny vocabulary: the embedding and the loss add little to the first and last stage.
PP = {"name": "pp", "num_layers": 8, "d_model": 1024, "num_heads": 8, "num_kv_heads": 8,
      "head_dim": 128, "d_ff": 4096, "mlp": "swiglu", "vocab_size": 256}
P = 4


def _fast_links():
    # Communication made negligible (1000x the ICI bandwidth, ~no hop latency): what is left of
    # the bubble is the schedule's.
    v5e = get_chip("v5e")
    return v5e.with_overrides(ici_link_bytes_per_s=v5e.ici_link_bytes_per_s * 1000,
                              ici_hop_latency_s=1e-12)


def _pipe(schedule: str, m: int, v: int = 1, chip=None, mesh: str = "pipeline=4",
          shape: str = "4x1", slices: int = 1, dcn: str | None = None):
    chip = chip or _fast_links()
    topo = make_topology(chip, shape, slices=slices)
    cfg = TrainingConfig(seq_len=512, batch_per_chip=m, microbatches=m,
                         pipeline_schedule=schedule, virtual_stages=v)
    return simulate_pipeline(model_from_dict(PP), parse_mesh(mesh, dcn), chip, topo, cfg)


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
    assert "needs a pipeline axis" in capsys.readouterr().err
    assert main(base + ["--mesh", "pipeline=4", "--microbatches", "4", "--pipeline-schedule",
                        "interleaved", "--virtual-stages", "3"]) == 2
    assert "not divisible by pipeline x virtual stages = 4 x 3" in capsys.readouterr().err
    assert main(base + ["--mesh", "pipeline=4", "--microbatches", "4", "--virtual-stages",
                        "2"]) == 2
    assert "needs --pipeline-schedule interleaved" in capsys.readouterr().err
