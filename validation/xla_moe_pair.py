"""A matched pair against XLA's own cost model (docs/validation.md, effect 3).

Two tpu-recipes runs of the same month (Oct 2024, libtpu 20241028), mesh (fsdp=256 on a v6e
16x16), remat (`full`) and sequence (4096), one dense and one MoE:
`tpu-recipes-v6e-llama2-70b-v6e-256-oct2024` (tpusim +0.0%) and
`tpu-recipes-v6e-mixtral-8x7b-v6e-256-oct2024` (tpusim +15.9%). Each is compiled deviceless
(jax[tpu] 0.10.2, `xla_compile.lower_moe_train`: the same decoder code for both, two scanned layers
under `jax.checkpoint(nothing_saveable)`, GQA dot attention, the Mixtral with MaxText's
capacity-1.25 one-hot dispatch, the LLaMA with a dense SwiGLU MLP in its place) at the runs'
own widths and mesh, one sequence per chip, and XLA's per-instruction `estimated_cycles`
(loop trip counts applied; `xla_hlo_read.parse_hlo_costs`) are summed per class per layer
and sequence. The same classes are read off tpusim's replay of each run as validated (its own
batch and layers, flash attention), per layer and sequence. Scaled by each run's layers and
batch, XLA's estimate of the layers' compute is set against the measured step.

The question (effect 3): is XLA's estimate / measurement the same for the two runs? If XLA's
static model also puts the Mixtral ~15% above the LLaMA, it shares tpusim's error and the
difference is in the runtime; if not, the class where tpusim departs from XLA for the MoE
alone is where tpusim's model is wrong. Also compiled: both again with the recipes'
scoped-VMEM limit (`VARIANTS`), and the custom 750B MoE at its two capacity factors
(`CAPACITY`: what XLA's model says the capacity costs, against the two runs' step difference).

Observed (2026-12-01, jax/libtpu 0.10.2): XLA / measured for the layers' compute but attention
1.036 (LLaMA) and 1.326 (Mixtral), tpusim 1.000 and 1.191: XLA's model prices the expert
matmuls at the dense matmuls' cycles per FLOP and shares tpusim's error; the compiled program's
forward / recomputed / backward FLOPs per class are tpusim's. The VMEM flag lowers every matmul
class's estimate by 27-34% in both models alike (docs/validation.md renders the numbers).

    /work/fid-venv/bin/python -m validation.xla_moe_pair --worker mixtral-8x7b --dump DIR
    .venv/bin/python -m validation.xla_moe_pair            # compile what the cache lacks,
                                                           # then print the comparison
    .venv/bin/python -m validation.xla_moe_pair --no-compile   # the cache only

The cache is `validation/results/xla_moe_pair.json` (per program: XLA's `op_costs`, its dot
FLOPs per class, the compile's wall time); `python -m validation.maxtext --write` renders the table
in effect 3 from it.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time
from pathlib import Path

from sim.chips import get_chip
from sim.engine.costs import compute_op_times
from sim.engine.executors import Executor, simulate_step
from validation import maxtext_runs, xla_compile
from validation.xla_hlo_read import estimated_cycles, op_name, trip_count
from workloads.hlo.costs import conv_flops
from workloads.hlo.parser import HloModule, dot_dims, parse_hlo
from workloads.trace import OpKind

CACHE = xla_compile.RESULTS / "xla_moe_pair.json"

# name -> the run it matches, its widths, and the run's own layers and sequences per chip
# (docs/reference/maxtext_runs.json). Both compiled on v6e:16x16 with fsdp=256 (expert=1),
# seq 4096, 2 scanned layers, one sequence per chip.
PAIR = {
    "llama2-70b": dict(run="tpu-recipes-v6e-llama2-70b-v6e-256-oct2024", d_model=8192,
                       num_heads=64, num_kv_heads=8, head_dim=128, d_ff=28672,
                       num_experts=0, top_k=0, capacity_factor=0.0, vocab_size=32000,
                       run_layers=80, run_batch=4),
    "mixtral-8x7b": dict(run="tpu-recipes-v6e-mixtral-8x7b-v6e-256-oct2024", d_model=4096,
                         num_heads=32, num_kv_heads=8, head_dim=128, d_ff=14336,
                         num_experts=8, top_k=2, capacity_factor=1.25, vocab_size=32000,
                         run_layers=32, run_batch=8),
}
TOPOLOGY, MESH, SEQ, LAYERS = "v6e:16x16", {"fsdp": 256, "expert": 1}, 4096, 2
# The custom 750B MoE's two runs, which differ only in the capacity factor (effect 3's
# "capacity line"), compiled the same way at their own sizes (d_model 8192, 128 query heads
# of 256 on 8 KV heads, 16 experts of d_ff 32768, top-2, seq 8192, one sequence per chip,
# fsdp=16 x expert=16 on jax's device mesh): what XLA's model says the capacity costs.
CAPACITY = {
    f"moe-750b-cf{cf}": dict(run=run, d_model=8192, num_heads=128, num_kv_heads=8,
                             head_dim=256, d_ff=32768, num_experts=16, top_k=2,
                             capacity_factor=cf, vocab_size=32000, run_layers=56, run_batch=1,
                             seq=8192, mesh={"fsdp": 16, "expert": 16})
    for cf, run in ((1.0, "maxtext-custom-moe-750b-experimental-cf1.0-v6e-256"),
                    (1.5, "maxtext-custom-moe-750b-final-cf1.5-v6e-256"))}
MODELS = {**PAIR, **CAPACITY}
# Each model is compiled at its run's sequences per chip, the attention in causal blocks of
# 512 queries (`lower_moe_train(attention_block=)`: one [seq, seq] score matrix per sequence
# would not fit a chip at these batches).
ATTENTION_BLOCK = 512
# Compiled again with libtpu flags (`LIBTPU_INIT_ARGS`), as "<model>+<variant>": "vmem96m",
# the scoped-VMEM limit of the recipes' DENSE_VMEM_LIMIT (docs/model.md: the llama2-70b
# recipe's `--xla_tpu_scoped_vmem_limit_kib=98304`; the Oct 2024 LLaMA run set it, its Mixtral
# twin recorded no flags, the Mar 2025 Mixtral recipe a MOE_VMEM_LIMIT whose value the
# reference does not record): does more VMEM make XLA price the matmuls differently?
VARIANTS = {"vmem96m": "--xla_tpu_scoped_vmem_limit_kib=98304"}
PROGRAMS = tuple(PAIR) + tuple(f"{n}+{v}" for v in VARIANTS for n in PAIR) + tuple(CAPACITY)
# XLA's v6e clock (xla_crosscheck_programs.XLA_CLOCK_HZ says how it is derived).
CLOCK_HZ = 1.75e9

_EXPERT_EINSUMS = ("ebcm,emh->ebch", "ebch,ehm->ebcm")
_DISPATCH_EINSUMS = ("bsm,bsec->ebcm", "ebcm,bsec->bsm")
_ATTN_EINSUMS = ("bskgd,btkd->bkgst", "bkgst,btkd->bskgd", "bshd,bthd->bhst", "bhst,bthd->bshd")
# The classes compared, in table order.
CLASSES = ("weight matmuls", "expert matmuls", "dispatch and combine", "router and masks",
           "attention", "norms and elementwise")


def xla_class(op_name: str, matmul: str) -> str | None:
    """The class of one XLA instruction of the layer loop (None: outside the layers). A fusion
    that holds a matmul counts as that matmul; the einsum names it (`lower_moe_train`'s
    einsums, the transposes of the backward keep the forward's op_name; the weight matmuls are
    `@`, named `dot_general` alone)."""
    both = op_name + " " + matmul
    if "layer0" not in both:
        return None
    if matmul:
        # A projection's matmul can carry an op_name of the attention scope (the transpose of
        # the output projection is named after the reshape before it): the einsum decides.
        if any(e in matmul for e in _ATTN_EINSUMS):
            return "attention"
        if any(e in matmul for e in _DISPATCH_EINSUMS):
            return "dispatch and combine"
        if any(e in matmul for e in _EXPERT_EINSUMS):
            return "expert matmuls"
        return "router and masks" if "/router/" in matmul else "weight matmuls"
    if "/attention/" in op_name:
        return "attention"
    if "/router/" in op_name:
        return "router and masks"
    return "norms and elementwise"


def tpusim_class(op, moe: bool) -> str | None:
    """The same classes for one compute op of tpusim's compiled step (None: not a layer op).
    moe: the layer's MLP is routed experts (tpusim names their backward `mlp_bwd*`, as a dense
    MLP's; `workloads/moe.py`)."""
    if op.layer < 0:
        return None
    name = op.name[3:] if op.name.startswith("re-") else op.name
    if name.startswith(("attn_proj", "qkv_proj", "out_proj")):
        return "weight matmuls"
    if name.startswith(("attn", "attention", "softmax", "flash")):
        return "attention"
    if name.startswith(("moe_dispatch", "moe_combine")):
        return "dispatch and combine"
    if name.startswith(("router", "topk_route", "moe_masks")):
        return "router and masks"
    if op.unit != "mxu":
        return "norms and elementwise"
    if name.startswith("expert_") or (moe and name.startswith("mlp_")):
        return "expert matmuls"
    return "weight matmuls"


# --------------------------------------------------------------------------------------------
# XLA worker (runs under the jax python)
# --------------------------------------------------------------------------------------------

def _worker(program: str, dump: str | None) -> None:
    name, _, variant = program.partition("+")
    if variant:  # read when libtpu loads (`build_mesh`)
        os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "") + " "
                                          + VARIANTS[variant]).strip()
    xla_compile.init_jax()
    p = MODELS[name]
    mesh, _ = xla_compile.build_mesh(TOPOLOGY, p.get("mesh", MESH))
    t0 = time.time()
    lowered = xla_compile.lower_moe_train(
        mesh, d_model=p["d_model"], d_ff=p["d_ff"], num_experts=p["num_experts"],
        top_k=p["top_k"], capacity_factor=p["capacity_factor"], seq=p.get("seq", SEQ),
        num_heads=p["num_heads"], head_dim=p["head_dim"], num_kv_heads=p["num_kv_heads"],
        num_layers=LAYERS, vocab_size=p["vocab_size"], scopes=True, final_norm=True,
        router="maxtext", batch_per_chip=p["run_batch"], attention_block=ATTENTION_BLOCK)
    compiled = lowered.compile()
    text = compiled.as_text()
    Path(dump).mkdir(parents=True, exist_ok=True)
    Path(dump, _hlo_file(program)).write_text(text)
    xla_compile.emit({"program": program, "compile_s": round(time.time() - t0, 1),
                      **xla_compile.memory_stats(compiled)})


def _hlo_file(program: str) -> str:
    return program.replace("/", "-") + ".hlo.txt"


# --------------------------------------------------------------------------------------------
# the comparison (project python)
# --------------------------------------------------------------------------------------------

def matmul_flops(text: str) -> dict[str, list[tuple[str, float]]]:
    """Instruction name -> the matmuls it executes, each as (its op_name, MXU FLOPs per
    execution), for every fusion, convolution and dot of the module that does matmul work
    (nested fusions included); FLOPs as `tpusim import-hlo` counts them (docs/hlo.md)."""
    return _matmul_flops(parse_hlo(text, source="XLA module"))


def _matmul_flops(m: HloModule) -> dict[str, list[tuple[str, float]]]:

    def shape(comp, name):
        ins = comp.by_name.get(name)
        return ins.shape if ins is not None else m.shapes[name]

    def dots(comp, ins, depth: int = 0) -> list[tuple[str, float]]:
        if ins.opcode == "dot":
            lhs = shape(comp, ins.operands[0])
            k = 1
            for dim in dot_dims(ins)["lhs_contracting_dims"]:
                k *= lhs.dims[dim]
            return [(op_name(ins) or "?", 2.0 * ins.shape.num_elements * k)]
        if ins.opcode == "convolution":
            return [(op_name(ins) or "?", conv_flops(
                shape(comp, ins.operands[0]), shape(comp, ins.operands[1]), ins.shape,
                ins.attrs.get("dim_labels", ""), ins.attrs.get("window", "")))]
        if ins.opcode == "fusion" and depth < 16:
            return [d for c in ins.called() if c in m.computations
                    for i2 in m.computations[c].instructions
                    for d in dots(m.computations[c], i2, depth + 1)]
        return []

    out = {}
    for comp in m.computations.values():
        for ins in comp.instructions:
            if ins.opcode in ("dot", "convolution", "fusion"):
                d = [x for x in dots(comp, ins) if x[1] > 0]
                if d:
                    out[ins.name] = d
    return out


def hlo_costs(text: str) -> list[dict]:
    """XLA's estimated cycles and the MXU FLOPs of every instruction of the module, loop trip
    counts applied, summed per (op_name, the op_name of a matmul in it or ""): `xla_class`
    reads the class off the two names. A fusion of several matmuls (XLA fuses a projection
    with an attention einsum) is split among them in proportion to their FLOPs."""
    module = parse_hlo(text, source="XLA module")
    comps = module.computations
    mm = _matmul_flops(module)
    acc: dict[tuple[str, str], list[float]] = {}

    def visit(comp: str, mult: int, seen: tuple) -> None:
        if comp in seen or comp not in comps:
            return
        for ins in comps[comp].instructions:
            cyc = estimated_cycles(ins)
            cycles = cyc * mult if cyc is not None else 0
            parts = mm.get(ins.name, [])
            total = sum(f for _, f in parts)
            for name, f in parts or [("", 0.0)]:
                if not (cycles or f):
                    continue
                a = acc.setdefault((op_name(ins), name), [0.0, 0.0])
                a[0] += cycles * (f / total if total else 1.0)
                a[1] += f * mult
            body = ins.attrs.get("body", "").lstrip("%")
            if ins.opcode == "while" and body:
                visit(body, mult * trip_count(module, ins), seen + (comp,))
            elif ins.opcode in ("call", "conditional", "async-start"):
                for c in ins.called():
                    visit(c, mult, seen + (comp,))

    visit(module.entry, 1, ())
    return [{"op_name": k[0], "matmul": k[1], "cycles": round(v[0]), "flops": v[1]}
            for k, v in sorted(acc.items())]


def layer_classes(costs: list[dict]) -> dict[str, dict[str, float]]:
    """Per class of the layer loops (`hlo_costs` rows; instructions outside the layers left
    out): cycles and MXU FLOPs, in all and split into the forward loop ("_forward") and the
    backward one ("_backward", which holds the recomputation: `rematted_computation`)."""
    acc: dict[str, dict[str, float]] = collections.defaultdict(
        lambda: collections.defaultdict(float))
    for c in costs:
        cls = xla_class(c["op_name"], c["matmul"])
        if cls is None:
            continue
        loop = "backward" if "transpose(" in c["op_name"] + c["matmul"] else "forward"
        a = acc[cls]
        for key in ("cycles", "flops"):
            a[key] += c[key]
            a[f"{key}_{loop}"] += c[key]
            if "rematted_computation" in c["op_name"] + c["matmul"]:
                a[f"{key}_recompute"] += c[key]
    return {k: dict(v) for k, v in acc.items()}


def compile_one(name: str, jax_python: str, dump: str | None) -> dict:
    """The XLA side of one program: the worker's result and `layer_classes` of its module."""
    with tempfile.TemporaryDirectory() as tmp:
        where = dump or tmp
        t0 = time.time()
        xr = xla_compile.run_worker("validation.xla_moe_pair", name, jax_python, ["--dump", where])
        xr["wall_s"] = round(time.time() - t0, 1)
        xr["costs"] = hlo_costs(Path(where, _hlo_file(name)).read_text())
    return xr


def tpusim_classes(run_id: str) -> dict:
    """tpusim's side of a run as validated (`validation.maxtext_runs`: its batch, layers, flash
    attention, flags): per class the summed cost of its layer ops alone on the chip
    (`sim.engine.costs.compute_op_times`, the per-op overhead added) and their MXU FLOPs, the
    replay's step time, and the summed cost of every compute op."""
    case = next(c for c in maxtext_runs.load_cases()[0] if c.id == run_id)
    trace, topo = maxtext_runs.case_trace(case)
    chip = get_chip(case.chip)
    moe = case.capacity_factor is not None
    acc: dict[str, dict[str, float]] = collections.defaultdict(
        lambda: collections.defaultdict(float))
    compute = 0.0
    for op in trace.ops:
        if op.kind != OpKind.COMPUTE:
            continue
        t = max(compute_op_times(chip, op)) + chip.op_overhead_s
        compute += t
        cls = tpusim_class(op, moe)
        if cls is None:
            continue
        f = op.flops if op.unit == "mxu" else 0.0
        # XLA's backward loop holds the recomputation: tpusim's `re-` ops count there too.
        loop = "forward" if op.phase == "fwd" and not op.name.startswith("re-") else "backward"
        acc[cls]["s"] += t
        acc[cls]["flops"] += f
        acc[cls][f"flops_{loop}"] += f
        if op.name.startswith("re-"):
            acc[cls]["flops_recompute"] += f
    res = simulate_step(trace, chip, topo, executor=Executor.REPRESENTATIVE)
    return {"classes": {k: dict(x) for k, x in acc.items()}, "step_s": res.step_time_s,
            "compute_s": compute, "measured_s": case.measured_step_s,
            "mxu_efficiency": chip.mxu_efficiency}


def pair_rows(cache: dict) -> dict:
    """The comparison, from the cache and tpusim's replays: per model, per class, XLA's and
    tpusim's seconds and MXU GFLOP per layer at the run's batch; the layers' totals per step
    (x the run's layers); tpusim's step, the measured one, and the step with XLA's layer
    estimate in place of tpusim's layer costs, scaled by one factor (`k`: the dense run's
    tpusim / XLA layer ratio) so the dense run keeps its error (`step_xla_s`; `_noattn`: the
    same with the attention class left at tpusim's flash-attention costs, as XLA's program
    computes plain dot attention)."""
    out = {}
    for name, p in PAIR.items():
        if name not in cache:
            continue
        xc_all = layer_classes(cache[name]["costs"])
        t = tpusim_classes(p["run"])
        L = p["run_layers"]
        rows = {}
        for cls in CLASSES:
            tc = t["classes"].get(cls, {})
            xc = xc_all.get(cls, {})
            rows[cls] = {"xla_s": xc.get("cycles", 0.0) / CLOCK_HZ / LAYERS,
                         "tpusim_s": tc.get("s", 0.0) / L}
            # MXU GFLOP per layer: in all, the forward pass, the recomputation, the rest of
            # the backward pass.
            for side, d, n in (("xla", xc, LAYERS), ("tpusim", tc, L)):
                rec = d.get("flops_recompute", 0.0)
                rows[cls][f"{side}_gflop"] = d.get("flops", 0.0) / 1e9 / n
                rows[cls][f"{side}_gflop_split"] = tuple(
                    v / 1e9 / n for v in (d.get("flops_forward", 0.0), rec,
                                          d.get("flops_backward", 0.0) - rec))
        na = [c for c in CLASSES if c != "attention"]
        out[name] = {"run": p["run"], "rows": rows,
                     "xla_layers_s": sum(r["xla_s"] for r in rows.values()) * L,
                     "tpusim_layers_s": sum(r["tpusim_s"] for r in rows.values()) * L,
                     "xla_layers_noattn_s": sum(rows[c]["xla_s"] for c in na) * L,
                     "tpusim_layers_noattn_s": sum(rows[c]["tpusim_s"] for c in na) * L,
                     "step_s": t["step_s"], "measured_s": t["measured_s"]}
        o = out[name]
        # The measured step less what tpusim predicts besides the layers' compute (exposed
        # communication, embedding, head, optimizer) and less its flash attention: the
        # measured time of the layers' other compute, if tpusim is right about the rest.
        o["measured_layers_noattn_s"] = (o["measured_s"] - o["step_s"]
                                         + o["tpusim_layers_noattn_s"])
    dense = out.get("llama2-70b")
    if dense:
        for suffix in ("", "_noattn"):
            key, tkey = f"xla_layers{suffix}_s", f"tpusim_layers{suffix}_s"
            k = dense[tkey] / dense[key]
            for r in out.values():
                r["k" + suffix] = k
                r[f"step_xla{suffix}_s"] = r["step_s"] - r[tkey] + k * r[key]
    return out


def render(out: dict) -> list[str]:
    """Markdown lines of the comparison (a table per class and a summary per run)."""
    names = list(out)
    lines = ["| class (per layer, the run's batch) | " + " | ".join(
        f"{n} XLA ms | {n} tpusim ms | tpusim / XLA" for n in names) + " |",
        "|---|" + "---:|---:|---:|" * len(names)]
    for cls in CLASSES:
        cells = []
        for n in names:
            r = out[n]["rows"][cls]
            ratio = f"{r['tpusim_s'] / r['xla_s']:.2f}" if r["xla_s"] else "-"
            cells += [f"{1e3 * r['xla_s']:.2f}", f"{1e3 * r['tpusim_s']:.2f}", ratio]
        lines.append(f"| {cls} | " + " | ".join(cells) + " |")
    cells = []
    for n in names:
        o = out[n]
        per = PAIR[n]["run_layers"]
        cells += [f"**{1e3 * o['xla_layers_s'] / per:.2f}**",
                  f"**{1e3 * o['tpusim_layers_s'] / per:.2f}**",
                  f"**{o['tpusim_layers_s'] / o['xla_layers_s']:.2f}**"]
    lines.append("| **layer, all classes** | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("| MXU TFLOP per layer: forward / recomputed / backward | " + " | ".join(
        f"{n} XLA | {n} tpusim" for n in names) + " |")
    lines.append("|---|" + "---:|---:|" * len(names))
    for cls in CLASSES:
        cells = []
        for n in names:
            r = out[n]["rows"][cls]
            cells += [" / ".join(f"{v / 1e3:.1f}" for v in r[f"{side}_gflop_split"])
                      for side in ("xla", "tpusim")]
        if any(c != "0.0 / 0.0 / 0.0" for c in cells):
            lines.append(f"| {cls} | " + " | ".join(cells) + " |")
    return lines


def variant_rows(cache: dict) -> dict:
    """variant -> model -> class (and "layer but attention") -> XLA's estimated cycles per
    layer with the variant's flags over those without (only the pairs both in the cache)."""
    out: dict = {}
    for v in VARIANTS:
        for name in PAIR:
            base, var = cache.get(name), cache.get(f"{name}+{v}")
            if not (base and var):
                continue
            b, x = layer_classes(base["costs"]), layer_classes(var["costs"])
            row = {c: x[c]["cycles"] / b[c]["cycles"] for c in CLASSES
                   if b.get(c, {}).get("cycles") and c in x}
            na = [c for c in CLASSES if c != "attention"]
            row["layer but attention"] = (sum(x.get(c, {}).get("cycles", 0.0) for c in na)
                                          / sum(b.get(c, {}).get("cycles", 0.0) for c in na))
            out.setdefault(v, {})[name] = row
    return out


def capacity_rows(cache: dict, k: float) -> dict:
    """The 750B's two capacity factors: per class, the growth per unit of capacity factor of
    the step's layer costs (x 56 layers), XLA's estimate (times `k`, the dense run's tpusim /
    XLA ratio, so both sides are in the units that make the LLaMA exact) and tpusim's; and the
    step's growth, predicted and measured ({} without both programs)."""
    names = list(CAPACITY)
    if not all(n in cache for n in names):
        return {}
    lo, hi = (CAPACITY[n] for n in names)
    dcf = hi["capacity_factor"] - lo["capacity_factor"]
    L = lo["run_layers"]
    x = [layer_classes(cache[n]["costs"]) for n in names]
    t = [tpusim_classes(CAPACITY[n]["run"]) for n in names]
    rows = {}
    for cls in CLASSES:
        xs = [c.get(cls, {}).get("cycles", 0.0) / CLOCK_HZ / LAYERS * L for c in x]
        ts = [c["classes"].get(cls, {}).get("s", 0.0) for c in t]
        rows[cls] = {"xla": k * (xs[1] - xs[0]) / dcf, "tpusim": (ts[1] - ts[0]) / dcf}
    return {"rows": rows, "k": k,
            "step_tpusim": (t[1]["step_s"] - t[0]["step_s"]) / dcf,
            "step_measured": (t[1]["measured_s"] - t[0]["measured_s"]) / dcf}


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def render_section(cache: dict) -> str:
    """docs/validation.md's section on the pair ("" without both programs in the cache)."""
    out = pair_rows(cache)
    if set(out) != set(PAIR):
        return ""
    d, m = out["llama2-70b"], out["mixtral-8x7b"]
    peak = get_chip("v6e").mxu_flops_per_s

    def eff(o, cls):
        r = o["rows"][cls]
        return r["xla_gflop"] * 1e9 / r["xla_s"] / peak

    def ratio(o, side):
        return o[f"{side}_layers_noattn_s"] / o["measured_layers_noattn_s"]

    lines = [
        "_From `validation/xla_moe_pair.py` (its cache: `validation/results/xla_moe_pair.json`; "
        "effect 3 above)._\n",
        "Two runs of the same month of tpu-recipes (Oct 2024, libtpu 20241028), mesh "
        "(fsdp=256 on a v6e 16x16), remat (`full`) and sequence (4096), one dense and one "
        f"MoE: {d['run']} ({PAIR['llama2-70b']['run_batch']} sequences per chip, tpusim "
        f"{_pct(d['step_s'] / d['measured_s'] - 1)}) and {m['run']} "
        f"({PAIR['mixtral-8x7b']['run_batch']} sequences, capacity factor 1.25, dense one-hot "
        f"dispatch; tpusim {_pct(m['step_s'] / m['measured_s'] - 1)}). Each is compiled "
        "deviceless (jax/libtpu 0.10.2) by the same decoder code "
        "(`xla_compile.lower_moe_train`: GQA, 2 scanned layers under "
        "`jax.checkpoint(nothing_saveable)`, the Mixtral's routing and "
        "masks as MaxText builds them, the LLaMA's MLP a dense SwiGLU in its place) at the "
        "run's own widths, mesh and sequences per chip, the attention causal in blocks of "
        f"{ATTENTION_BLOCK} queries (one [4096, 4096] f32 score matrix per sequence would not "
        "fit a chip at these batches). XLA's `estimated_cycles` of every instruction of the "
        "layer loops (trip counts applied, a fusion of several matmuls split among them by "
        "FLOPs) are summed per class per layer at 1.75 GHz, against tpusim's ops of the same "
        "class in the run as validated (each alone on the chip, flash attention):\n",
        *render(out), "",
        "* **Attention is not comparable**: XLA's program computes blocked dot attention "
        "with f32 scores through HBM, the runs a flash kernel, as tpusim prices it; it is "
        "left out below (the same in both runs: 32 x 128 and 64 x 128 query heads of 8 "
        "KV heads).",
        "* **XLA's model prices the MoE no cheaper than the dense model.** At 1.75 GHz it "
        f"puts the LLaMA's weight matmuls at {100 * eff(d, 'weight matmuls'):.0f}% of the "
        f"918 TFLOP/s peak, the Mixtral's expert matmuls at "
        f"{100 * eff(m, 'expert matmuls'):.0f}%, its dispatch and combine einsums at "
        f"{100 * eff(m, 'dispatch and combine'):.0f}% (tpusim: 65% for all of them). The "
        "layers' compute but attention, per step: XLA "
        f"{d['xla_layers_noattn_s']:.2f} s (LLaMA) and {m['xla_layers_noattn_s']:.2f} s "
        f"(Mixtral), tpusim {d['tpusim_layers_noattn_s']:.2f} s and "
        f"{m['tpusim_layers_noattn_s']:.2f} s, against the measured step less everything "
        "else tpusim predicts (exposed communication, embedding, head, optimizer, flash "
        f"attention) {d['measured_layers_noattn_s']:.2f} s and "
        f"{m['measured_layers_noattn_s']:.2f} s: XLA / measured {ratio(d, 'xla'):.3f} and "
        f"{ratio(m, 'xla'):.3f}, tpusim / measured {ratio(d, 'tpusim'):.3f} and "
        f"{ratio(m, 'tpusim'):.3f}. With XLA's estimates in place of tpusim's layer costs "
        f"(attention kept at tpusim's), scaled by one factor ({m['k_noattn']:.3f}) so that "
        "the LLaMA keeps its error, the Mixtral step would be "
        f"{m['step_xla_noattn_s']:.2f} s ({_pct(m['step_xla_noattn_s'] / m['measured_s'] - 1)}"
        f"; tpusim {_pct(m['step_s'] / m['measured_s'] - 1)}). XLA's static model shares "
        "tpusim's error on the MoE and adds to it: no class of the MoE layer is priced by "
        "tpusim above what XLA's own model of the compiled program gives it relative to "
        "the dense layer. What made the measured Mixtral layers faster lies outside both "
        "static models: the hardware's efficiency at these shapes at run time, or a "
        "program the Oct 2024 compiler built differently from today's.",
        "* **What full remat recomputes.** Per class the compiled program's MXU FLOPs, "
        "forward / recomputed (XLA's `rematted_computation`) / the rest of the backward, "
        "are tpusim's to the GFLOP but for attention: the expert matmuls all three, the output "
        "projection included (its result feeds the combine weights' gradient), the "
        "dispatch einsum recomputed but not the combine (the layer's last matmul), the "
        "attention projections all four in both models, the LLaMA's MLP but its down "
        "projection (its last matmul). The Mixtral's elementwise row holds one copy XLA "
        "adds per layer, a relayout of the gathered expert down projections "
        "(bf16[8, 14336, 4096], 9.3 M cycles, 5.3 ms, in the forward loop).",
    ]
    cap = capacity_rows(cache, m["k_noattn"])
    if cap:
        na = [c for c in CLASSES if c != "attention"]
        xs = sum(cap["rows"][c]["xla"] for c in na)
        ts = sum(cap["rows"][c]["tpusim"] for c in na)
        lines.append(
            "* **What grows with the capacity, in XLA's model.** The custom 750B's two runs "
            "(capacity factor 1.0 and 1.5, otherwise alike) compiled the same way at their own "
            "sizes (d_model 8192, 128 query heads of 256, 16 experts of d_ff 32768, seq 8192, "
            "one sequence per chip, fsdp=16 x expert=16): per unit of capacity factor the "
            "step's layer compute but attention (56 layers) grows by "
            f"{xs:.2f} s in XLA's estimate (times the LLaMA's factor {cap['k']:.3f}) and "
            f"{ts:.2f} s in tpusim's ops (" + ", ".join(
                f"{c} {cap['rows'][c]['xla']:.2f} / {cap['rows'][c]['tpusim']:.2f} s"
                for c in na if cap["rows"][c]["xla"] or cap["rows"][c]["tpusim"])
            + "); the whole step: tpusim "
            f"{cap['step_tpusim']:.2f} s, measured {cap['step_measured']:.2f} s per unit.")
    for v, models in variant_rows(cache).items():
        mm = [r for row in models.values() for c, r in row.items()
              if c in ("weight matmuls", "expert matmuls", "dispatch and combine")]
        lines.append(
            f"* **With the recipes' scoped-VMEM limit** (`{VARIANTS[v]}`, DENSE_VMEM_LIMIT; "
            "the Oct 2024 LLaMA run set it, its Mixtral twin recorded no flags, the Mar 2025 "
            "Mixtral recipe sets a MOE_VMEM_LIMIT of unrecorded value): XLA's estimated "
            "cycles per layer, with the flag over without: " + "; ".join(
                f"{n} " + ", ".join(f"{c} {r:.3f}" for c, r in row.items())
                for n, row in models.items()) + "." + (
                " XLA / measured for the layers' compute but attention, the flag on both: "
                f"{ratio(d, 'xla') * models['llama2-70b']['layer but attention']:.3f} "
                f"(LLaMA) and {ratio(m, 'xla') * models['mixtral-8x7b']['layer but attention']:.3f}"
                " (Mixtral); on the LLaMA alone, as the reference records the runs' flags: "
                f"{ratio(d, 'xla') * models['llama2-70b']['layer but attention']:.3f} and "
                f"{ratio(m, 'xla'):.3f}. The flag lowers XLA's estimate of every matmul "
                f"class by {100 * (1 - max(mm)):.0f}-{100 * (1 - min(mm)):.0f}% and leaves "
                "the MoE where it was against the dense model."
                if len(models) == 2 else ""))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=PROGRAMS, help=argparse.SUPPRESS)
    ap.add_argument("--dump", help="write each compiled HLO text into this directory")
    ap.add_argument("--jax-python", default=xla_compile.DEFAULT_JAX_PYTHON)
    ap.add_argument("--no-compile", action="store_true", help="use the cache only")
    ap.add_argument("--recompile", action="store_true", help="compile every program again")
    ap.add_argument("--reparse", metavar="DIR",
                    help="re-read the cached programs' costs from an earlier --dump DIR")
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.dump)
        return 0
    if args.reparse:
        cache = xla_compile.load_cache(CACHE)
        for name in cache:
            cache[name]["costs"] = hlo_costs(Path(args.reparse, _hlo_file(name)).read_text())
        xla_compile.write_cache(CACHE, cache, compact=True)
    elif args.no_compile or not xla_compile.have_jax(args.jax_python):
        if not args.no_compile:
            print(f"no jax[tpu] python at {args.jax_python}: using the cache only")
        cache = xla_compile.load_cache(CACHE)
    else:
        # One compile at a time: each takes minutes and gigabytes.
        cache = xla_compile.compile_into_cache(
            PROGRAMS, CACHE, lambda n: compile_one(n, args.jax_python, args.dump),
            recompile=args.recompile, compact=True)
    out = pair_rows(cache)
    print("\n".join(render(out)))
    for n, o in out.items():
        m = o["measured_layers_noattn_s"]
        print(f"{n}: layers' compute but attention, per step: XLA {o['xla_layers_noattn_s']:.3f}"
              f" s, tpusim {o['tpusim_layers_noattn_s']:.3f} s, measured {m:.3f} s (the step "
              f"less tpusim's other costs): XLA / measured {o['xla_layers_noattn_s'] / m:.3f}, "
              f"tpusim / measured {o['tpusim_layers_noattn_s'] / m:.3f}")
        print(f"{n}: measured {o['measured_s']:.3f} s, tpusim {o['step_s']:.3f} s "
              f"({100 * (o['step_s'] / o['measured_s'] - 1):+.1f}%); layers per step: XLA "
              f"{o['xla_layers_s']:.3f} s, tpusim {o['tpusim_layers_s']:.3f} s; with XLA's "
              f"layer estimate x {o.get('k', float('nan')):.3f}: {o.get('step_xla_s', 0):.3f} s "
              f"({100 * (o.get('step_xla_s', 0) / o['measured_s'] - 1):+.1f}%); attention "
              f"left out of the scaling: {o.get('step_xla_noattn_s', 0):.3f} s "
              f"({100 * (o.get('step_xla_noattn_s', 0) / o['measured_s'] - 1):+.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
