"""What XLA schedules around an MoE layer's all-to-alls (docs/validation.md, effect 3).

Compiles, deviceless for a v6e 4x4 (jax[tpu], see docs/reference/xla.md), a MaxText-style
dropping MoE decoder (`_xla.lower_moe_train`: MaxText `RoutedMoE.dense_matmul` with a capacity
factor: one-hot dispatch and combine masks [batch, seq, experts, capacity], the einsums
`BSM,BSEC->EBCM` and `EBCM,BSEC->BSM`, experts sharded over `expert`, tokens over `fsdp` x
`expert`, the other weights' d_model over `fsdp` x `expert` as MaxText shards them), two scanned
layers under full remat, mesh fsdp=4 x expert=4, and reads the scheduled HLO:

* every all-to-all: the loop it sits in (forward or backward), the einsum it belongs to, its
  bytes, and whether it is synchronous (`all-to-all`) or async (`all-to-all-start`/`-done`,
  with compute scheduled between them);
* XLA's own cost estimate (`estimated_cycles`) of the dispatch einsum's convolution against a
  weight matmul of the same layer, per FLOP.

    /work/fid-venv/bin/python benchmarks/xla_moe_schedule.py            # compile (minutes)
    .venv/bin/python benchmarks/xla_moe_schedule.py --hlo moe.hlo.txt    # read a saved dump
    /work/fid-venv/bin/python benchmarks/xla_moe_schedule.py --size 750b # the 750B's sizes
    /work/fid-venv/bin/python benchmarks/xla_moe_schedule.py --size mixtral-fsdp256 --dump F

`--router maxtext` (the default) builds the masks as MaxText's `generate_masks` does (a bf16
combine mask); `--router f32` as this script first did (f32 one-hot times the weights, cast).
`--size 750b`: the custom 750B MoE's per-chip sizes (docs/reference/maxtext_runs.json: d_model
8192, 16 experts of d_ff 32768, top-2, capacity factor 1.5, seq 8192, one sequence per chip) on
a v6e 16x16 with fsdp=16 x expert=16 (jax's device mesh: the expert axis is one 16-chip ring,
x = 0..15), with 8 attention heads of 256 (the 750B's 128 heads' dot-attention scores would
not fit the chip; the attention is not what this reads).

Observed with jax/libtpu 0.10.2 (2026-11-30, 7 min of compile on a loaded 2-core machine): six
all-to-alls, all synchronous; forward: the dispatch and the combine; backward loop: the
combine's transpose, the recomputed dispatch, the dispatch's transpose and an f32 all-to-all of
the combine weights' gradient ([seq, experts, capacity] per sequence; XLA computes it where the
experts' outputs live, after an all-gather of the output gradient over `expert`, instead of
recomputing the combine all-to-all). The dispatch convolution runs at the FLOP rate XLA's cost
model gives the layer's weight matmuls. With the attention, router and embedding weights sharded
over fsdp x expert (MaxText's rule; 13 min of compile under load): their gathers span all 16
chips, the routed experts' the 4-chip fsdp groups, and the embedding lookup's all-to-all (plus
its gradient's) all 16; the six MoE all-to-alls are unchanged. With
`LIBTPU_INIT_ARGS=--xla_tpu_enable_async_all_to_all=true` (and MaxText's CF_FOR_ALL_GATHER
flags) every all-to-all is an async start/done pair: the backward's transposes overlap the
experts' input-gradient matmuls, the forward's have no independent work between start and done
(tpusim's `--ep-alltoall async`).

With MaxText's router (2026-12-01, same jax/libtpu; 2 min of compile, 4 min at the 750B's
sizes): the same six synchronous all-to-alls, but the combine weights' gradient is bf16 and
sent before the mask's first capacity slot is cut off: [seq, experts, capacity + 1] (20.03 MiB
here, against 40 MiB in f32; 384.25 MiB at the 750B's sizes, where the five token all-to-alls
move 384 MiB each and the output gradient's gather over `expert` 2 GiB). XLA's estimated
cycles per FLOP of the dispatch convolution at the 750B's sizes: 1.25x those of the query
projection, the combine's 0.93x (no cheaper than a weight matmul).

`--size mixtral-fsdp256`: Mixtral-8x7B widths (d_model 4096, 8 experts of d_ff 14336, top-2,
capacity factor 1.25, seq 4096, 32 heads of 128) on a v6e 16x16 with fsdp=256 and no expert
axis, as the tpu-recipes Mixtral-8x7B runs shard it: every weight, the routed experts included,
is split 256 ways. Observed (2026-12-01, jax/libtpu 0.10.2, no recipe flags; 45 s wall, 86 CPU-s,
2.1 GB on the idle machine): every weight gradient is reduced by a synchronous all-reduce of
the whole gradient (per layer bf16[8, 4096, 14336] for the experts' gate and up, bf16[8, 14336,
4096] for their down projection, the attention projections likewise; no reduce-scatter), as
in the dense fsdp=256 programs and as tpusim's mixed modes do over more than 32 chips
(`grad_kind_for`). Read it with `grep` on the `--dump`: the script's own report lists the
all-to-alls, here only the embedding lookup's two (no expert axis: no token all-to-alls).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _xla  # noqa: E402

# name -> (topology, fsdp, expert, d_model, d_ff, experts, top-k, capacity factor, seq, heads,
# head_dim, layers, vocab)
SIZES = {
    "small": ("v6e:4x4", 4, 4, 1024, 2048, 8, 2, 1.25, 2048, 8, 128, 2, 4096),
    "750b": ("v6e:16x16", 16, 16, 8192, 32768, 16, 2, 1.5, 8192, 8, 256, 2, 32000),
    "mixtral-fsdp256": ("v6e:16x16", 256, 1, 4096, 14336, 8, 2, 1.25, 4096, 32, 128, 2, 32000),
}


def compile_program(router: str = "maxtext", size: str = "small") -> str:
    _xla.init_jax()
    topo, fs, ep, d, f, e, k, cf, seq, h, hd, layers, v = SIZES[size]
    mesh, _ = _xla.build_mesh(topo, {"fsdp": fs, "expert": ep})
    lowered = _xla.lower_moe_train(mesh, d_model=d, d_ff=f, num_experts=e, top_k=k,
                                   capacity_factor=cf, seq=seq, num_heads=h, head_dim=hd,
                                   num_layers=layers, vocab_size=v, router=router)
    return lowered.compile().as_text()


_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\S+) ([a-z][a-z0-9\-]*)\(")


def _bytes(shape: str) -> int:
    return _xla.hlo_shape_bytes(shape)


def read_schedule(text: str) -> dict:
    """The all-to-alls of the scheduled HLO, each with its loop and form, and XLA's cycles per
    FLOP of the dispatch convolution against the weight matmuls (`dot_general` fusions)."""
    a2a, cycles = [], {}
    for line in text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        name, shape, op = m.groups()
        meta = re.search(r'op_name="([^"]*)"', line)
        where = meta.group(1) if meta else ""
        if op.startswith("all-to-all"):
            a2a.append({"name": name, "form": "async" if op.endswith(("-start", "-done"))
                        else "sync", "op": op,
                        "loop": "backward" if "transpose(jvp" in where else "forward",
                        "einsum": next((c for c in reversed(where.split("/")) if "->" in c),
                                       where.split("/")[-1]),
                        "bytes": _bytes(shape)})
        cyc = re.search(r'estimated_cycles":"?(\d+)', line)
        if op == "fusion" and cyc and "jvp()/while/body" in where and "transpose" not in where:
            cycles[name] = (where.split("closed_call/")[-1], int(cyc.group(1)), shape)
    return {"all_to_all": a2a, "forward_fusions": cycles}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hlo", type=Path, help="read this scheduled-HLO dump instead of compiling")
    ap.add_argument("--dump", type=Path, help="write the compiled HLO text here")
    ap.add_argument("--router", choices=("maxtext", "f32"), default="maxtext",
                    help="how the combine weights are built (`_xla.lower_moe_train`)")
    ap.add_argument("--size", choices=tuple(SIZES), default="small",
                    help="the program's sizes (see the module docstring)")
    args = ap.parse_args(argv)
    text = args.hlo.read_text() if args.hlo else compile_program(args.router, args.size)
    if args.dump:
        args.dump.write_text(text)
    s = read_schedule(text)
    print(f"{len(s['all_to_all'])} all-to-alls:")
    for a in s["all_to_all"]:
        print(f"  {a['loop']:<8} {a['form']:<5} {a['bytes'] / 2**20:8.2f} MiB  {a['einsum']}")
    print("forward fusions with XLA's estimated cycles (matmuls and the dispatch):")
    for name, (what, cyc, shape) in s["forward_fusions"].items():
        if "dot_general" in what:
            print(f"  {name:<28} {cyc:>8} cycles  {shape:<40} {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
