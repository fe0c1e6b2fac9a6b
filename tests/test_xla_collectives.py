"""Collectives as XLA emits them (docs/model.md "Collectives as XLA emits them"), each rule on a
small closed-form case."""

from __future__ import annotations

import pytest

from topologies.mesh import parse_mesh
from workloads.models import model_from_dict
from workloads.training import Remat, TrainingConfig, compile_training_step

SMALL = {"name": "small", "num_layers": 2, "d_model": 512, "num_heads": 4, "num_kv_heads": 2,
         "head_dim": 128, "d_ff": 1024, "vocab_size": 1024, "mlp": "swiglu"}
SEQ = 256


def _trace(mesh: str, chips: int, **cfg):
    model = model_from_dict(SMALL)
    return compile_training_step(model, parse_mesh(mesh), chips,
                                 TrainingConfig(seq_len=SEQ, batch_per_chip=1,
                                                remat=Remat.FULL, **cfg))


def _ops(trace, name):
    return [o for o in trace.ops if o.name == name]


@pytest.mark.parametrize(("tp_activations", "fwd", "kind", "bwd"), [
    ("replicated", "tp_embed_allreduce", "all-reduce", None),
    ("sharded", "tp_embed_reducescatter", "reduce-scatter", "tp_embed_grad_allgather"),
])
def test_the_embedding_lookup_sums_its_vocabulary_shards_over_tensor(tp_activations, fwd, kind,
                                                                     bwd):
    # 8 chips, fsdp=2 x tensor=4: 8 sequences, 4 per fsdp shard, n = 4 x 256 tokens per chip's
    # tensor group; each vocabulary shard's partial lookup is [n, d_model] bf16.
    trace = _trace("fsdp=2,tensor=4", 8, tp_activations=tp_activations)
    n = 4 * SEQ
    (red,) = _ops(trace, fwd)
    assert red.collective == kind and red.mesh_axes == ("tensor",)
    assert red.bytes == n * 512 * 2
    lookup = _ops(trace, "embed_lookup")[0]
    assert lookup.id in red.deps
    first = min(o.id for o in trace.ops if o.layer == 0)
    assert red.id < first
    if bwd is None:
        assert not [o for o in trace.ops if "embed_grad_allgather" in o.name]
    else:
        (g,) = _ops(trace, bwd)
        assert g.collective == "all-gather" and g.bytes == n * 512 * 2
        assert g.id in _ops(trace, "embed_grad")[0].deps


def test_no_tensor_axis_means_no_embedding_reduction():
    trace = _trace("fsdp=8", 8)
    assert not [o for o in trace.ops if o.name.startswith("tp_embed")]
