"""The cross-check's sections of docs/validation.md: collective bytes and counts by kind and
logical axis against XLA's compiled programs (like for like), and XLA's per-op cost estimates
against tpusim's costed ops, per op class, rendered from the cached results
(`validation/results/xla_collectives.json`).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import re
import statistics

from sim.chips import get_chip
from sim.engine.costs import compute_op_times
from sim.engine.executors import Executor, simulate_step
from topologies.mesh import parse_mesh
from validation import xla_compile
from validation.xla_crosscheck_programs import CONFIGS, XLA_CLOCK_HZ
from validation.xla_crosscheck_sides import dims_override, pod
from workloads.hlo.parser import (
    replica_groups,
)
from workloads.inference import DecodeConfig, compile_decode_step
from workloads.moe import MoeConfig
from workloads.trace import OpKind
from workloads.training import Remat, TrainingConfig, compile_training_step
from workloads.zoo import load_model, model_from_dict

# --------------------------------------------------------------------------------------------
# Bytes by logical kind and mesh axis (docs/validation.md; runs under the project python)
# --------------------------------------------------------------------------------------------

# Cached XLA results (`--json` output of the XLA side), so the doc regenerates without jax.
RESULTS_FILE = xla_compile.RESULTS / "xla_collectives.json"
# The tpusim flags that mirror each XLA program like-for-like: the program keeps the residual
# stream replicated over `tensor` (Megatron style), which is `--tp-activations replicated`.
LIKE_FOR_LIKE = {
    "fsdp_v5e16": {"fsdp_gather": "mixed-async"},
    "fsdp_v5e16_small": {"fsdp_gather": "mixed-async"},
    "fsdp_v6e16": {"fsdp_gather": "mixed-blocking"},
    "fsdp_v5e16_f32": {"fsdp_gather": "mixed-async", "param_dtype": "fp32",
                       "gather_dtype": "bf16"},
    "fsdp_v6e16_f32": {"fsdp_gather": "mixed-blocking", "param_dtype": "fp32",
                       "gather_dtype": "bf16"},
    "data_fsdp_v6e16": {"fsdp_gather": "mixed-blocking"},
    "fsdp_v5p16": {"fsdp_gather": "mixed-blocking"},
    "fsdp_tp_v5p64": {"tp_activations": "replicated", "fsdp_gather": "mixed-blocking"},
    "fsdp_tp_v5e16_8b": {"tp_activations": "replicated", "fsdp_gather": "mixed-async"},
    "moe_fsdp_ep_v6e16": {"fsdp_gather": "mixed-blocking"},
}


def _device_coords(xr: dict) -> dict[int, tuple[int, ...]]:
    """Device id -> its coordinates on the program's mesh (row-major over the mesh shape)."""
    shape = xr["mesh_shape"]
    coords = itertools.product(*(range(n) for n in shape))
    return {int(d): c for d, c in zip(xr["mesh_device_ids"], coords, strict=True)}


def parse_replica_groups(text: str, num_devices: int) -> list[list[int]]:
    """HLO `replica_groups=` as device-id lists (`tpusim import-hlo`'s reader: explicit
    `{{0,1},{2,3}}`, iota `[G,S]<=[d0,d1]T(1,0)`, mesh `mesh['axis_0'=16,'axis_1'=4]
    {'axis_0'}` with or without `device_ids=(...)`, or empty / `{}`: one group of every
    device)."""
    return replica_groups(text.strip() or "{}", num_devices)


def _axes_spanned(xr: dict, sets: list[list[int]]) -> str:
    """The mesh axes along which the members of each set differ (union over the sets)."""
    coords = _device_coords(xr)
    names = xr["mesh_axes"]
    spanned = set()
    for members in sets:
        cs = [coords[d] for d in members if d in coords]
        for k, name in enumerate(names):
            if len({c[k] for c in cs}) > 1:
                spanned.add(name)
    return ",".join(a for a in names if a in spanned) or "-"


def _xla_logical_ops(xr: dict):
    """(logical kind, mesh axes, bytes, collectives) per collective of an XLA program, bytes in
    tpusim's V convention (`xla_logical_bytes`), collectives as `xla_logical_counts` counts
    them."""
    n = xr["num_chips"]
    sizes = dict(zip(xr["mesh_axes"], xr["mesh_shape"], strict=True))
    loops: dict[tuple, list[str]] = collections.defaultdict(list)
    seen_loops = set()
    for o in xr["ops"]:
        if o["kind"] == "collective-permute" and o["in_loop"]:
            tag = o["loop"].split(":")[0]
            kind = {"windowed-ag": "all-gather", "windowed-rs": "reduce-scatter"}.get(tag)
            key = (o["layer"], o["phase"], o["bytes"])
            if kind and (key, o["loop"]) not in seen_loops:
                seen_loops.add((key, o["loop"]))
                loops[key].append(kind)
    for kinds in loops.values():
        kinds.sort()  # "all-gather" < "reduce-scatter"
    counted_loops = set()
    for o in xr["ops"]:
        if o.get("fixup"):  # a padded reduce-scatter's row moves (parse_hlo_collectives)
            yield "reduce-scatter", _axes_spanned(xr, o["pair_list"]), o["count"] * o["bytes"], 0
            continue
        calls = o["count"]
        if o["kind"] == "collective-permute":
            axes = _axes_spanned(xr, o.get("pair_list") or [])
            tag = o["loop"].split(":")[0] if o["in_loop"] else ""
            if tag.startswith("windowed"):
                kind = {"windowed-ag": "all-gather", "windowed-rs": "reduce-scatter"}[tag]
                # The ring is one collective per run of its loop (count = runs x trips).
                trips = int(re.search(r"\[x(\d+)\]", o["loop"]).group(1))
                calls = 0 if o["loop"] in counted_loops else o["count"] // trips
                counted_loops.add(o["loop"])
            else:
                # A prologue is issued before its loop (inside a scanned layer's loop body
                # when the layers are scanned).
                pending = loops.get((o["layer"], o["phase"], o["bytes"]))
                role = o.get("ring", "")
                if pending:
                    kind, calls = pending.pop(0), 0
                elif role == "ag":  # a written-out gather ring: N - 1 messages
                    group = 1
                    for a in axes.split(","):
                        group *= sizes.get(a, 1)
                    kind, calls = "all-gather", o["count"] / max(group - 1, 1)
                elif role in ("rs", "rs0"):  # a reduce-scatter ring starts from zeros each way
                    kind, calls = "reduce-scatter", o["count"] / 2 if role == "rs0" else 0
                else:
                    kind = "collective-permute"
        else:
            kind = o["kind"]
            groups = parse_replica_groups(o.get("replica_groups", ""), n)
            axes = _axes_spanned(xr, groups)
            if kind == "all-to-all":  # the HLO operand is one chip's buffer; V is the group's
                o = dict(o, bytes=o["bytes"] * len(groups[0]))
        yield kind, axes, o["count"] * o["bytes"], calls


def xla_logical_bytes(xr: dict) -> dict[tuple[str, str], float]:
    """(logical kind, mesh axes) -> bytes of an XLA program, tpusim's V convention.

    A windowed einsum's ring is the all-gather (loop `_ag`) or reduce-scatter (`_rs`) it
    decomposes: its per-chip messages over the N ring steps sum to the V of that collective.
    Each ring's first step is issued before the loop as one async collective-permute of the
    same message size (N + 1 messages in all); the prologues of a layer and phase are handed
    to its loops of that message size one each (all-gather loops first: a layer's backward
    holds both kinds with equal messages); in a scanned program they sit in the scan's loop
    body. Permutes matched to no loop are the steps of an unrolled ring (a windowed einsum over
    few chips written out step by step) when `parse_hlo_collectives` gave them a `ring` role
    (gather or reduce-scatter), else collective-permutes.
    """
    out: dict[tuple[str, str], float] = collections.defaultdict(float)
    for kind, axes, nbytes, _calls in _xla_logical_ops(xr):
        out[(kind, axes)] += nbytes
    return dict(out)


def xla_logical_counts(xr: dict) -> dict[tuple[str, str], float]:
    """(logical kind, mesh axes) -> collectives per step of an XLA program: each collective
    instruction once per execution, except a windowed einsum's ring, which is one collective
    (its loop once per run, its prologue none; a written-out gather ring per N - 1 messages, a
    written-out reduce-scatter ring per zero start each way), and a padded reduce-scatter's
    fix-up permute (part of it)."""
    out: dict[tuple[str, str], float] = collections.defaultdict(float)
    for kind, axes, _nbytes, calls in _xla_logical_ops(xr):
        out[(kind, axes)] += calls
    return dict(out)


def tpusim_trace(name: str):
    """tpusim's compiled step for the same program (the config's model widths, mesh, batch,
    sequence or context length, remat full, dot attention and the like-for-like flags)."""


    cfg = CONFIGS[name]
    mesh = parse_mesh(",".join(f"{k}={v}" for k, v in cfg["mesh"].items()))
    chips = 1
    for v in cfg["mesh"].values():
        chips *= v
    if cfg["mode"] == "decode":
        model = dataclasses.replace(load_model("llama3-8b"), num_layers=cfg["layers"],
                                    **dims_override(cfg))
        # The program's new token attends to the kv_len cached tokens and to itself: tpusim's
        # context (the tokens a decode step attends to) is kv_len + 1.
        dc = DecodeConfig(batch=int(cfg["batch_per_chip"] * chips),
                          context_len=cfg["kv_len"] + 1,
                          sampling="greedy" if cfg.get("sampling") == "argmax" else "top-k")
        return compile_decode_step(model, mesh, chips, dc)
    moe = {}
    if cfg["mode"] == "moe_train":
        m = cfg["moe"]
        model = model_from_dict(xla_compile.tpusim_model_dict(
            dict(d_model=m["d_model"], num_heads=m["num_heads"], num_kv_heads=m["num_heads"],
                 head_dim=m["head_dim"], d_ff=m["d_ff"], vocab_size=m["vocab_size"],
                 num_experts=m["num_experts"], experts_per_token=m["top_k"],
                 moe_d_ff=m["d_ff"]), cfg["layers"], name))
        moe = {"moe": MoeConfig(capacity_factor=m["capacity_factor"])}
    else:
        model = dataclasses.replace(load_model("llama3-8b"), num_layers=cfg["layers"],
                                    **dims_override(cfg))
    tc = TrainingConfig(seq_len=cfg["seq"], batch_per_chip=cfg["batch_per_chip"],
                        remat=Remat.FULL, attention="dot", **LIKE_FOR_LIKE.get(name, {}), **moe)
    return compile_training_step(model, mesh, chips, tc)


def tpusim_dot_flops(name: str) -> float:
    """MXU FLOPs per chip of tpusim's compiled step for the same program."""
    return float(sum(o.flops for o in tpusim_trace(name).ops
                     if o.kind == "compute" and o.unit == "mxu"))


def tpusim_logical_bytes(name: str) -> dict[tuple[str, str], float]:
    """(kind, mesh axes) -> V bytes of tpusim's compiled step for the same program."""
    return tpusim_logical(name)[0]


def tpusim_logical(name: str) -> tuple[dict, dict]:
    """(kind, mesh axes) -> (V bytes, collectives) of tpusim's compiled step."""
    out: dict[tuple[str, str], float] = collections.defaultdict(float)
    calls: dict[tuple[str, str], int] = collections.defaultdict(int)
    for o in tpusim_trace(name).ops:
        if o.kind == "collective":
            out[(o.collective, ",".join(o.mesh_axes))] += o.bytes
            calls[(o.collective, ",".join(o.mesh_axes))] += 1
    return dict(out), dict(calls)


OP_CLASSES = ("layer matmuls", "attention matmuls", "softmax and mask", "norms",
              "other elementwise", "windowed-einsum accumulators", "MoE router",
              "MoE dispatch and combine", "embedding, logits and loss", "optimizer update",
              "unattributed", "collectives")
_ATTN_EINSUMS = ("bskgd,btkd->bkgst", "bkgst,btkd->bskgd", "bshd,bthd->bhst", "bhst,bthd->bshd")
_DISPATCH_EINSUMS = ("bsm,bsec->ebcm", "ebcm,bsec->bsm")


def xla_op_class(op_name: str, matmul: str, loop: str = "") -> str:
    """The class of one XLA instruction from its op_name, that of the matmul in its fusion
    ("" if none) and its loop ("windowed-ag" / "windowed-rs" in a windowed einsum): named
    scopes of `xla_compile.Decoder` / `lower_moe_train` (layer{i}, norm, attention, router, embed,
    head, adam / sgd) and the einsum it computes. Every fusion of a windowed reduce-scatter
    loop but its matmuls works on the ring's accumulators (a select zeroing them, without an
    op_name, and the add of each step's partial product, named after the dot), whichever
    matrix it is; in an all-gather loop the named ones copy output slices into place."""
    both = op_name + " " + matmul
    if not matmul and (loop == "windowed-rs" or (loop.startswith("windowed") and not op_name)):
        return "windowed-einsum accumulators"
    if not op_name and not matmul:
        return "unattributed"
    if re.search(r"(^|/)(adam|sgd)(/|$)", op_name):
        return "optimizer update"
    if re.search(r"\b(head|embed)\b", both):
        return "embedding, logits and loss"
    if matmul:
        if "/attention/" in matmul or any(e in matmul for e in _ATTN_EINSUMS):
            return "attention matmuls"
        if any(e in matmul for e in _DISPATCH_EINSUMS):
            return "MoE dispatch and combine"
        return "MoE router" if "/router/" in matmul else "layer matmuls"
    if "/attention/" in op_name:
        return "softmax and mask"
    if "/router/" in op_name:
        return "MoE router"
    if "/norm/" in op_name:
        return "norms"
    return "other elementwise"


def tpusim_op_class(op) -> str:
    """The class of one op of tpusim's compiled step (by its name, unit and layer)."""
    if op.kind == "collective":
        return "collectives"
    name = op.name[3:] if op.name.startswith("re-") else op.name
    if name.startswith("adam"):
        return "optimizer update"
    if name.endswith("_accum"):
        return "windowed-einsum accumulators"
    if op.layer < 0:
        return "embedding, logits and loss"
    if name.startswith(("attn_scores", "attn_values", "attn_bwd")) or name == "attention":
        return "attention matmuls"
    if name.startswith("softmax"):
        return "softmax and mask"
    if name.startswith("norm_"):
        return "norms"
    if name.startswith(("router", "topk_route", "moe_masks")):
        return "MoE router"
    if name.startswith(("moe_dispatch", "moe_combine")):
        return "MoE dispatch and combine"
    return "layer matmuls" if op.unit == "mxu" else "other elementwise"


def xla_class_seconds(xr: dict, chip: str) -> dict[str, float]:
    out: dict[str, float] = collections.defaultdict(float)
    for c in xr.get("op_costs", []):
        out[xla_op_class(c["op_name"], c["matmul"], c.get("loop", ""))] += \
            c["cycles"] / XLA_CLOCK_HZ[chip]
    return dict(out)


def tpusim_class_seconds(name: str) -> tuple[dict[str, float], float, float]:
    """Per class, the summed time of tpusim's ops (compute ops at their cost alone on the chip,
    `sim.engine.costs.compute_op_times` plus the per-op overhead, like XLA's per-op estimates;
    collectives as simulated in the replay), the replay's step time, and the summed replay
    durations of the compute ops (longer where their HBM traffic shares the bandwidth with
    collective DMA)."""
    chip, topo = pod(name)
    trace = tpusim_trace(name)
    res = simulate_step(trace, chip, topo, executor=Executor.REPRESENTATIVE)
    dur = {int(i): e - s for i, s, e in zip(res.ops["op_id"], res.ops["start_s"], res.ops["end_s"],
                                           strict=True)}
    out: dict[str, float] = collections.defaultdict(float)
    replayed = 0.0
    for op in trace.ops:
        if op.kind == OpKind.COMPUTE:
            out[tpusim_op_class(op)] += max(compute_op_times(chip, op)) + chip.op_overhead_s
            replayed += dur[op.id]
        else:
            out[tpusim_op_class(op)] += dur[op.id]
    return dict(out), res.step_time_s, replayed


def logical_table(name: str, xr: dict) -> tuple[list[tuple], list[float]]:
    """Rows (kind, axes, XLA bytes, tpusim bytes, error or None, XLA collectives, tpusim
    collectives) and the byte errors of the rows both programs have."""
    x, xc_ = xla_logical_bytes(xr), xla_logical_counts(xr)
    t, tc = tpusim_logical(name)
    rows, errs = [], []
    for key in sorted(set(x) | set(t)):
        xb, tb = x.get(key, 0.0), t.get(key, 0.0)
        err = (tb - xb) / xb if xb > 0 else None
        if err is not None:
            errs.append(err)
        rows.append((*key, xb, tb, err, xc_.get(key, 0), tc.get(key, 0)))
    return rows, errs


WIDER_SET_NOTES = """What the wider set showed (read off their HLO; docs/model.md "Collectives as
XLA emits them" has each rule):

* **data_fsdp_v6e16** (v6e, data=4 x fsdp=4): with the weights replicated over data XLA builds
  no windowed einsum, so tpusim's mixed modes issue plain gathers and reduce-scatters there.
  XLA's gradient reduce-scatters are TPU all-reduce-scatter fusions (an all-reduce whose result
  the fusion only dynamic-slices: one ring reduce-scatter); the parser read them as
  all-reduces of whole gradients until this session (the 100% miss of before). One gradient
  ([4096, 4096]) is padded to 4 x 1040 rows and its extra rows moved to the next shard by a
  collective-permute, counted with its reduce-scatter (padding and permutes: 1.75 MiB, 0.1%,
  not modelled by tpusim). The lookup's gradient is all-gathered over data x fsdp (256 MiB of
  rows, smaller than the 1002 MiB table; with a smaller table XLA all-reduces the table
  instead) rather than all-to-all'ed, and the norm scales' gradients are all-reduced over
  data x fsdp at once.
* **moe_fsdp_ep_v6e16**: the program shards as MaxText's logical-axis rules do (every
  non-expert weight's d_model over fsdp x expert, the experts' over fsdp, their `exp`
  dimension over expert, tokens over fsdp x expert) and now has the final norm MaxText's
  decoder (and tpusim's model) has before the output projection. Three readings of the HLO
  were wrong: the windowed rings' trip counts (the loop counter steps through a copy: every
  ring was counted twice), their prologues (issued inside the scanned layer's body, so left
  as collective-permutes), and the expert weights' rings over fsdp = 4, which XLA writes out
  step by step in the layer's body (read as collective-permutes; now as gather or
  reduce-scatter steps by what they send). tpusim's side: such a 4-chip ring gathers N - 1
  shards and the up projection's gradient shares the gate's ring start (13 reduce-scatter
  messages per layer, as compiled); an MoE layer gathers all four attention matrices again
  for their input gradients; the router's backward matmuls (its dot FLOPs were 0.012% short).
  Left: tpusim gathers the token ids over fsdp x expert for the lookup's gradient too, which
  this program does not (0.125 MiB, +0.2% of the fsdp,expert gathers).
* **decode_tp8_v5e8**, **decode_topk_tp8_v5e8** (f32 logits, as tpusim's decode has them and
  as we read MaxText's `cast_logits_to_fp32` default, which the references do not cover): the
  embedding lookup's all-reduce over `tensor`
  and the sampling collectives of `--sampling greedy` (two tiny all-gathers) and `top-k`
  (all-to-alls of the logits and their indices into whole rows for XLA's sort and back, the
  64 best spread from the first shard by collective-permutes, an all-gather and an all-reduce
  for the draw). The new token also attends to itself: tpusim's context is KV cache + 1."""


def _mode_label(cfg: dict) -> str:
    """What a program heading says beyond the dense training step's widths."""
    if cfg["mode"] == "decode":
        pick = {"argmax": "argmax", "top-k": "top-64 draw"}[cfg.get("sampling", "argmax")]
        dt = "f32" if cfg.get("logits_f32") else "bf16"
        return f", decode step (KV cache {cfg['kv_len']}, {pick} of the {dt} logits)"
    if cfg["mode"] == "moe_train":
        m = cfg["moe"]
        return (f", MoE train step (d_model {m['d_model']}, {m['num_experts']} experts of d_ff "
                f"{m['d_ff']}, top-{m['top_k']}, capacity factor {m['capacity_factor']}, "
                f"{m['num_heads']} heads, vocab {m['vocab_size']}, SGD)")
    if cfg.get("param_dtype") == "float32":
        return (", f32 weights cast to bf16 in each layer (tpusim `--param-dtype fp32 "
                "--gather-dtype bf16`)")
    return ""


def render_collectives_section(results: dict) -> str:
    """The docs/validation.md section: per program, bytes by kind and axis, XLA vs tpusim."""
    def mib(b: float) -> str:
        if not b:
            return "-"
        return f"{b / 2**20:,.1f}" if b >= 2**20 else f"{b / 2**20:.4f}"

    lines = ["## Collective bytes against XLA's compiled programs", "",
             "_Generated by `python -m validation.maxtext --write` (or `--write-collectives`) "
             "from the cached XLA side "
             "(`validation/results/xla_collectives.json`, written by "
             "`python -m validation.xla_crosscheck --json`; refresh it with jax[tpu]) and "
             "tpusim's compiled step with like-for-like "
             "flags (remat full, the program's mesh and batch, `--tp-activations replicated` "
             "where the program replicates the residual over `tensor`, and the gather forms "
             "XLA picks by itself: `--fsdp-gather mixed-async` on v5e, "
             "`mixed-blocking` on v5p and v6e)._", "",
             "Bytes are V per replica group in MiB, summed over the step (tpusim's convention; "
             "docs/xla_crosscheck.md). XLA's windowed-einsum rings are counted as the all-gather "
             "or reduce-scatter they decompose (their N + 1 per-step messages, prologue "
             "included, sum to (N + 1) / N of its V, which tpusim's windowed collectives carry "
             "too); axes are the mesh axes a replica group or a permute's chip pairs span. "
             "Error = (tpusim - XLA) / XLA; `-100%` is a collective tpusim does not emit, `new` "
             "one XLA does not. Target (issue 11): within 3% for every kind and axis. n: "
             "collectives per step (`xla_logical_counts`: XLA's instructions once per "
             "execution, a windowed ring one collective, its loop counted once per run and its "
             "prologue not at all, a written-out ring per N - 1 gather messages or per zero "
             "start each way; tpusim's collective ops). Counts are reported, not targeted: "
             "XLA merges some collectives (one ring for the gate and up gradients of a "
             "written-out ring, combined all-reduces of several gradients).", ""]
    all_errs: list[float] = []
    base_errs: list[float] = []
    names: list[str] = []
    base_names: list[str] = []
    for name in sorted(results):
        xr = results[name].get("xla")
        if not xr or "mesh_device_ids" not in xr:
            continue
        cfg = CONFIGS[name]
        rows, errs = logical_table(name, xr)
        all_errs += errs
        names.append(name)
        if cfg["mode"] == "train" and "data" not in cfg["mesh"]:
            base_errs += errs
            base_names.append(name)
        widths = dims_override(cfg)
        lines += [f"### {name}: {cfg['topology']}, mesh "
                  + ", ".join(f"{k}={v}" for k, v in cfg["mesh"].items())
                  + f", {cfg['layers']} layers, seq {cfg['seq']}, batch/chip "
                  f"{cfg['batch_per_chip']}"
                  + ("".join(f", {k} {v}" for k, v in widths.items()) if widths else "")
                  + _mode_label(cfg), "",
                  *([f"Compiled {cfg['when']}.", ""] if cfg.get("when") else []),
                  "| kind | axes | XLA MiB | tpusim MiB | error | XLA n | tpusim n |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for kind, axes, xb, tb, err, xn, tn in rows:
            e = "new" if err is None else f"{100 * err:+.1f}%"
            xn_ = f"{xn:g}" if xn == int(xn) else f"{xn:.1f}"
            lines.append(f"| {kind} | {axes} | {mib(xb)} | {mib(tb)} | {e} | {xn_ or '-'} | "
                         f"{tn or '-'} |")
        if errs:
            lines += ["", f"Median |error| {100 * statistics.median(abs(e) for e in errs):.1f}%, "
                      f"worst {100 * max(abs(e) for e in errs):.1f}% over the {len(errs)} "
                      f"kinds and axes XLA emits.", ""]
        if xr.get("dot_flops"):
            xd, td = xr["dot_flops"], tpusim_dot_flops(name)
            lines += [f"Dot FLOPs per chip: XLA {xd / 1e12:.6f} TFLOP, tpusim {td / 1e12:.6f} "
                      + ("(exact)." if xd == td else f"({100 * (td - xd) / xd:+.3f}%)."), ""]
    if any(CONFIGS[n]["mode"] != "train" or "data" in CONFIGS[n]["mesh"] for n in names):
        lines += [WIDER_SET_NOTES, ""]
    missing = [n for n in CONFIGS if n not in results]
    if missing:
        lines += ["In `CONFIGS` but not compiled yet (`--json` compiles them): "
                  + ", ".join(missing) + ".", ""]
    for label, errs in ((f"Dense fsdp and fsdp x tensor training ({len(base_names)} programs: "
                         f"{', '.join(base_names)})", base_errs),
                        (f"All {len(names)} programs", all_errs)):
        if errs:
            med = statistics.median(abs(e) for e in errs)
            worst = max(abs(e) for e in errs)
            lines += [f"{label}: median |error| {100 * med:.1f}%, worst {100 * worst:.1f}% "
                      f"(target 3%: **{'met' if worst <= 0.03 else 'NOT met'}**).", ""]
    return "\n".join(lines)


def op_cost_rows(name: str, xr: dict) -> tuple[list[tuple], float, float]:
    """Rows (class, XLA s or None, tpusim s) of one program in OP_CLASSES order (classes
    neither side has are left out; XLA has no estimate for collectives), tpusim's step and its
    compute ops' summed replay durations."""
    chip = CONFIGS[name]["topology"].split(":")[0]
    x = xla_class_seconds(xr, chip)
    t, step, replayed = tpusim_class_seconds(name)
    rows = [(k, None if k == "collectives" else x.get(k, 0.0), t.get(k, 0.0))
            for k in OP_CLASSES if x.get(k) or t.get(k)]
    return rows, step, replayed


def render_op_costs_section(results: dict) -> str:
    """The docs/validation.md section: per program and op class, XLA's estimated time against
    tpusim's costed time."""
    def ms(v: float | None) -> str:
        return "no estimate" if v is None else ("-" if not v else f"{v * 1e3:.2f}")

    def ratio(x: float | None, t: float) -> str:
        return f"{t / x:.2f}" if x and t else "-"

    lines = ["## Per-op costs: XLA's estimates against tpusim", "",
             "_Generated with the collective-bytes section above, from the same cache "
             "(`op_costs`: every instruction's `estimated_cycles` as `xla_crosscheck.py`'s "
             "worker reads them from the compiled HLO)._", "",
             "XLA's TPU compiler puts its own cost estimate on every instruction it schedules "
             "(`estimated_cycles` in the backend config; collectives and custom calls carry "
             "none). Summed per op class (instructions in a loop times its trip count) "
             "and converted at the chip's clock (v5e 1.5 GHz, v5p and v6e 1.75 GHz; "
             "`XLA_CLOCK_HZ`), against the summed costs of tpusim's ops of the same class in "
             "the same step (a compute op alone on the chip, as XLA estimates it: FLOPs at the "
             "fitted MXU/VPU rate or bytes at the HBM rate, whichever takes longer, plus the "
             "per-op overhead; collectives as simulated in the replay, most of them overlapped "
             "with compute). An XLA instruction's class comes "
             "from the named scope of its op_name (`layer{i}/norm`, `layer{i}/attention`, "
             "`router`, `embed`, `head`, `adam`) and the einsum of the matmul in its fusion; "
             "a fusion that holds a matmul counts as that matmul. tpusim is not tuned to these "
             "estimates: they are XLA's model, not measurements.", ""]
    totals: list[tuple[str, float, float]] = []
    accum: list[str] = []
    accum_only_tpusim: list[str] = []
    stretch: list[tuple[float, str, float, float]] = []  # replay / alone, name, replay, alone
    for name in sorted(results):
        xr = results[name].get("xla")
        if not xr or not xr.get("op_costs"):
            continue
        cfg = CONFIGS[name]
        rows, step, replayed = op_cost_rows(name, xr)
        lines += [f"### {name}: {cfg['topology']}, mesh "
                  + ", ".join(f"{k}={v}" for k, v in cfg["mesh"].items())
                  + f", {cfg['mode'].replace('_', ' ')}", "",
                  "| op class | XLA estimate ms | tpusim ms | tpusim / XLA |",
                  "|---|---:|---:|---:|"]
        xt = tt = 0.0
        for k, xv, tv in rows:
            lines.append(f"| {k} | {ms(xv)} | {ms(tv)} | {ratio(xv, tv)} |")
            if k != "collectives":
                xt += xv or 0.0
                tt += tv
        lines += [f"| **compute, all classes** | **{ms(xt)}** | **{ms(tt)}** | "
                  f"**{ratio(xt, tt)}** |", "",
                  f"tpusim's step (replay, collectives overlapped): {step * 1e3:.2f} ms; its "
                  f"compute ops take {replayed * 1e3:.2f} ms there.", ""]
        totals.append((name, xt, tt))
        stretch.append((replayed / tt if tt else 1.0, name, replayed, tt))
        by_class = {k: (xv, tv) for k, xv, tv in rows}
        xa, ta = by_class.get("windowed-einsum accumulators", (0.0, 0.0))
        if xa:
            accum.append(f"{name} {100 * xa / xt:.1f}%")
        elif ta:
            accum_only_tpusim.append(name)
    if totals:

        v5e_mxu = get_chip("v5e").mxu_efficiency
        worst = max(stretch)
        lines += ["Compute totals, tpusim / XLA: " + ", ".join(
            f"{n} {t / x:.2f}" for n, x, t in totals) + ".", "", OP_COSTS_EXPLAIN.format(
                v5e_mxu=v5e_mxu, v6e_mxu=get_chip("v6e").mxu_efficiency, v5e_inv=1 / v5e_mxu,
                accum=", ".join(accum) or "none of these programs",
                stretch=f"{worst[1]}: {worst[2] * 1e3:.2f} ms against {worst[3] * 1e3:.2f} ms",
                accum_only_tpusim=(
                    " " + ", ".join(accum_only_tpusim) + ": XLA has no windowed loops there, "
                    "tpusim's like-for-like form still reduce-scatters through windowed rings, "
                    "with their accumulators." if accum_only_tpusim else "")), ""]
    return "\n".join(lines)


OP_COSTS_EXPLAIN = """What the tables say:

* **Matmuls.** tpusim costs a matmul at the fitted MXU efficiency ({v5e_mxu:g} of peak on v5e
  and v5p, {v6e_mxu:g} on v6e; fitted on measured MaxText step times, above) or at its HBM bytes if
  those take longer; XLA's model costs the large matmuls near the MXU peak: at the clocks
  above its estimate for the logits matmul is 97-98% of the peak on v5e and v5p (its fastest
  fusions: 128,302 FLOP per cycle on v5e, 97.9% of 4 MXUs x 128 x 128 x 2; 256,468 on v5p,
  97.8% of twice that). The fitted efficiency alone makes tpusim's compute-bound matmuls
  1/{v5e_mxu:g} = {v5e_inv:.2f}x XLA's estimate on v5e; it is fitted on measured steps, which
  XLA's static estimate does not see, and is not re-tuned to XLA here. XLA's model also charges the
  per-step accumulation of a windowed all-gather einsum that contracts the gathered dimension
  (q, k, v, gate, up forward): on v5e those loops' matmul fusions are estimated at 1.39-2.29x
  their FLOPs at peak, the other windowed loops' at 1.04-1.24x. tpusim charges that partial
  sum one output's worth of HBM traffic per ring step, and the output-gathered and
  reduce-scatter rings' whole operands one read per two steps (docs/model.md, "A windowed
  einsum"), all in HBM, where XLA keeps some of these buffers in VMEM at these sizes. The
  other differences between the matmul rows (v5p's tensor-split matmuls, v6e, the MoE
  experts) are not analysed yet.
* **The v6e clock** (1.75 GHz, `XLA_CLOCK_HZ`) is derived, not read off a reference: 918
  TFLOP/s (MaxText's peak; tpu.md's 9.2e14) over one TensorCore (Google Cloud's v6e page, as
  `sim/hardware.py` records) of 4 MXUs (tpu.md §1.2: the scalar core "drives the VPU, 4
  MXUs") of 256 x 256 x 2 FLOP per cycle (tpu.md §1.2) = 1.751 GHz. Google's Trillium
  announcement agrees (4.7x v5e's peak from larger MXUs and a higher clock: 1.5 GHz x 918 /
  197 / 4 = 1.75 GHz; twice the arrays would mean 0.875 GHz, a lower clock). XLA's estimates
  agree on its HBM side: the output projection's windowed-ring
  accumulator fusions have the same shapes in every fsdp=16 program, and at these clocks the
  select (131 MB moved) runs at 41% of v5e's HBM bandwidth, 36% of v5p's and 41% of v6e's,
  the add (394 MB) at 61%, 54% and 68%; at 0.875 GHz v6e's would be half of that
  (`xla_crosscheck.py --analyze DIR` prints these rates from the `--dump` modules). On its MXU
  side they do not: XLA's v6e model gives some matmul fusions 838,861 FLOP per cycle (a
  [2048, 4096] x [4096, 4096] matmul from VMEM in 81,920 cycles), 1.6x the 524,288 of 4
  arrays; most large v6e matmuls come out at 450,000-490,000 (86-94%) and the logits at 63%
  and 89%. So XLA's v6e model does not bound every matmul by the 918 TFLOP/s peak at this
  clock; the v6e matmul rows carry that uncertainty.
* **Attention.** tpusim costs dot attention's score and P.V matmuls by their bytes (f32 scores
  written and read back, HBM-bound at these sizes). XLA's estimate for its attention matmul
  fusions is 2.4-3.1x tpusim's on v5e and v5p, 1.35x on v6e and 0.9x on the MoE program.
  Which of the mask and softmax work XLA fuses into the score matmul differs by generation and
  mesh (docs/model.md, "Memory"), so compare the attention-matmul and softmax rows together:
  with them, XLA is 1.7x tpusim on v5e, 2.1x on v5p, 1.1x on v6e. These fusions are HBM-bound,
  and XLA's model moves bytes at about half to two thirds of the HBM peak wherever it can be
  checked (the ring accumulators above and below, `--analyze`), tpusim at the peak
  (`hbm_efficiency` 1.0: the MaxText fit cannot identify it), which accounts for most of the
  v5e and v5p gaps; the bytes per score are docs/model.md's.
* **MoE router.** The program builds its masks as MaxText's `generate_masks` does (`xla_compile.
  lower_moe_train(router="maxtext")`: the bf16 top-k weights times an int32 one-hot of the
  capacity slot, a bf16 combine mask). Most of XLA's router estimate (1.23 of 1.82 ms) is two
  copies per layer in the backward: relayouts of the combine mask's gradient
  ([tokens, experts, capacity + 1] bf16, 2048 x 8 x 641, 21 MB) on either side of its
  all-to-all, 537,972 cycles (0.31 ms) each, about 12x the time to read and write it at v6e's
  HBM rate. The program's first version built the combine mask in f32 and cast it: XLA's
  router estimate was 7.13 ms, nearly all of it (6.6 ms) two one-hot fusions per layer and
  pass over [tokens, top-k, experts, capacity] (21 M elements), 0.82 ms each, 60x the time to
  write the mask (the inputs hold the expert index in the lane dimension, the output in the
  sublanes: presumably a relayout), and the gradient went through the all-to-all in f32.
  tpusim's `moe_masks` keeps the bytes (both masks written) and FLOPs cost, and no relayout;
  the measured MoE runs (above) are predicted slow, not fast, so nothing in them asks for
  XLA's relayouts.
* **Decode.** XLA's estimate for the decode step's weight matmuls (0.05 ms) is below the time
  to read those weights from HBM (2 layers x 218 M parameters / 8 chips in bf16 = 109 MB, 0.13
  ms at v5e's 8.2e11 B/s), which tpusim charges. The compiled program streams the weights
  into VMEM with asynchronous copies (`copy-start`/`copy-done`, one a cross-program prefetch)
  and slices (`slice-start`/`slice-done`, joined by `ConcatBitcast` custom calls); the matmul
  fusions read their weights from VMEM (`S(1)` layouts), so their estimates leave the HBM
  read out, and the copies, like collectives, carry no estimate. The bytes still cross HBM
  once per step, overlapped with other work, and at M = 8 rows that read is the step's
  bound: tpusim, which charges it to the matmuls, is right, and the sum of XLA's per-op
  estimates is not a step time here.
* **tpusim's replay against its costs alone.** The rows charge each compute op its cost alone
  on the chip, as XLA's estimates do, and so does tpusim's replay: a compute op streams HBM at
  its own pace beside the collectives' DMA (docs/model/training.md, "HBM"), so its compute ops
  take their costs alone there too ("its compute ops take ... there" under each table; the
  largest ratio, {stretch}). Until 2026-12-03 compute and collective DMA shared HBM max-min and
  the same ops took longer beside the DMA (fsdp_v5e16: all compute ops 125.6 ms against
  120.5 ms alone, the step 153.6 ms), which let a faster link slow a step; until 2026-11-30
  they shared it in proportion to the bytes in flight (the compute ops 136.2 ms, the step
  162.2 ms, at the MXU factor then, 0.78).
* **Norms and other elementwise work** cannot be compared row by row: XLA fuses RMSNorm, the
  residual adds and the SwiGLU product into the neighbouring matmul fusions, which these tables
  count as matmuls (a fusion that holds a matmul is that matmul). Compare the totals.
* **Windowed-einsum accumulators** ({accum} of XLA's compute estimate): every fusion of
  XLA's windowed reduce-scatter loops but the matmuls (a select zeroing the two accumulators,
  without an op_name, and the add of each ring step's partial product, named after the dot),
  against tpusim's `*_accum` ops: 4 x |W| bytes of each windowed gradient reduce-scatter
  through HBM (docs/model.md, "Training steps"). XLA keeps the smaller matrices' accumulators
  in VMEM (`S(1)`) yet estimates those fusions at about the same cost per byte as the output
  projection's HBM-resident ones (v5e: 580 and 502 GB/s of bytes moved), so tpusim charges
  all of them at the HBM rate.{accum_only_tpusim}
* **Unattributed**: other instructions without an op_name, mostly layout copies of weights
  and activations between fusions (they carry estimates too); tpusim has no such ops.
* **Optimizer update**: the MoE program's update is SGD (XLA side) against tpusim's Adam.
* **Collectives**: XLA's cost model puts no estimate on collectives; tpusim's row is the summed
  simulated time of its collectives, most of it overlapped with compute (the step time shows
  how much), so it is not part of the compute totals."""


