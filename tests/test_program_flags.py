"""Two program choices as flags with XLA's defaults: the dtype of the MLP's activation
intermediates (`mlp_act_dtype`, MaxText's `activations_in_float32`) and the embedding lookup's
collective (`embed_lookup`). Closed forms on a tiny model: each value's bytes, collectives and
saved tensors, the defaults unchanged, bad values as one-line errors."""

from __future__ import annotations

import json

import pytest

from sim.cli import main
from topologies.errors import TpusimError
from topologies.mesh import parse_mesh
from validation import xla_compile
from validation import xla_progflags as xp
from workloads.memory import LayerShapeSpec, saved_tensors
from workloads.training import TrainingConfig, compile_training_step, xla_rules
from workloads.training.config import training_config_to_dict
from workloads.zoo import model_from_dict

# d_model 256, 8 heads of 32 (4 KV heads), d_ff 1024, 2 layers, vocab 512, untied.
MODEL = {"name": "flags-tiny", "num_layers": 2, "d_model": 256, "num_heads": 8,
         "num_kv_heads": 4, "head_dim": 32, "d_ff": 1024, "mlp": "swiglu", "vocab_size": 512,
         "tied_embeddings": False}
D, F, V, L = 256, 1024, 512, 2
SEQ, BATCH = 512, 2
N = SEQ * BATCH  # tokens per chip


def _trace(mesh="fsdp=2", chips=2, model=MODEL, **kw):
    cfg = TrainingConfig(seq_len=SEQ, batch_per_chip=BATCH, **kw)
    return compile_training_step(model_from_dict(model), parse_mesh(mesh), chips, cfg)


def _op(trace, name):
    (op,) = [o for o in trace.ops if o.name == name]
    return op


def _names(trace):
    return {o.name for o in trace.ops}


def _same_ops(a, b):
    assert [o.name for o in a.ops] == [o.name for o in b.ops]
    for x, y in zip(a.ops, b.ops, strict=True):
        assert (x.flops, x.hbm_bytes, x.bytes) == (y.flops, y.hbm_bytes, y.bytes), x.name



# -- the MLP activation's dtype -----------------------------------------------------------------

def test_fp32_activations_cost_a_recomputed_layer_nothing():
    # The casts fuse into the activation's fusions, which read and write bf16 either way.
    for remat in ("full", "minimal"):
        bf, f = _trace(remat=remat), _trace(remat=remat, mlp_act_dtype="fp32")
        _same_ops(bf, f)
        assert bf.meta.memory_events == f.meta.memory_events


def test_without_remat_the_stack_keeps_the_activation_terms_in_f32():
    bf, f = _trace(remat="none"), _trace(remat="none", mlp_act_dtype="fp32")
    _same_ops(bf, f)
    saved = [[d for i, cat, d in t.meta.memory_events if cat == "saved_activations" and d > 0]
             for t in (bf, f)]
    # The scanned stack is allocated whole before the first layer: the gate and up outputs,
    # the activation's output and its two derivative terms ([tokens, d_ff] each) take 2 more
    # bytes an element (5 f32 buffers where bf16 keeps 5 bf16 ones; the gated product stays
    # bf16).
    assert max(saved[1]) - max(saved[0]) == L * 5 * N * F * 2


def test_the_saved_set_in_closed_form():
    shape = LayerShapeSpec(rows=10, residual_rows=10, context=10, d_model=4, q_width=4,
                           kv_width=2, local_heads=2, ff_width=8, mlp_matrices=3,
                           parallel_block=False, mlp_act_bytes=4.0)
    got = {t.name: t.dtype_bytes for t in saved_tensors(shape, remat="none", attention="dot")}
    assert (got["mlp_hidden"], got["mlp_act_out"], got["mlp_act_terms"]) == (4.0, 4.0, 4.0)
    assert got["mlp_gated_product"] == 2.0
    fused = {t.name: t.dtype_bytes for t in saved_tensors(shape, remat="none", attention="dot",
                                                           stacked=False)}
    assert fused["mlp_act_out"] == 2.0  # a fused backward recomputes it in its fusion


def test_mlp_act_dtype_default_and_errors():
    cfg = TrainingConfig(seq_len=SEQ, batch_per_chip=BATCH)
    assert cfg.mlp_act_dtype == "bf16" and "mlp_act_dtype" not in training_config_to_dict(cfg)
    f = TrainingConfig(seq_len=SEQ, batch_per_chip=BATCH, mlp_act_dtype="F32")
    assert f.mlp_act_dtype == "fp32" and training_config_to_dict(f)["mlp_act_dtype"] == "fp32"
    with pytest.raises(TpusimError, match=r"^mlp_act_dtype 'int8' must be bf16 .* or fp32"
                       ) as e:
        TrainingConfig(seq_len=SEQ, batch_per_chip=BATCH, mlp_act_dtype="int8")
    assert "\n" not in str(e.value)


# -- the embedding lookup's collective ----------------------------------------------------------

def test_auto_keeps_the_rules_and_all_to_all_is_their_form_on_fsdp():
    auto, a2a = _trace(), _trace(embed_lookup="all-to-all")
    _same_ops(auto, a2a)
    # fsdp=2, untied: the lookup and the gradient rows go by all-to-all ([tokens, d_model]
    # from each of the 2 chips).
    assert _op(auto, "embed_lookup_alltoall").bytes == 2 * N * D * 2
    assert _op(auto, "embed_grad_alltoall").bytes == 2 * N * D * 2
    assert "fsdp_allgather_embed_lookup" not in _names(auto)


def test_all_gather_gathers_the_table_and_reduce_scatters_its_gradient():
    auto, ag = _trace(), _trace(embed_lookup="all-gather")
    names = _names(ag)
    assert not {"embed_lookup_alltoall", "embed_grad_alltoall"} & names
    assert not any(n.startswith("embed_tokens_allgather") for n in names)
    # The whole [vocab, d_model] bf16 input table gathered (fsdp=2), as the projection is.
    assert _op(ag, "fsdp_allgather_embed_lookup").bytes == V * D * 2
    assert _op(ag, "fsdp_allgather_embed").bytes == _op(auto, "fsdp_allgather_embed").bytes
    # Its gradient: the rows scatter-added into a zero table of the whole width (read and
    # written), then all-reduced whole over fsdp by a collective of its own (each chip keeps
    # its shard); the projection's reduce-scatter is as before.
    assert _op(ag, "embed_grad_scatter_add").hbm_bytes == 3 * N * D * 2 + 2 * V * D * 2
    rs = "embed_grad_table_allreduce"
    assert _op(ag, rs).bytes == V * D * 2 and _op(ag, rs).collective == "all-reduce"
    head = "fsdp_grad_reducescatter_embed"
    assert _op(ag, head).bytes == _op(auto, head).bytes == V * D * 2
    # The gathered table is held from its gather to the lookup, the whole gradient from the
    # scatter-add to the update.
    ev = [(ag.ops[i].name, cat, d) for i, cat, d in ag.meta.memory_events
          if abs(d) == V * D * 2 and ag.ops[i].name in (
              "fsdp_allgather_embed_lookup", "embed_lookup", "embed_grad_scatter_add")]
    assert len(ev) == 3
    upd = {ag.ops[i].name: d for i, cat, d in ag.meta.memory_events if cat == "gradients"
           and ag.ops[i].name == "adam_update"}
    base = {auto.ops[i].name: d for i, cat, d in auto.meta.memory_events
            if cat == "gradients" and auto.ops[i].name == "adam_update"}
    assert upd["adam_update"] - base["adam_update"] == -V * D * 2
    assert ("fsdp_allgather_embed_lookup", "gathered_weights", V * D * 2) in ev
    assert ("embed_lookup", "gathered_weights", -V * D * 2) in ev
    assert ("embed_grad_scatter_add", "gradients", V * D * 2) in ev


@pytest.mark.parametrize("form", ["auto", "all-to-all"])
def test_under_tensor_the_rows_go_into_a_whole_vocabulary_table_reduced_over_tensor(form):
    t = _trace(mesh="fsdp=2,tensor=2", chips=4, tp_activations="replicated",
               embed_lookup=form)
    whole = V * D / 2 * 2  # [vocab, d_model / fsdp] bf16 on every tensor shard
    n = N * 2  # tokens per chip: the activations are replicated over tensor
    assert _op(t, "embed_grad_scatter_add").hbm_bytes == 3 * n * D * 2 + 2 * whole
    assert _op(t, "tp_embed_grad_reducescatter").bytes == whole
    # No memory event on the collective (the planner's HBM bound needs none that frees).
    assert not [e for e in t.meta.memory_events
                if t.ops[e[0]].name == "tp_embed_grad_reducescatter"]
    # Without tensor the rows are scattered into the chip's own shard.
    assert "tp_embed_grad_reducescatter" not in _names(_trace(embed_lookup=form))


MIB = 2**20


@pytest.mark.parametrize("vocab, d_model, fsdp, tokens, table_mib, rows_mib, whole", [
    # v5e fsdp=4 x tensor=4 (validation/xla_progflags.py, SMALL widths): 32 sequences of 2048
    # over fsdp=4; XLA's all-reduce-scatter of the table.
    (32768, 2048, 4, 8 * 2048, 32, 64, True),
    # The committed HLO fixture train_fsdp_tp_v5p64 (TINY widths, fsdp=16 x tensor=4): 64
    # sequences of 1024 over fsdp=16; its all-reduce-scatter of a bf16[8192, 64] table.
    (8192, 1024, 16, 4 * 1024, 1, 8, True),
    # validation/xla_crosscheck.py's fsdp_tp_v5p64 (LLaMA-3-8B widths, fsdp=16 x tensor=4):
    # 16 sequences of 2048 over fsdp=16; the rows all-to-all'd back over fsdp, no table.
    (128256, 4096, 16, 2048, 128256 * 4096 / 16 * 2 / MIB, 16, False),
])
def test_the_whole_vocabulary_table_is_the_smaller_of_table_and_rows(
        vocab, d_model, fsdp, tokens, table_mib, rows_mib, whole):
    table, rows = vocab * d_model / fsdp * 2, tokens * d_model * 2
    assert (table / MIB, rows / MIB) == (table_mib, rows_mib)
    assert xla_rules.embedding_grad_whole_vocab(tensor=4, rows_bytes=rows,
                                                table_bytes=table) is whole
    # Without a tensor axis the rows go into the chip's own shard either way.
    assert not xla_rules.embedding_grad_whole_vocab(tensor=1, rows_bytes=rows,
                                                    table_bytes=table)


@pytest.mark.parametrize("seq, whole", [(64, False), (128, True)])
def test_under_tensor_rows_smaller_than_the_table_are_scattered_where_they_live(seq, whole):
    # fsdp=2 x tensor=2, one sequence a chip: n = 2 x seq tokens a tensor group. The table
    # [512, 256 / 2] bf16 is 128 KiB; the rows [n, 256] bf16 are 64 KiB at seq 64 (rows),
    # 128 KiB at seq 128 (a tie: the table, as XLA replicates the rows only when smaller).
    cfg = TrainingConfig(seq_len=seq, batch_per_chip=1, tp_activations="replicated")
    t = compile_training_step(model_from_dict(MODEL), parse_mesh("fsdp=2,tensor=2"), 4, cfg)
    table, n = V * D / 2 * 2, 2 * seq
    assert (n * D * 2 < table) is not whole
    assert ("tp_embed_grad_reducescatter" in _names(t)) is whole
    # The rows' all-to-all either way; the scatter-add reads and writes the table only with it.
    assert _op(t, "embed_grad_alltoall").bytes == 2 * n * D * 2
    assert _op(t, "embed_grad_scatter_add").hbm_bytes == \
        3 * n * D * 2 + (2 * table if whole else 0)


def test_at_llama3_8b_widths_over_fsdp16_tensor4_the_rows_go_back_by_all_to_all():
    # validation/xla_crosscheck.py's fsdp_tp_v5p64 program: no reduce-scatter over tensor.
    model = {**MODEL, **xla_compile.LLAMA3_8B, "name": "8b-wide"}
    cfg = TrainingConfig(seq_len=2048, batch_per_chip=0.25, tp_activations="replicated")
    t = compile_training_step(model_from_dict(model), parse_mesh("fsdp=16,tensor=4"), 64, cfg)
    assert "tp_embed_grad_reducescatter" not in _names(t)
    assert not [o for o in t.ops if o.collective == "reduce-scatter"
                and o.mesh_axes == ("tensor",)]
    assert _op(t, "embed_grad_alltoall").bytes == 16 * 2048 * 4096 * 2


def test_all_gather_under_tensor_reduce_scatters_the_table_gradient():
    kw = dict(mesh="fsdp=2,tensor=2", chips=4, tp_activations="replicated")
    ag = _trace(embed_lookup="all-gather", **kw)
    assert "embed_grad_table_allreduce" not in _names(ag)
    # The [vocab / tensor, d_model] table gathered and its gradient reduce-scattered over fsdp.
    assert _op(ag, "fsdp_allgather_embed_lookup").bytes == V / 2 * D * 2
    rs = _op(ag, "fsdp_grad_reducescatter_embed_lookup")
    assert (rs.collective, rs.bytes) == ("reduce-scatter", V / 2 * D * 2)
    assert "tp_embed_grad_reducescatter" not in _names(ag)


def test_all_to_all_with_a_data_axis_sends_the_rows_back_by_all_to_all():
    kw = dict(mesh="data=2,fsdp=2", chips=4)
    auto, a2a = _trace(**kw), _trace(embed_lookup="all-to-all", **kw)
    # With data the rule replicates the rows or the table (here the table: 256 KiB against
    # 1 MiB of rows); forced, the rows go back within each fsdp group ...
    assert "embed_grad_table_allreduce" in _names(auto)
    assert not {"embed_grad_table_allreduce", "embed_grad_allgather"} & _names(a2a)
    assert _op(a2a, "embed_grad_alltoall").bytes == 2 * N * D * 2
    # ... and the table's shard is summed over data with the projection's shard.
    assert _op(a2a, "dp_grad_allreduce_embed").bytes == \
        _op(auto, "dp_grad_allreduce_embed").bytes + V * D * 2 / 2


def test_a_tied_table_is_gathered_under_auto_and_all_gather_alike():
    tied = {**MODEL, "tied_embeddings": True}
    _same_ops(_trace(model=tied), _trace(model=tied, embed_lookup="all-gather"))
    assert "embed_lookup_alltoall" in _names(_trace(model=tied, embed_lookup="all-to-all"))


def test_embed_lookup_default_and_errors():
    cfg = TrainingConfig(seq_len=SEQ, batch_per_chip=BATCH)
    assert cfg.embed_lookup == "auto" and "embed_lookup" not in training_config_to_dict(cfg)
    with pytest.raises(TpusimError, match=r"^embed_lookup 'all-reduce' must be auto .*"
                       r"all-to-all .* all-gather") as e:
        TrainingConfig(seq_len=SEQ, batch_per_chip=BATCH, embed_lookup="all-reduce")
    assert "\n" not in str(e.value)


def test_train_takes_both_flags_and_records_them_only_when_set(tmp_path, capsys):
    model = tmp_path / "m.json"
    model.write_text(json.dumps(MODEL))
    base = ["train", "--chip", "v5e", "--shape", "2x1", "--mesh", "fsdp=2", "--model",
            str(model), "--seq-len", str(SEQ), "--batch-per-chip", str(BATCH), "--json"]
    assert main(base) == 0
    default = json.loads(capsys.readouterr().out)["inputs"]["flags"]
    assert not {"mlp-act-dtype", "embed-lookup"} & set(default)
    assert main(base + ["--mlp-act-dtype", "fp32", "--embed-lookup", "all-gather"]) == 0
    flags = json.loads(capsys.readouterr().out)["inputs"]["flags"]
    assert (flags["mlp-act-dtype"], flags["embed-lookup"]) == ("fp32", "all-gather")
    assert main(base + ["--embed-lookup", "gather"]) == 2
    assert "embed-lookup" in capsys.readouterr().err


# -- against the saved XLA compiles --------------------------------------------------------------

def _tpusim_counts(name, form):
    cfg = xp.CONFIGS[name]
    mesh = ",".join(f"{k}={v}" for k, v in xp.MESHES[cfg["mesh"]].items())
    choice = {"mlp_act_dtype" if cfg["flag"] == "mlp" else "embed_lookup": form}
    t = compile_training_step(
        model_from_dict(xla_compile.tpusim_model_dict(xla_compile.SMALL, xp.LAYERS,
                                                      "xla-progflags")),
        parse_mesh(mesh), 16,
        TrainingConfig(seq_len=xp.SEQ, batch_per_chip=xp.BATCH_PER_CHIP, remat=cfg["remat"],
                       attention="dot", tp_activations="replicated",
                       fsdp_gather="mixed-async" if cfg["chip"] == "v5e" else "mixed-blocking",
                       **choice))
    return xla_compile.trace_counts(t.ops), t


def test_the_flags_against_the_saved_xla_compiles(tmp_path, capsys):
    """validation/results/xla_progflags.json (no jax needed): dot FLOPs by type exact on every
    program; the embedding forms' all-to-all and all-reduce bytes exact and their other
    changes (the table's gather) within 2%; the f32 stack's extra bytes without remat within
    1% of XLA's on both meshes (v5e read off, v5p held out)."""
    cache = xla_compile.load_cache(xp.CACHE)
    for key, x in cache.items():
        t, _ = _tpusim_counts(*key.split("/"))
        assert t["dot_flops"] == pytest.approx(x["dot_flops"], rel=1e-9), key
    for name in ("embed_v5e_fsdp_tp_full", "embed_v5e_fsdp_full"):
        for form in ("auto", "all-gather"):
            t, _ = _tpusim_counts(name, form)
            xk, tk = cache[f"{name}/{form}"]["collective_bytes_by_kind"], \
                t["collective_bytes_by_kind"]
            for kind in ("all-to-all", "all-reduce"):
                assert tk.get(kind, 0.0) == pytest.approx(xk.get(kind, 0.0), rel=1e-3,
                                                          abs=1e6), (name, form, kind)
        xg = [cache[f"{name}/{f}"]["collective_bytes_by_kind"]["all-gather"]
              for f in ("auto", "all-gather")]
        tg = [_tpusim_counts(name, f)[0]["collective_bytes_by_kind"]["all-gather"]
              for f in ("auto", "all-gather")]
        assert tg[1] - tg[0] == pytest.approx(xg[1] - xg[0], rel=0.02), name
    model = tmp_path / "model.yaml"
    model.write_text(xla_compile.tpusim_model_yaml(
        xla_compile.tpusim_model_dict(xla_compile.SMALL, xp.LAYERS, "xla-progflags")))
    for name in ("mlp_v5e_fsdp_none", "mlp_v5p_fsdp_tp_none"):
        xd = cache[f"{name}/fp32"]["hbm_peak_bytes"] - cache[f"{name}/bf16"]["hbm_peak_bytes"]
        peaks = []
        for form in ("bf16", "fp32"):
            assert main(["train", "--model", str(model), "--json",
                         *xp.tpusim_flags(name, form)]) == 0
            peaks.append(json.loads(capsys.readouterr().out)["hbm_peak_bytes"])
        assert peaks[1] - peaks[0] == pytest.approx(xd, rel=0.01), name
