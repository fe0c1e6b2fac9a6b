"""The two sides of the XLA cross-check, program by program: tpusim's collectives and dot
FLOPs of the same step, XLA's (run under the jax python, or re-read from a dump), fusion and
gather-form statistics of a dump, and the side-by-side tables `--analyze` and `--forms` print.
"""

from __future__ import annotations

import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from sim.chips import get_chip
from topologies.slices import resolve_topology
from validation import xla_compile
from validation.xla_crosscheck_programs import (
    ALL_PROGRAMS,
    CONFIGS,
    DIMS,
    REPO,
    XLA_CLOCK_HZ,
    named_dims,
)
from validation.xla_hlo_read import estimated_cycles, parse_hlo_collectives, parse_hlo_costs
from workloads.hlo.costs import conv_flops
from workloads.hlo.lower import import_hlo
from workloads.hlo.parser import (
    dot_dims,
    parse_hlo,
)
from workloads.trace import OpKind

# --------------------------------------------------------------------------------------------
# tpusim side and comparison (runs under the project python)
# --------------------------------------------------------------------------------------------

def dims_override(cfg: dict) -> dict:
    """The model widths a configuration changes from LLaMA-3-8B's (`dims`)."""
    dims = cfg.get("dims")
    if dims is None:
        return {}
    dims = named_dims(dims)
    return {k: v for k, v in dims.items() if DIMS.get(k) != v}


def _chip_and_shape(cfg: dict) -> tuple[str, str]:
    """The chip name and torus shape of a configuration's `topology` ("v5e:4x4")."""
    chip_name, shape = cfg["topology"].split(":")
    return chip_name, shape


def _tpusim_pod(cfg: dict) -> list[str]:
    """tpusim's pod flags for a configuration (derived from its `topology`)."""
    chip_name, shape = _chip_and_shape(cfg)
    return ["--chip", chip_name, "--shape", shape]


def tpusim_collectives(name: str, extra: list[str]) -> list[dict]:
    cfg = CONFIGS[name]
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp, "model.yaml")
        model.write_text(f"base: llama3-8b\nname: crosscheck\nnum_layers: {cfg['layers']}\n"
                         + "".join(f"{k}: {v}\n" for k, v in dims_override(cfg).items()))
        trace = Path(tmp, "x.trace")
        mesh = ",".join(f"{k}={v}" for k, v in cfg["mesh"].items())
        cmd = [sys.executable, "-m", "sim", "compile", "--quiet", *_tpusim_pod(cfg),
               "--model", str(model), "--seq-len", str(cfg["seq"]),
               "--batch-per-chip", str(cfg["batch_per_chip"]), "--mesh", mesh, *extra,
               "-o", str(trace)]
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"tpusim compile failed: {' '.join(cmd)}\n{r.stderr}")
        d = json.loads(trace.read_text())
    cols = d["columns"]
    out = []
    for row in d["ops"]:
        o = dict(zip(cols, row, strict=True))
        if o["kind"] != "collective":
            continue
        out.append(dict(kind=o["collective"], count=1, bytes=float(o["bytes"]),
                        layer=int(o["layer"]), phase=o["phase"], name=o["name"],
                        axes=",".join(o["mesh_axes"])))
    return out


def run_xla(name: str, jax_python: str, dump_dir: str | None) -> dict:
    """The XLA side of one program: the worker's result plus the dot FLOPs per chip that
    tpusim's HLO importer counts in the compiled module (`xla_dot_flops`)."""
    with tempfile.TemporaryDirectory() as tmp:
        where = dump_dir or tmp
        xr = xla_compile.run_worker("validation.xla_crosscheck", name, jax_python,
                                    ["--dump", where])
        xr["dot_flops"] = xla_dot_flops(name, Path(where, f"{name}.hlo.txt").read_text())
    return xr


def pod(name: str):
    """(ChipSpec, Topology) of a configuration's TPU topology."""
    chip_name, shape = _chip_and_shape(CONFIGS[name])
    chip = get_chip(chip_name)
    return chip, resolve_topology(chip_name=chip.name, wrap_rule=chip.generation_rule,
                                  max_pod_shape=chip.max_pod_shape, shape=shape)


def xla_dot_flops(name: str, hlo: str) -> float:
    """MXU FLOPs per chip of a compiled module, as `tpusim import-hlo` counts them (every
    convolution and dot, times its loop trip counts; docs/hlo.md)."""
    trace = import_hlo(hlo, topology=pod(name)[1], source=name).trace
    return float(sum(o.flops for o in trace.ops if o.kind == OpKind.COMPUTE and o.unit == "mxu"))


def hlo_fusion_stats(text: str) -> dict:
    """What XLA's cost model assumes per cycle, read off one compiled module (`--analyze`):
    the fastest matmul fusion (MXU FLOPs of its convolutions and dots, nested fusions
    included, over its `estimated_cycles`: `mxu_flops_per_cycle`, `mxu_fusion`), and the
    non-matmul fusions of the windowed reduce-scatter loops (the ring accumulators): their
    operand and result bytes and estimated cycles summed over the instructions (not weighted
    by trip counts: `accum_bytes`, `accum_cycles`) and those of the one moving the most bytes
    (`accum_max`: [bytes, cycles])."""
    m = parse_hlo(text, source="XLA module")

    def shape(comp, name):
        ins = comp.by_name.get(name)
        return ins.shape if ins is not None else m.shapes[name]

    def flops(cname: str, depth: int = 0) -> float:
        comp = m.computations.get(cname)
        if comp is None or depth > 16:
            return 0.0
        total = 0.0
        for ins in comp.instructions:
            if ins.opcode == "dot":
                lhs = shape(comp, ins.operands[0])
                k = 1
                for dim in dot_dims(ins)["lhs_contracting_dims"]:
                    k *= lhs.dims[dim]
                total += 2.0 * ins.shape.num_elements * k
            elif ins.opcode == "convolution":
                total += conv_flops(shape(comp, ins.operands[0]), shape(comp, ins.operands[1]),
                                    ins.shape, ins.attrs.get("dim_labels", ""),
                                    ins.attrs.get("window", ""))
            elif ins.opcode == "fusion":
                total += sum(flops(c, depth + 1) for c in ins.called())
        return total

    best = (0.0, "")
    acc_bytes = acc_cycles = 0
    acc_max = [0, 0]
    for comp in m.computations.values():
        rs_loop = "windowed_dot_general_body_rs" in comp.name
        for ins in comp.instructions:
            cycles = estimated_cycles(ins)
            if ins.opcode != "fusion" or not cycles:
                continue
            f = sum(flops(c) for c in ins.called())
            if f > 0:
                best = max(best, (f / cycles, ins.name))
            elif rs_loop:
                nbytes = ins.shape.nbytes + sum(shape(comp, o).nbytes for o in ins.operands)
                acc_bytes += nbytes
                acc_cycles += cycles
                if nbytes > acc_max[0]:
                    acc_max = [nbytes, cycles]
    return {"mxu_flops_per_cycle": best[0], "mxu_fusion": best[1], "accum_bytes": acc_bytes,
            "accum_cycles": acc_cycles, "accum_max": acc_max}


def analyze(dump_dir: str) -> str:
    """`--analyze DIR`: per compiled module DIR/NAME.hlo.txt of a known program, XLA's fastest
    matmul fusion against the chip's MXU peak per cycle at `XLA_CLOCK_HZ`, and the bytes its
    ring-accumulator fusions move per second at that clock against the chip's HBM bandwidth
    (the checks behind the clocks, docs/validation.md "Per-op costs")."""
    lines = []
    for name in CONFIGS:
        path = Path(dump_dir, f"{name}.hlo.txt")
        if not path.is_file():
            continue
        chip_name = _chip_and_shape(CONFIGS[name])[0]
        chip, clock = get_chip(chip_name), XLA_CLOCK_HZ[chip_name]
        st = hlo_fusion_stats(path.read_text())
        peak = chip.mxu_flops_per_s / clock
        line = (f"{name} ({chip_name} at {clock / 1e9:.3g} GHz): fastest matmul fusion "
                f"{st['mxu_fusion']} {st['mxu_flops_per_cycle']:,.0f} FLOP/cycle = "
                f"{100 * st['mxu_flops_per_cycle'] / peak:.1f}% of {peak:,.0f}")
        if st["accum_cycles"]:
            hbm = chip.hbm_bytes_per_s
            b, c = st["accum_max"]
            line += (f"; ring-accumulator fusions {st['accum_bytes'] / 1e6:,.1f} MB in "
                     f"{st['accum_cycles']:,} cycles = "
                     f"{100 * st['accum_bytes'] * clock / st['accum_cycles'] / hbm:.0f}% of HBM "
                     f"(largest: {b / 1e6:,.1f} MB in {c:,} cycles = "
                     f"{100 * b * clock / c / hbm:.0f}%)")
        lines.append(line)
    return "\n".join(lines) or f"no NAME.hlo.txt of a known program in {dump_dir}"


def gather_forms(text: str) -> dict:
    """How a compiled training step issues its weight gathers and gradient reductions: the
    windowed-einsum loops (`windowed_dot_general_body_ag` / `_rs` computations), and per layer
    (layer 1, away from the embedding and the head) the plain collectives by kind, with how
    many of the all-gathers are async; plus, over the windowed loops, how many of their
    loop-carried bf16 buffers of 16 MiB or more XLA placed in VMEM (`S(1)`) and how many in HBM.
    """
    module = parse_hlo(text, source="XLA module")
    loops = {"ag": 0, "rs": 0}
    big_vmem = big_hbm = 0
    for cname, comp in module.computations.items():
        m = re.search(r"windowed_dot_general_body_(ag|rs)", cname)
        if not m:
            continue
        loops[m.group(1)] += 1
        param = next((i for i in comp.instructions if i.opcode == "parameter"), None)
        if param is None:
            continue
        for leaf in param.shape.leaves():
            if leaf.dtype in ("bf16", "f32") and leaf.nbytes >= 16 * 2**20:
                big_vmem += "S(1)" in leaf.layout
                big_hbm += "S(1)" not in leaf.layout
    per_layer: dict[str, int] = collections.Counter()
    for op in parse_hlo_collectives(text):
        if op["layer"] != 1 or op["in_loop"]:
            continue
        kind = op["kind"]
        per_layer[kind] += op["count"]
        if kind == "all-gather" and op["async_"]:
            per_layer["async all-gather"] += op["count"]
    return {"windowed_ag": loops["ag"], "windowed_rs": loops["rs"],
            "layer1": dict(sorted(per_layer.items())), "big_loop_buffers_vmem": big_vmem,
            "big_loop_buffers_hbm": big_hbm}


def forms(dump_dir: str) -> str:
    """`--forms DIR`: `gather_forms` of each known program compiled into DIR/NAME.hlo.txt."""
    lines = []
    for name, cfg in ALL_PROGRAMS.items():
        path = Path(dump_dir, f"{name}.hlo.txt")
        if not path.is_file() or cfg["mode"] != "train":
            continue
        dims = cfg.get("dims", DIMS)
        dims = named_dims(dims)
        n = cfg["mesh"].get("fsdp", 1)
        f = gather_forms(path.read_text())
        lines.append(f"{name} ({cfg['topology']}, mesh {cfg['mesh']}, d_model {dims['d_model']}"
                     f" = {dims['d_model'] // n} rows per fsdp shard, "
                     f"{cfg['batch_per_chip'] * cfg['seq']:g} tokens per chip): windowed "
                     f"loops in the step {f['windowed_ag']} gathers + {f['windowed_rs']} "
                     f"reduce-scatters; layer 1 "
                     f"outside them: {f['layer1'] or 'nothing'}; loop buffers >= 16 MiB in "
                     f"VMEM {f['big_loop_buffers_vmem']}, in HBM {f['big_loop_buffers_hbm']}")
    return "\n".join(lines) or f"no NAME.hlo.txt of a known training program in {dump_dir}"


def reparse(name: str, xr: dict, hlo: str) -> dict:
    """A cached XLA side with every field read from the HLO text recomputed from `hlo` (the
    module the worker compiled, kept by `--dump`): collectives, op costs, dot FLOPs."""
    return {**xr, "ops": parse_hlo_collectives(hlo), "op_costs": parse_hlo_costs(hlo),
            "dot_flops": xla_dot_flops(name, hlo)}


def _layer_label(layer: int) -> str:
    return f"L{layer}" if layer >= 0 else "top"


def summarize(ops: list[dict], xla: bool) -> dict:
    """(layer, phase, kind+flavour) -> [count, bytes]"""
    acc: dict = collections.defaultdict(lambda: [0, 0.0])
    for o in ops:
        kind = o["kind"]
        if xla:
            flav = (o["loop"].split(":")[0] if o["in_loop"] else
                    ("async" if o["async_"] else "sync"))
            kind = f"{kind} ({flav})"
        key = (_layer_label(o["layer"]), o["phase"], kind)
        acc[key][0] += o["count"]
        acc[key][1] += o["count"] * o["bytes"]
    return acc


def fmt_bytes(b: float) -> str:
    if b == 0:
        return "-"
    for unit, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= s:
            return f"{b / s:.1f}{unit}"
    return f"{b:.0f}B"


def print_table(title: str, acc: dict) -> None:
    print(f"\n{title}")
    print(f"  {'layer':5} {'phase':5} {'collective':34} {'count':>6} {'total bytes':>12}")
    for key in sorted(acc, key=lambda k: (k[0] == "top", k[0], k[1], k[2])):
        c, b = acc[key]
        print(f"  {key[0]:5} {key[1]:5} {key[2]:34} {c:6d} {fmt_bytes(b):>12}")


def print_side_by_side(sim: dict, xla: dict) -> None:
    """Per layer and collective base kind: tpusim count/bytes vs XLA count/bytes."""
    def by_kind(acc):
        out = collections.defaultdict(lambda: [0, 0.0])
        for (layer, _phase, kind), (c, b) in acc.items():
            out[(layer, kind.split(" (")[0])][0] += c
            out[(layer, kind.split(" (")[0])][1] += b
        return out
    s, x = by_kind(sim), by_kind(xla)
    print(f"  {'layer':5} {'collective':20} {'tpusim n':>9} {'tpusim V':>10} "
          f"{'XLA n':>7} {'XLA bytes':>10}")
    for key in sorted(set(s) | set(x), key=lambda k: (k[0] == "top", k)):
        sc, sb = s.get(key, (0, 0.0))
        xc, xb = x.get(key, (0, 0.0))
        print(f"  {key[0]:5} {key[1]:20} {sc:9d} {fmt_bytes(sb):>10} {xc:7d} {fmt_bytes(xb):>10}")


