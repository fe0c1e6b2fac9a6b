"""What XLA schedules around an MoE layer's all-to-alls (docs/validation.md, effect 3).

Compiles, deviceless for a v6e 4x4 (jax[tpu], see docs/reference/xla.md), a MaxText-style
dropping MoE decoder (`xla_compile.lower_moe_train`: MaxText `RoutedMoE.dense_matmul` with a
capacity factor: one-hot dispatch and combine masks [batch, seq, experts, capacity], the einsums
`BSM,BSEC->EBCM` and `EBCM,BSEC->BSM`, experts sharded over `expert`, tokens over `fsdp` x
`expert`, the other weights' d_model over `fsdp` x `expert` as MaxText shards them), two scanned
layers under full remat, mesh fsdp=4 x expert=4, and reads the scheduled HLO:

* every all-to-all: the loop it sits in (forward or backward), the einsum it belongs to, its
  bytes, and whether it is synchronous (`all-to-all`) or async (`all-to-all-start`/`-done`,
  with compute scheduled between them);
* XLA's own cost estimate (`estimated_cycles`) of the dispatch einsum's convolution against a
  weight matmul of the same layer, per FLOP.

    /work/fid-venv/bin/python -m validation.xla_moe_schedule            # compile (minutes)
    .venv/bin/python -m validation.xla_moe_schedule --hlo moe.hlo.txt    # read a saved dump
    /work/fid-venv/bin/python -m validation.xla_moe_schedule --size 750b # the 750B's sizes
    /work/fid-venv/bin/python -m validation.xla_moe_schedule --size mixtral-fsdp256 --dump F
    /work/fid-venv/bin/python -m validation.xla_moe_schedule --size mixtral-8x22b

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
Compiled again (2026-12-01) with the Mar 2025 8x7B recipe's `CF_FOR_ALL_GATHER` and
`DATA_PARALLEL_OVERLAP` flags (docs/model.md lists them; its `MOE_VMEM_LIMIT`, a scoped-VMEM
limit whose value the reference does not record, left out): the experts' weight gathers (three
bf16[8, 4096, 14336], 896 MiB each, forward and backward) become async collective fusions, as
tpusim's async gathers are, the attention projections' forward gathers stay synchronous, and
the seven weight-gradient all-reduces stay synchronous and whole (2,970 MiB per layer), as
`--fsdp-grad auto` has them; 128 s wall, 123 CPU-s, 2.2 GB (loaded machine). The script's table
counts such a chained all-gather once, as async.

`--size mixtral-8x22b`: Mixtral-8x22B widths (d_model 6144, 8 experts of d_ff 16384, top-2,
capacity factor 1.25, seq 4096, 48 heads of 128, vocab 32768) on a v6e 16x16 with fsdp=64 x
expert=4 placed as the recipe's `hybrid_ring_64x4` custom mesh (`xla_compile.build_mesh`: each
expert group a 2x2 block of chips in ring order, the fsdp axis the 8x8 grid of blocks), no recipe
flags (the 8x22B recipe lists none). Observed (2026-12-01, jax/libtpu 0.10.2; 174 s wall,
103 CPU-s, 2.0 GB peak RSS under load): the same six synchronous MoE all-to-alls (120 MiB per
chip and sequence; the combine weights' gradient bf16 [seq, experts, capacity + 1], 80.06 MiB);
no asynchronous collective and no windowed-einsum loop at all; every weight gathered by a
synchronous all-gather before its matmul (the attention projections over all 256 chips, the
routed experts over their 64-chip fsdp group), again in the backward, and every weight gradient
reduced by a synchronous all-reduce of the whole gradient (the experts' bf16[2, 6144, 16384]
in an all-reduce-scatter fusion over the fsdp group, the shard kept), as the fsdp=256 programs
and tpusim's `grad_kind_for` over more than 32 chips. XLA's estimated cycles per FLOP of the
expert matmuls are 1.17-1.29x those of the query projection (e.g. 5.93 M cycles for the
2.06 TFLOP gate matmul, 0.69-0.76 M for the 0.31 TFLOP projection); at the 750B's sizes
1.13x (35.0 M cycles for the 13.2 TFLOP recomputed gate, 0.65 M for a 0.27 TFLOP projection).
The 750B compile read the same way: its forward runs the experts as windowed einsums (async
collective-permutes over the 16-chip fsdp ring, XLA's cost estimate 4.5x the cycles per FLOP of
the same matmul unwindowed: each step accumulates into the whole [16 x 1536, 32768] output),
its backward gathers the expert weights by three synchronous 512 MiB all-gathers and reduces
their gradients in windowed loops; everything else synchronous. Neither program has anything
cheaper than tpusim's step; the collective table the script prints counts each collective once
per layer-loop iteration (a windowed loop's permutes once per body, not per trip). The 8x22B
compiled again with `CF_FOR_ALL_GATHER` (a what-if: its recipe lists no flags; 318 s wall,
159 CPU-s, 2.1 GB under load): all but one weight gather per pass become async collective
fusions (forward 5 of 7, backward 11 of 12; a 384 MiB expert gather and a 72 MiB projection
gather stay synchronous in the forward), as tpusim's async gathers; the all-to-alls and the
whole-gradient all-reduces stay synchronous. The 750B compiled with the same flags (a what-if
too: its runs record none; moe9, 2026-12-01, 146 s wall, 139 CPU-s, 2.2 GB peak RSS at load
~5): per backward iteration 11 of the 12 weight gathers async collective fusions (3,808 MiB,
the three 512 MiB expert gathers among them; a 32 MiB one synchronous), the forward's windowed
expert einsums as before (async permutes), the eight all-to-alls (the six MoE ones and the
embedding's two) and the four whole-gradient all-reduces of the backward (532 MiB) synchronous:
as tpusim models the step, nothing cheaper.

SparseCore flags (2026-12-01, libtpu 0.10.2, given in `LIBTPU_INIT_ARGS`; the small program
unless said):
* `--xla_tpu_enable_sparse_core_collective_offload_dense_all_to_all=true`, alone or with
  `--xla_tpu_enable_sparse_core_async_all_to_all=true`, fails to compile here and at the
  8x22B's and the 750B's sizes: `RET_CHECK failure (platforms/xla/sparse_core/
  dense_all_to_all_emitter_base.cc:164) num_blocks_per_replica % kGroupSize == 0 (1 vs. 0)`.
  These all-to-alls cannot be offloaded to the SparseCores as compiled.
* `--xla_tpu_enable_sparse_core_async_all_to_all=true` alone and
  `--xla_tpu_offload_convolution_to_sparsecore=true` give a byte-identical program.
* `--xla_tpu_enable_offloading_gather_to_sparsecore=true` with
  `--xla_tpu_offload_gather_to_sparsecore=true` runs only the routing's index gathers
  (u32[4096]) on the SparseCore (`call-start`, `async_execution_thread="sparsecore"`).
130-220 s wall, 64-70 CPU-s, 1.8-2.0 GB each (loaded machine).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from validation import xla_compile

# name -> (topology, fsdp, expert, d_model, d_ff, experts, top-k, capacity factor, seq, heads,
# head_dim, layers, vocab)
SIZES = {
    "small": ("v6e:4x4", 4, 4, 1024, 2048, 8, 2, 1.25, 2048, 8, 128, 2, 4096),
    "750b": ("v6e:16x16", 16, 16, 8192, 32768, 16, 2, 1.5, 8192, 8, 256, 2, 32000),
    "mixtral-fsdp256": ("v6e:16x16", 256, 1, 4096, 14336, 8, 2, 1.25, 4096, 32, 128, 2, 32000),
    "mixtral-8x22b": ("v6e:16x16", 64, 4, 6144, 16384, 8, 2, 1.25, 4096, 48, 128, 2, 32768),
}
# MaxText's custom device order of a size (default: jax's device mesh, `xla_compile.build_mesh`).
PLACEMENT = {"mixtral-8x22b": "hybrid_ring_64x4"}


def compile_program(router: str = "maxtext", size: str = "small") -> str:
    xla_compile.init_jax()
    topo, fs, ep, d, f, e, k, cf, seq, h, hd, layers, v = SIZES[size]
    mesh, _ = xla_compile.build_mesh(topo, {"fsdp": fs, "expert": ep},
                                     placement=PLACEMENT.get(size, "make_mesh"))
    lowered = xla_compile.lower_moe_train(mesh, d_model=d, d_ff=f, num_experts=e, top_k=k,
                                          capacity_factor=cf, seq=seq, num_heads=h, head_dim=hd,
                                          num_layers=layers, vocab_size=v, router=router)
    return lowered.compile().as_text()


# An instruction: name, shape (a tuple shape has spaces in it), opcode.
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9\-]*)\(")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) \(")


def _bytes(shape: str) -> int:
    return xla_compile.hlo_shape_bytes(shape)


_COLLECTIVES = ("all-to-all", "all-gather", "all-reduce", "reduce-scatter", "collective-permute")


def _loop(where: str) -> str:
    """The scanned layer loop an op's metadata puts it in: backward (the transposed scan, its
    recomputation included), forward, or outside both (embedding, head, update)."""
    if "transpose(jvp" in where:
        return "backward"
    return "forward" if "jvp()/while" in where else "outside"


def read_schedule(text: str) -> dict:
    """The collectives of the scheduled HLO, each with its loop and form, and XLA's cycles per
    FLOP of the dispatch convolution against the weight matmuls (`dot_general` fusions).

    `all_to_all`: every all-to-all (its einsum, bytes, loop, sync or async). `collectives`: every
    collective op (the `-done` halves of async pairs not counted again): kind, form ("sync": one
    op, compute waits for it; "async": a `-start`/`-done` pair with compute scheduled between,
    or an async collective fusion's collective, carried by the compute fusions before its use),
    loop and bytes. An all-reduce XLA wraps in a fusion with the slice it keeps (`calls=
    %all-reduce-scatter...`: the whole gradient reduced, the shard kept) counts as a synchronous
    all-reduce of the fusion's operand; the windowed einsums' `collective-permute`s are listed as
    they are (one per step of the loop body, not multiplied by its trip count)."""
    a2a, coll, cycles = [], [], {}
    shapes: dict[str, str] = {}
    inside, chained = "", set()
    for line in text.splitlines():
        c = _COMPUTATION.match(line)
        if c:
            inside = c.group(1)
        m = _INSTR.match(line)
        if not m:
            continue
        name, shape, op = m.groups()
        shapes[name] = shape
        meta = re.search(r'op_name="([^"]*)"', line)
        where = meta.group(1) if meta else ""
        # An async pair is listed once, at its done (whose shape is the result).
        if op.startswith("all-to-all") and not op.endswith("-start"):
            a2a.append({"name": name, "form": "async" if op.endswith(("-start", "-done"))
                        else "sync", "op": op,
                        "loop": "backward" if "transpose(jvp" in where else "forward",
                        "einsum": next((c for c in reversed(where.split("/")) if "->" in c),
                                       where.split("/")[-1]),
                        "bytes": _bytes(shape)})
        kind = next((k for k in _COLLECTIVES if op.startswith(k)), None)
        # The all-reduce inside an all-reduce-scatter fusion is counted at the fusion. A
        # collective of an async collective fusion (the recipes' CF_FOR_ALL_GATHER flags: a
        # `chain_id`, carried through the compute fusions ahead of its use, one copy in each)
        # is async and counted once per channel.
        chain = re.search(r'chain_id="\d+"', line)
        channel = re.search(r"channel_id=(\d+)", line)
        if chain and channel:
            if channel.group(1) in chained:
                kind = None
            chained.add(channel.group(1))
        if kind and not op.endswith("-done") and not inside.startswith("all-reduce-scatter"):
            coll.append({"kind": kind,
                         "form": "async" if op.endswith("-start") or chain else "sync",
                         # an async start's tuple leads with its operand (or the operand
                         # tuple): its first array
                         "loop": _loop(where), "bytes": _bytes(shape.lstrip("("))})
        elif op == "fusion" and "calls=%all-reduce-scatter" in line:
            arg = re.search(r"fusion\(%([^,)]+)", line)
            coll.append({"kind": "all-reduce", "form": "sync", "loop": _loop(where),
                         "bytes": _bytes(shapes.get(arg.group(1), "")) if arg else 0})
        cyc = re.search(r'estimated_cycles":"?(\d+)', line)
        if op == "fusion" and cyc and "jvp()/while/body" in where and "transpose" not in where:
            cycles[name] = (where.split("closed_call/")[-1], int(cyc.group(1)), shape)
    return {"all_to_all": a2a, "collectives": coll, "forward_fusions": cycles}


def collective_summary(coll: list[dict]) -> list[tuple[str, str, str, int, float]]:
    """(loop, kind, form, count, MiB) per group of `read_schedule`'s collectives, sorted."""
    groups: dict[tuple[str, str, str], list[int]] = {}
    for c in coll:
        groups.setdefault((c["loop"], c["kind"], c["form"]), []).append(c["bytes"])
    return [(*k, len(v), sum(v) / 2**20) for k, v in sorted(groups.items())]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hlo", type=Path, help="read this scheduled-HLO dump instead of compiling")
    ap.add_argument("--dump", type=Path, help="write the compiled HLO text here")
    ap.add_argument("--router", choices=("maxtext", "f32"), default="maxtext",
                    help="how the combine weights are built (`xla_compile.lower_moe_train`)")
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
    print("collectives per loop iteration (loop, kind, form, count, MiB):")
    for loop, kind, form, n, mib in collective_summary(s["collectives"]):
        print(f"  {loop:<8} {kind:<18} {form:<5} {n:>3} {mib:10.2f} MiB")
    print("forward fusions with XLA's estimated cycles (matmuls and the dispatch):")
    for name, (what, cyc, shape) in s["forward_fusions"].items():
        if "dot_general" in what:
            print(f"  {name:<28} {cyc:>8} cycles  {shape:<40} {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
