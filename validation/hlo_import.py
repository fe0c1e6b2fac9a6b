"""Imported XLA programs against tpusim's own compiled steps for the same model and mesh: dot
FLOPs, collective bytes by kind and physical axis, step time. Writes the HLO section of
docs/validation.md (`--write`: between its `<!-- hlo-import -->` and `<!-- /hlo-import -->`
markers; `python -m validation.check` says whether it is current).

Run: .venv/bin/python -m validation.hlo_import [--write]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
from pathlib import Path

from sim.chips import get_chip
from sim.engine.costs import collective_groups
from sim.engine.executors import Executor, simulate_step
from topologies.mesh import parse_mesh
from topologies.slices import resolve_topology
from validation import xla_compile
from validation.template import splice
from workloads.hlo.lower import collective_axes_label, import_hlo
from workloads.trace import OpKind
from workloads.training import Remat, TrainingConfig, compile_training_step
from workloads.zoo import model_from_dict

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "hlo"
DOC = ROOT / "docs" / "validation.md"
MARKER, END = "<!-- hlo-import -->", "<!-- /hlo-import -->"
POD = {"v5e:4x4": ("v5e", "4x4"), "v5e:2x4": ("v5e", "2x4"), "v5p:4x4x4": ("v5p", "4x4x4")}
TRAIN = ["train_fsdp_v5e16", "train_fsdp_tp_v5e16", "train_fsdp_v5p64", "train_fsdp_tp_v5p64",
         "scan_fsdp_v5e16"]


def load(name: str):
    text = gzip.open(FIXTURES / f"{name}.hlo.txt.gz", "rt").read()
    cfg = json.loads(re.search(r"^// tpusim: config=(.*)$", text, re.M).group(1))
    chip_name, shape = POD[cfg["topology"]]
    chip = get_chip(chip_name)
    topo = resolve_topology(chip_name=chip.name, wrap_rule=chip.generation_rule,
                            max_pod_shape=chip.max_pod_shape, shape=shape)
    return text, cfg, chip, topo


def summarize_trace(trace, topo, imported: bool) -> tuple[float, dict]:
    dot = sum(o.flops for o in trace.ops if o.kind == OpKind.COMPUTE and o.unit == "mxu")
    by: dict = collections.defaultdict(lambda: [0, 0.0])
    groups = None if imported else collective_groups(trace, topo)
    for o in trace.ops:
        if o.kind != OpKind.COLLECTIVE:
            continue
        if imported:
            axes = collective_axes_label(trace.meta.device_groups, o.group, topo)
        else:
            axes = ",".join(g.name for a in o.mesh_axes for g in groups[a])
        by[(o.collective, axes)][0] += 1
        by[(o.collective, axes)][1] += o.bytes
    return dot, by


def variants(cfg: dict) -> list[tuple[str, dict]]:
    v5e = cfg["topology"].startswith("v5e")
    out = [("defaults", {})]
    out.append(("fsdp-gather windowed" if v5e else "fsdp-gather blocking",
                {"fsdp_gather": "windowed" if v5e else "blocking"}))
    if "tensor" in cfg["mesh"]:
        out.append(("tp-activations replicated", {"tp_activations": "replicated",
                                                  "fsdp_gather": "windowed" if v5e
                                                  else "blocking"}))
    return out


def mib(b: float) -> str:
    return f"{b / 2**20:.1f}"


def fixture_lines(name: str) -> list[str]:
    """One fixture's heading and table: the imported program's replay against tpusim's own
    compiled steps of the same model and mesh (the section's rows, and the suite's guard)."""
    text, cfg, chip, topo = load(name)
    imp = import_hlo(text, topology=topo, source=name)
    res = simulate_step(imp.trace, chip, topo, executor=Executor.REPRESENTATIVE)
    idot, iby = summarize_trace(imp.trace, topo, True)
    model = model_from_dict(xla_compile.tpusim_model_dict(
        {k: cfg[k] for k in xla_compile.DIM_KEYS}, cfg["num_layers"], name, base="llama3-8b"))
    mesh = parse_mesh(",".join(f"{k}={v}" for k, v in cfg["mesh"].items()))
    lines = [f"### {name}: {cfg['topology']}, mesh "
             f"{', '.join(f'{k}={v}' for k, v in cfg['mesh'].items())}, "
             f"{cfg['num_layers']} layers{' (scanned)' if cfg['program'] == 'scan' else ''}",
             ""]
    rows = [("imported XLA program", idot, iby, res.step_time_s)]
    for label, kw in variants(cfg):
        tc = TrainingConfig(seq_len=cfg["seq"], batch_per_chip=cfg["batch_per_chip"],
                            remat=Remat.FULL, attention="dot", **kw)
        tr = compile_training_step(model, mesh, topo.num_chips, tc)
        r2 = simulate_step(tr, chip, topo, executor=Executor.REPRESENTATIVE)
        d2, by2 = summarize_trace(tr, topo, False)
        rows.append((f"tpusim, {label}", d2, by2, r2.step_time_s))
    kinds = sorted({k for _, _, by, _ in rows for k in by})
    lines.append("| program | dot TFLOP/chip | step ms | " + " | ".join(
        f"{k} {a}" for k, a in kinds) + " |")
    lines.append("|---|---:|---:|" + "---:|" * len(kinds))
    for label, dot, by, step in rows:
        cells = [f"{by[k][0]}x, {mib(by[k][1])}" if k in by else "-" for k in kinds]
        lines.append(f"| {label} | {dot / 1e12:.4f} | {step * 1e3:.2f} | "
                     + " | ".join(cells) + " |")
    lines.append("")
    return lines


def section() -> str:
    """The section, from its begin marker to its end marker."""
    lines = [MARKER, "", "## Imported XLA programs against tpusim's own compiled steps", "",
             "_Generated by `python -m validation.hlo_import --write`._", "",
             "Each committed HLO fixture (`tests/fixtures/hlo/`, compiled deviceless for a real "
             "TPU topology by `validation/make_hlo_fixtures.py`) is imported and replayed, and "
             "compared with `tpusim compile` + replay of the same model (a LLaMA-style decoder: "
             "d_model 1024, 8 heads, 4 KV heads, head_dim 128, SwiGLU d_ff 4096, vocab 8192, "
             "untied embeddings), mesh, sequence length (1024), batch (1 sequence per chip), "
             "full remat and plain (non-flash) attention. Bytes are V (the textbook's "
             "convention), summed over executions, in MiB; physical axes are the torus factors "
             "the replica groups span (`pairs:` = collective-permutes between chip pairs).", ""]
    for name in TRAIN:
        lines += fixture_lines(name)
    lines.append(EXPLAIN.rstrip("\n"))
    return "\n".join(lines) + "\n" + END


EXPLAIN = """### Why they differ

* **Dot FLOPs.** The imported count is exact for XLA's matmuls (the tests check it against the
  closed form: 8 x tokens x weights per layer, minus the rematerialized forward of the last
  matmul of each layer, which XLA drops as dead code because only its input is needed for the
  backward; attention scores and P.V forward, recomputed and backward, over the full square
  since the program masks a plain einsum; the unembedding forward and backward). tpusim's own
  compiler recomputes every layer matmul under full remat (it has no dead-code elimination):
  it counts one extra `d_model x d_ff` matmul per layer, 2 x 1024 tokens x 1024 x 4096 = 8.59
  GFLOP, which is the whole difference (17.2 GFLOP for 2 layers, 34.4 for 4).
* **All-to-alls agree exactly.** The embedding lookup and its gradient are one all-to-all each
  in both programs, with the same V (the whole array: group size x the per-chip buffer).
* **Collectives: what XLA chose.** On v5e, XLA turns most FSDP weight gathers and gradient
  reductions into windowed einsums: rings of one-hop collective-permutes (the snake ring that
  `make_mesh` lays over the 4x4) overlapped with partial matmuls; the rest are async all-gathers.
  tpusim's `--fsdp-gather windowed` models the same passes as collective matmuls over the fsdp
  axis. On v5p with fsdp=64 and these small weights, XLA gathers every weight with one combined
  all-reduce of zero-padded shards per phase and all-reduces the full gradients: byte volumes that
  tpusim's compiler (all-gather + reduce-scatter by construction) does not produce. In total
  the gathered and reduced weight bytes are close (fsdp=16 on v5e: 228 MiB in XLA's gathers and
  permutes, 212 MiB in tpusim's gathers and reduce-scatters); XLA's counts are per ring step
  (527 permutes), tpusim's per logical transfer.
* **Tensor parallelism.** XLA all-reduces the activations over `tensor` (x on v5p, the inner
  factor on v5e), which is tpusim's `--tp-activations replicated`; tpusim's default (MaxText's
  sharded activations) uses all-gathers and reduce-scatters instead.
* **Fixtures without a counterpart.** `decode_tp8_v5e8`, `windowed_einsum_v5e16` and
  `spmd_windowed_einsum_v5e16` are not in the tables: `tpusim compile` builds training steps
  only (decode is costed analytically by `tpusim decode`, not as a trace), and the single-matmul
  programs have no zoo model. The tests check them against closed forms instead (decode: weight
  matmuls over tensor plus P.V, with q.K a VPU multiply-reduce; the windowed einsum: forward and
  weight-gradient matmuls).
* **Step time.** The imported program's step runs XLA's own schedule: every fusion with its real
  operand and result sizes (so HBM-bound elementwise work that tpusim's compiler folds into its
  matmuls shows up), small ops each costing their own launch, and XLA's async overlap. At these
  small sizes the steps are a few milliseconds, dominated by HBM-bound fusions and exposed
  permute latency; tpusim's compiled steps are idealized (fused elementwise work, one collective
  per logical transfer).
"""


def updated(doc: str, text: str | None = None) -> str:
    """`doc` (docs/validation.md's text) with this section regenerated (`text`, else
    computed), nothing else changed."""
    return splice(doc, MARKER, END, section() if text is None else text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite the section in "
                                                          "docs/validation.md")
    args = ap.parse_args()
    text = section()
    if args.write:
        DOC.write_text(updated(DOC.read_text(), text))
        print(f"wrote {DOC}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
