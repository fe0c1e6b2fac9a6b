"""What crosses DCN in a data-parallel multi-slice FSDP step (docs/validation.md, effect 6).

Compiles, deviceless for two v6e 4x4 slices (jax[tpu], see docs/reference/xla.md;
`get_topology_desc(..., num_slices=2)` gives MegaScale devices), the dense decoder of `xla_compile`
at Gemma-3 12B's widths (d_model 3840, 16 heads of 256, 8 KV heads, d_ff 15360; a 32768
vocabulary), f32 weights cast to bf16 in each layer, four scanned layers under full remat, one
sequence of 2048 per chip, mesh data=2 (the slices) x fsdp=16, and reads the scheduled HLO:

* every cross-slice (MegaScale) all-reduce: its bytes, the computation it is issued in, and
  whether it waits in the backward loop iteration that produced its gradient (`same`) or is
  carried into the next one (`next`: overlapped with the next layer's backward);
* the collectives within a slice by kind, synchronous or async.

    /work/fid-venv/bin/python -m validation.xla_dcn_schedule                  # compile (minutes)
    /work/fid-venv/bin/python -m validation.xla_dcn_schedule --no-overlap     # the recipes' flags
    .venv/bin/python -m validation.xla_dcn_schedule --hlo dcn.hlo.txt          # read a saved dump

`--no-overlap` compiles with MaxText's data-parallel overlap flags turned off
(`DATA_PARALLEL_OVERLAP`: `--xla_tpu_enable_data_parallel_all_reduce_opt`,
`--xla_tpu_data_parallel_opt_different_sized_ops`), as the Gemma-3 multi-slice recipes ran
(they name no such flags); `--transpose` shards the MLP weights on their d_ff dimension
(MaxText's logical rules put `mlp` on `fsdp_transpose`, which those recipes use).

Observed with jax/libtpu 0.10.2 (2026-12-01, 6 min wall, 120-130 CPU-s, 2.5-2.7 GB peak RSS each
on a loaded 2-core machine): per layer eight cross-slice all-reduces of the chip's bf16 gradient
shard, one per weight matrix (7.37 MB each for the three MLP matrices, 1.97 MB for the query and
output projections, 0.98 MB for key and value) and one for the two norm scales together (f32),
never combined; the embedding and head gradients once after the loop. With the default flags
every matrix's is carried into the next loop iteration; with `--no-overlap` every one waits in
its own iteration (the MLP ones issued mid-backward, the attention ones at its end): the
blocking reduction tpusim's `--dp-allreduce blocking` models, there with one all-reduce per
layer (the loop's peeled iteration sends its layer's from the entry computation). Within a slice
the multi-slice program has no windowed-einsum loop: synchronous all-gathers of the weights and
synchronous all-reduces of the whole bf16 weight gradients (no reduce-scatter), where the
one-slice program of the same decoder runs collective-permute rings; `--transpose` changes none
of the cross-slice bytes.

`--chip v5e` compiles the same step for two v5e 4x4 slices. With `--no-overlap` (2026-12-01,
68 s wall, 68 CPU-s, 2.2 GB peak RSS on a loaded machine) it sends the same eight cross-slice
all-reduces per layer, each waiting in its own iteration (7.37 / 1.97 / 0.98 MB per matrix and
0.03 MB for the norm scales), the peeled layer's and the embedding's from the entry
computation; within a slice 74 synchronous all-gathers and 12 synchronous all-reduces, no
reduce-scatter: the split is the current compiler's, not v6e's alone (tpusim's
`--dp-grad-split per-matrix`, docs/model.md).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from validation import xla_compile

DIMS = dict(d_model=3840, num_heads=16, num_kv_heads=8, head_dim=256, d_ff=15360,
            vocab_size=32768)
SLICES, FSDP, LAYERS, SEQ = 2, 16, 4, 2048
NO_OVERLAP = ("--xla_tpu_enable_data_parallel_all_reduce_opt=false "
              "--xla_tpu_data_parallel_opt_different_sized_ops=false")


def compile_program(transpose: bool = False, chip: str = "v6e") -> str:
    xla_compile.init_jax()
    # jax is optional: imported only where a program is compiled (the jax[tpu] python).
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import AxisType, Mesh
    from jax.sharding import PartitionSpec as P

    topo = topologies.get_topology_desc(platform="tpu", topology_name=f"{chip}:4x4",
                                        num_slices=SLICES)
    devices = np.array(sorted(topo.devices, key=lambda d: (d.slice_index, d.id)))
    mesh = Mesh(devices.reshape(SLICES, FSDP), ("data", "fsdp"),
                axis_types=(AxisType.Auto,) * 2)
    dec = xla_compile.Decoder(mesh, DIMS, param_dtype="float32")
    if transpose:
        dec.wspec.update(w1=P(None, "fsdp"), w3=P(None, "fsdp"), w2=P("fsdp", None))
    params = dec.params(LAYERS, stacked=True)
    tokens = dec.sds((SLICES * FSDP, SEQ), P(("data", "fsdp"), None), jnp.int32)
    return dec.lower_train(params, tokens, remat="full", scan=True).compile().as_text()


_COMP = re.compile(r"^(?:ENTRY )?%(\S+) ")
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) ([a-z][a-z0-9\-]*)\((.*)$")
ICI_KINDS = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")
# Ops a gradient passes through unchanged on its way to a send (layout and dtype moves, the
# within-slice reduction before the cross-slice one).
_PASS = ("bitcast", "copy", "copy-start", "copy-done", "convert", "reshape", "all-reduce")


def _bytes(shape: str) -> int:
    return xla_compile.hlo_shape_bytes(shape, tuple_first=True)


def read_dcn(text: str) -> dict:
    """The cross-slice all-reduces (MegaScale host-transfer sends) and the within-slice
    collectives of a scheduled HLO dump.

    A send in a loop body whose operand comes (through `_PASS` ops) from the body's parameter
    carries the previous iteration's gradient into this one (`next`: it overlaps the next
    layer's backward); one whose operand is computed in the body waits in its own iteration
    (`same`). Sends in the entry computation are `entry`."""
    dcn, ici = [], {}
    defs: dict[tuple[str, str], tuple[str, list[str]]] = {}
    comp, entry = "", ""
    for line in text.splitlines():
        c = _COMP.match(line)
        if c and line.rstrip().endswith("{"):
            comp = c.group(1)
            entry = comp if line.startswith("ENTRY") else entry
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, shape, op, rest = m.groups()
        defs[(comp, name)] = (op, re.findall(r"%([\w.\-]+)", rest.split("), ")[0]))
        if op == "send" and 'transfer_type="ALL_REDUCE"' in line:
            dcn.append({"name": name, "bytes": _bytes(shape), "computation": comp})
        kind = op.removesuffix("-start").removesuffix("-done")
        if kind in ICI_KINDS and not op.endswith("-done"):
            form = "async" if op.endswith("-start") else "sync"
            ici[(kind, form)] = ici.get((kind, form), 0) + 1

    def carried(comp: str, name: str) -> bool:
        for _ in range(50):
            op, args = defs.get((comp, name), ("", []))
            if op == "parameter":
                return True
            if op == "get-tuple-element" and args:
                return defs.get((comp, args[0]), ("",))[0] == "parameter"
            if op not in _PASS or not args:
                return False
            name = args[0]
        return False

    for d in dcn:
        operand = defs[(d["computation"], d["name"])][1][0]
        d["waits"] = ("entry" if d["computation"] == entry else
                      "next" if carried(d["computation"], operand) else "same")
    return {"dcn_all_reduces": dcn, "ici": ici}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hlo", type=Path, help="read this scheduled-HLO dump instead of compiling")
    ap.add_argument("--dump", type=Path, help="write the compiled HLO text here")
    ap.add_argument("--no-overlap", action="store_true",
                    help="compile without MaxText's data-parallel overlap flags")
    ap.add_argument("--transpose", action="store_true",
                    help="shard the MLP weights on d_ff (MaxText's fsdp_transpose)")
    ap.add_argument("--chip", default="v6e", choices=("v6e", "v5e"),
                    help="the slices' generation (4x4 each; default v6e)")
    args = ap.parse_args(argv)
    if args.no_overlap and not args.hlo:
        os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "") + " "
                                          + NO_OVERLAP).strip()
    text = args.hlo.read_text() if args.hlo else compile_program(args.transpose, args.chip)
    if args.dump:
        args.dump.write_text(text)
    s = read_dcn(text)
    print(f"{len(s['dcn_all_reduces'])} cross-slice all-reduces:")
    for d in s["dcn_all_reduces"]:
        print(f"  {d['waits']:<5} {d['bytes'] / 1e6:8.2f} MB  {d['computation']}")
    print("within-slice collectives:")
    for (kind, form), n in sorted(s["ici"].items()):
        print(f"  {kind:<18} {form:<5} {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
