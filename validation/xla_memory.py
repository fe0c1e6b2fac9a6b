"""Peak HBM of training steps: XLA's compiled programs against tpusim (issue 11, memory).

Two sides:

* **XLA** (`--compile`, needs a `jax[tpu]==0.10.2` python, `--jax-python`): a small LLaMA-style
  decoder (`xla_compile.Decoder`: GQA, SwiGLU, RMSNorm in f32, untied embeddings, plain dot
  attention with f32 scores, bf16 params, f32 Adam moments, layers scanned as MaxText's
  scan_layers) is compiled deviceless for a real TPU topology with each remat policy (`none`;
  `full` = `jax.checkpoint` per layer; `minimal` = `jax.checkpoint` with
  `checkpoint_dots_with_no_batch_dims`, MaxText's minimal policy; `offload` =
  `save_and_offload_only_these_names` sending the weight matmuls' outputs to pinned host
  memory, MaxText's minimal_offloaded) and mesh; the `*_splash` programs put jax's Pallas
  splash-attention kernel (MaxText's flash attention, blocks of `FLASH_BLOCK`) in place of
  dot attention. Per program it
  records `compiled.memory_analysis()` (peak, temp, argument and host temp bytes),
  `compiled.cost_analysis()` (flops, bytes accessed) and how XLA gathered the weights. Results
  are cached in `validation/results/xla_memory.json` so the table can be regenerated without
  jax.
* **tpusim**: `tpusim train --json` with the same model, mesh, batch, sequence length, remat and
  `--attention dot` (`--attention flash` for the splash programs; `hbm_peak_bytes`,
  `hbm_peak_breakdown`).

Run:
    .venv/bin/python -m validation.xla_memory --compile --jax-python /work/fid-venv/bin/python
    .venv/bin/python -m validation.xla_memory [--write]    # table from the cache

`--write` rewrites its section of docs/validation.md (between the `<!-- peak-hbm -->` and
`<!-- /peak-hbm -->` markers; `python -m validation.check` says whether it is current). This
module is also the XLA worker (`--worker NAME`, run under the jax python: a venv with
`pip install '.[hlo]'`).
"""

from __future__ import annotations

import argparse
import statistics
import sys

from validation import xla_compile, xla_flash_cost
from validation.template import splice
from validation.xla_memory_programs import (
    ALL,
    CACHE,
    CHIPS,
    CONFIGS,
    DIMS,
    DOC,
    END,
    FLASH_BLOCK,
    LAYERS,
    MARKER,
    MESHES,
    OTHER,
    REPO,
    backfill_from_dumps,
    fsdp_gather_flag,
    fsdp_grad_flag,
    run_xla,
    tpusim_peak,
    worker,
    xla_hbm_peak,
)


def describe(name: str) -> str:
    if name in OTHER:
        c = OTHER[name]
        mesh = " x ".join(f"{k}={v}" for k, v in c["mesh"].items())
        if c["mode"] == "moe_train":
            m = c["moe"]
            return (f"{c['topology']} {mesh}, MoE train step ({m['num_experts']} experts of "
                    f"d_ff {m['d_ff']}, top-{m['top_k']}, capacity {m['capacity_factor']}, "
                    f"d_model {m['d_model']}, {c['layers']} layers), seq {c['seq']}, "
                    f"batch/chip {c['batch_per_chip']}, remat {c['remat']}"
                    + (", final norm" if c.get("final_norm") else ", no final norm"))
        return (f"{c['topology']} {mesh}, decode step (LLaMA-3-8B widths, {c['layers']} "
                f"layers), batch {c['batch']}, KV cache {c['kv_len']}")
    c = CONFIGS[name]
    mesh = " x ".join(f"{k}={v}" for k, v in MESHES[c["mesh"]].items())
    tp = ", tp-act sharded" if c["tp_activations"] == "sharded" else ""
    f32 = ", f32 params cast to bf16" if c.get("f32_params") else ""
    layers = "" if c.get("layers", LAYERS) == LAYERS else f", {c['layers']} layers"
    layers += {"WIDE": " of LLaMA-3-70B widths",
               "LLAMA3_8B": " of LLaMA-3-8B widths"}.get(c.get("dims", "SMALL"), "")
    att = (f", splash attention (blocks {FLASH_BLOCK})" if c.get("attention") == "splash"
           else "")
    return (f"{CHIPS[c['chip']][0]} {mesh}, seq {c['seq']}, batch/chip {c['batch_per_chip']}, "
            f"remat {c['remat']}{tp}{f32}{layers}{att}")


def analysis(x: dict) -> str:
    """` (memory_analysis P GB)` when `memory_analysis()`'s peak is not the HBM peak."""
    if abs(x["peak_bytes"] - xla_hbm_peak(x)) <= 1e-3 * xla_hbm_peak(x):
        return ""
    return f" (memory_analysis {x['peak_bytes'] / 1e9:.2f} GB)"


def table(cache: dict) -> tuple[str, dict[str, float]]:
    """The rows of the cached programs and tpusim's relative error per program."""
    rows, errs = [], {}
    for name in ALL:
        x = cache.get(name)
        if x is None:
            continue
        s = tpusim_peak(name, x)
        err = s["peak_bytes"] / xla_hbm_peak(x) - 1
        errs[name] = err
        top = sorted(s["breakdown"].items(), key=lambda kv: -kv[1])[:3]
        comp = ", ".join(f"{k} {v / 1e9:.2f}" for k, v in top if v > 0)
        host = (f"{x.get('host_temp_bytes', 0) / 1e9:.2f} / {s['host_bytes'] / 1e9:.2f} GB"
                if CONFIGS.get(name, {}).get("remat") == "offload" else "")
        gathers = "n/a (no fsdp)" if "fsdp" not in (CONFIGS.get(name) and MESHES[
            CONFIGS[name]["mesh"]] or OTHER[name]["mesh"]) else fsdp_gather_flag(x)
        if name in CONFIGS and fsdp_grad_flag(name, x) == "all-reduce":
            gathers += ", gradients all-reduced whole"
        rows.append(f"| {describe(name)} | {gathers} | "
                    f"{xla_hbm_peak(x) / 1e9:.2f} GB{analysis(x)} | "
                    f"{s['peak_bytes'] / 1e9:.2f} GB | "
                    f"{err:+.1%} | {comp} | {host} |")
    head = ["| program | weight gathers | XLA peak | tpusim peak | error | "
            "tpusim's largest categories (GB) | host memory, XLA / tpusim |",
            "|---|---|---:|---:|---:|---|---:|"]
    return "\n".join(head + rows), errs


# The section's prose: what remat `offload` is on both sides.
_OFFLOAD_NOTE = (
    "Remat `offload` is `jax.checkpoint` with `save_and_offload_only_these_names` "
    "(MaxText's `minimal_offloaded`: the weight matmuls' outputs, tagged with "
    "`checkpoint_name` as MaxText tags them, go to `pinned_host`; nothing else is saved, "
    "so the scan keeps only the layer input in HBM), the same split as tpusim's "
    "`--remat offload` (docs/model.md \"Memory\"); its last column compares XLA's "
    "`host_temp_size_in_bytes` with every layer's offloaded set in tpusim."
)
# How each memory rule was read off the compiled programs, and what is left.
_RULES_NOTE = (
    "How the rules were read off these programs (`--dump DIR` keeps XLA's buffer "
    "assignment and live ranges; HBM occupancy over the schedule is the sum of the "
    "values live at each point, host (`S(5)`) buffers left out, which XLA's own peak "
    "listing in `*live-range.txt` mixes in): the saved stacks are allocated before the "
    "forward loop and die after the backward loop (v5e fsdp `minimal`; the same "
    "loop-carried stacks in the others); `minimal` keeps no MLP output projection (v5e "
    "fsdp `minimal`, checked on v6e and v5p). The forward's f32 scores are a buffer of "
    "their own, next to the f32 exponentials, in the v5e and v5p programs whose mesh "
    "has one sharded axis (fsdp `minimal`, `offload`, `none`); v6e (every program) and "
    "v5e and v5p on a mesh of two axes fuse the score matmul with the exponentials (one "
    "f32 buffer: the data x fsdp and fsdp x tensor `minimal` rows) as long as the "
    "f32 scores take at most 512 MiB per chip: the v5p fsdp x tensor programs at seq "
    "4096 (1 GiB) do not. With one sequence per chip (batch/chip 1 at seq 4096, and the "
    "`b1` rows) every chip keeps the score matmul's bf16 output and exponentiates it in "
    "the value matmul's fusion: the forward holds only bf16 scores (v5e fsdp `minimal` "
    "at seq 2048 and 4096 against the same programs with two sequences, whose f32 "
    "scores take up to 2 GiB: the size does not decide it; checked on every other "
    "one-sequence row), and the logits matmul writes bf16 logits whose f32 copy only the "
    "loss value's target-logit gather reads; v5e schedules that gather, with the loss "
    "sum whose all-reduce XLA combines with the final norm's gradient, after the "
    "backward loop, so the f32 logits live through it (every one-sequence v5e row "
    "without a tensor axis; v5p and v6e `b1`, the MoE step with and without its final "
    "norm, and v5e fsdp x tensor `b0.25`, whose target logits are all-reduced over "
    "`tensor` with the log-sum-exp, gather at the loss). The three one-sequence `full` "
    "rows were compiled after these rules as held-out checks (tpusim's peaks, written "
    "down before the compiles, 1.045, 0.877 and 0.812 GB for v5e, v5p and v6e: -1.5%, "
    "-5.3%, -4.0%); so was the fsdp x tensor `b0.25` row, which was +8.8% until it "
    "added the `tensor` condition. Windowed programs still "
    "gather each weight whole in their backward (v5e, v6e, v5p fsdp `full`), and the "
    "MLP's matrices die with its weight-gradient matmul. The fsdp x tensor programs "
    "with activations replicated over `tensor` keep the bf16 logits and the final "
    "norm's output through the backward loop under `full`, `minimal` and `offload`, "
    "whatever the gather form (v5p `full`; checked on v5p `offload` and v5e "
    "`minimal`). A windowed MLP's gate/up output buffers are allocated at the start of "
    "the layer (v5e `minimal`; checked on the other windowed rows). A recomputing "
    "backward copies the layer's stack entries out of the stacks (every `minimal` "
    "program; checked on v5p `full` and `offload`). Under `offload` a layer's offloaded "
    "tensors stay in HBM until their copies to host complete, in the next layer's "
    "forward (v5e fsdp `offload`, whose peak is that next softmax; the v5p and v6e "
    "`offload` programs carry the same buffers). Each rule was fitted on the rows "
    "named and the other rows are its check. The host-memory column matches exactly in "
    "every `offload` program. "
    "The backward loop of every `offload` program (all five) carries one HBM buffer per "
    "offloaded tensor: a layer's fetch (an async dynamic-slice out of the host stack) "
    "writes into the buffer the layer above read, so it starts after that layer's last "
    "reader of the tensor, and every fetch completes at the end of the loop body, the "
    "layer above's backward; the top layer's is copied back right after the forward loop "
    "into the buffers its copy to host has just released. tpusim allocates each fetched "
    "set at that end, in program order, whenever the PCIe copy lands (until 2026-12-01 "
    "it counted it from the copy's end, so the v6e fsdp two-sequence row moved from "
    "-9.8% to -19.1% when the windowed backward got faster and outran the PCIe copies). "
    "Where between those bounds each copy starts is the scheduler's choice and differs "
    "by chip: v6e starts the gate/up copies right after the recomputation that reads "
    "the layer's own (both rows), v5p the gate/up and output-projection copies after "
    "the MLP's backward, v5e the q, k, v copies before the attention's backward and the "
    "gate/up ones after it; tpusim counts none of them at the layer above's score "
    "gradient (v6e: 128 MiB of XLA's peak with two sequences per chip, 64 MiB with "
    "one; v5e seq 4096: 32 MiB). "
    "A layer's backward holds, at its score gradient, 2 (v5e), 3 (v6e; v5p under "
    "`full`) or 4 (v5p under `minimal` and `offload`) bf16 score-sized buffers (the "
    "recomputed scores, the probability gradient, the score gradient, v5p's "
    "probabilities), 3 under `none` (v5p fsdp x tensor `minimal` at seq 4096, whose "
    "peak this is, and v6e fsdp `offload`; checked on every other program's live "
    "ranges), and under `full` and `minimal` the MLP's recomputed tensors are dead by "
    "then (v6e `full` and `minimal`, the data x fsdp programs), except in v5e's "
    "windowed programs, whose MLP weight-gradient rings come after the attention's "
    "backward (its gate, up and gated product live at the score gradient of every "
    "windowed v5e `full` and `minimal` row: read off six, held out on the `full` `b1` "
    "row). A recomputation "
    "writes its scores in bf16 (no backward holds an f32 score buffer; v5p adds the "
    "probabilities until the value-gradient matmul), a `full` forward fuses the score "
    "matmul with the exponentials on every mesh within 512 MiB and its value matmul "
    "reads them (4 bytes per score), and with activations sharded over `tensor` the bf16 "
    "logits stay through the backward loop under `none` and `full` too (v5e fsdp x "
    "tensor). "
    "The `*_f32params` rows (f32 weights cast to bf16 in each layer, tpusim "
    "`--param-dtype fp32 --gather-dtype bf16`) keep the f32 weights and a stacked f32 "
    "gradient (as tpusim does). Without a tensor axis the output projection's "
    "weight-gradient ring reads the bf16 logit gradients: v6e runs it after the backward "
    "loop, keeping them (256 MiB with two sequences per chip) through it, when the "
    "weights are cast (v6e fsdp `full` f32params, whose peak, at the last layer's score "
    "gradient, this is; held out on `minimal` f32params, compiled to check that "
    "reading before the rule was coded), and under `offload` with bf16 weights (both v6e "
    "`offload` rows: 256 and 128 MiB from the loss to after the loop; with the "
    "program-order fetch above, -19.1% -> -4.1% and -0.5% -> +5.3%), and "
    "before the loop with bf16 weights otherwise (v6e fsdp `none`, `full`, `minimal`); "
    "v5e runs it before the loop with f32 weights too. "
    "Known remaining differences: v6e also runs that ring after the backward loop in "
    "the one-sequence `minimal` row, which is not modelled. v5p's "
    "windowed fsdp=16 "
    "programs keep 32-192 MiB of the MLP's tensors at the score gradient, and so does "
    "v6e's `b1` row (96 MiB). The MoE rows are the dropping MoE of `xla_crosscheck.py` "
    "with Adam, with and without the final norm tpusim's models have: tpusim's MoE "
    "layers keep their recomputed tensors to the end of the layer's backward. The "
    "decode row's "
    "`memory_analysis()` peak counts 52 MiB of VMEM values (`S(1)`) live at its peak; "
    "its HBM holds the weights and the KV cache, as in tpusim. "
    "In the v5e programs the context of GQA attention sits in a "
    "tiled layout that pads the head-group dimension (a 16 MB tensor takes 128 MB), "
    "which tpusim does not model."
)
# The programs whose FSDP group is longer than XLA's windowed rings.
_LONG_RING_NOTE = (
    "The fsdp=64 (v5p 4x4x4) and fsdp=256 (v6e 16x16) rows, 2 layers each, are programs "
    "whose FSDP group is longer than XLA's windowed rings (docs/model.md \"Collectives as "
    "XLA emits them\"): no windowed loop and no reduce-scatter (`reduce_scatters` 0 in the "
    "cache); XLA reduces every weight gradient by a synchronous all-reduce of the whole "
    "gradient, several gradients per tuple all-reduce, and tpusim runs them with "
    "`--fsdp-grad all-reduce`. They were compiled on 2026-12-01 after tpusim's peaks for "
    "them were written down (4.025, 1.108, 3.995 and 1.009 GB with blocking gathers and "
    "whole-gradient all-reduces, before tpusim held any whole gradient: +4.7%, -1.7%, "
    "+4.8%, -4.6%). At a `full` program's score gradient (the v6e peak; the v5p one "
    "holds 1.093 GB there and peaks 3% higher, at the MLP's first weight-gradient matmul) "
    "both hold the MLP's three whole bf16 gradients and the output and value projections' "
    "(108 MiB), written by the backward's dot fusions and freed by the tuple all-reduces "
    "after the score gradient or at the layer's end; tpusim now holds each from its "
    "weight-gradient matmul to its all-reduce (`whole_gradients`; docs/model.md "
    "\"Memory\"), which took the two `full` rows to +2.4% and +6.1%. The `none` programs "
    "peak at the loss, before any gradient exists (unchanged). The v5p program gathers "
    "every weight by all-reducing zero-padded shards (it has no all-gather), the v6e one "
    "its attention matrices; the padded copies die with the gather's all-reduce except "
    "q's and k's, which both programs keep (12 MiB) for their re-gather in the backward, "
    "where tpusim holds the 24 MiB of the layer's gathered attention matrices. What is "
    "left of the v6e `full` row's +6.1%: at the score gradient tpusim still holds the "
    "attention's normed input, v, the attention context and the mid residual (56 MiB), "
    "which XLA has freed by then, and one activation gradient more (16 MiB). "
    "Compiled after that rule was coded, with tpusim's peaks written down first, as "
    "held-out checks: `minimal` on v5p fsdp=64 and v6e fsdp=256 (1.777 and 1.475 GB "
    "predicted: +3.3% and +3.8%; the v6e program holds the same 108 MiB of whole "
    "gradients at its score-gradient peak) and v5e 8x8 fsdp=64 (async gathers, k and v "
    "by all-reduce), `full` (1.140 GB: +0.0%) and `minimal` (1.903 GB: +28.5%). The v5e "
    "`minimal` miss was the forward's f32 scores: this program, like every fsdp=64 one "
    "(v5p `none`, `minimal`, `full`, v5e `full`), writes only the f32 exponentials, "
    "fused with the score matmul, where the windowed fsdp=16 programs write both; tpusim "
    "now fuses a one-axis forward whose FSDP gathers are plain (docs/model.md "
    "\"Memory\"; +28.5% -> +1.8%, fitted on it; v5p `minimal` moved +3.3% -> +3.2%, its "
    "peak to the backward). The v5e `full` row matches for a reason of its own: XLA "
    "peaks at layer 0's score gradient (1.14 GB), where it holds what tpusim does not "
    "(0.89 GB there; tpusim's own peak is at the loss): the MLP's recomputed gate, up and "
    "gated product (192 MiB: v5e runs part of the MLP's weight gradients after the "
    "attention's backward, `mlp_grad_after_attention`, which tpusim applies to windowed "
    "programs only) and the output projection's whole gradient, which v5e all-reduces "
    "right after the logits' backward and keeps, reduced and whole, to the update "
    "(128 MiB; the v5p and v6e programs slice it at once). The last row, v6e fsdp=256 "
    "`full` at LLaMA-3-70B widths (1.71 GB of whole gradients a layer), was compiled "
    "after both rules with tpusim's peak written down first (6.24 GB: +11.2%). XLA's "
    "peak is at the loss, with the 2 GB output projection gathered right before the "
    "logits; tpusim held that gathered matrix from the step's start, through the "
    "forward. Every program whose forward gathers are plain gathers it right before the "
    "logits (the windowed ones differ by chip and policy), so tpusim now holds it from "
    "the forward's end there (docs/model.md \"Memory\", gathered weights; +11.2% -> "
    "+4.4%; the `none` rows on data x fsdp, fsdp x tensor, fsdp=64 and fsdp=256, and "
    "v5e fsdp=16 `none`, whose program gathers plainly too, came 0.2-3.3 points lower). "
    "That +4.4% was itself luck: at the score gradient tpusim held 1.56 GB (1,488 MiB) of "
    "whole gradients that XLA does not (it all-reduces each 128 or 448 MiB gradient alone, "
    "right after its matmul, and combines only small ones), in place of the 1 GB of bf16 "
    "logit gradients this program keeps from the loss to after the backward loop (not "
    "modelled). tpusim now holds a whole gradient only below 64 MiB, the bracket these "
    "compiles give (docs/model.md \"Memory\", whole gradients; +4.4% -> -1.4%, its peak "
    "at the loss as XLA's; the 2048-wide rows, whose gradients are 4-32 MiB, unchanged). "
    "The row after it, LLaMA-3-8B widths, was compiled after that size rule as its "
    "held-out check (tpusim's peak written down first: 4.328 GB, at the loss): XLA "
    "all-reduces each 112 MiB MLP gradient with one 8 MiB k or v gradient and the 32 MiB "
    "q and o together, so no combined all-reduce it compiled holds more than 120 MiB."
)


def updated(doc: str, text: str | None = None) -> str:
    """`doc` (docs/validation.md's text) with this section regenerated (`text`, else computed
    from the cache: XLA's side cached, tpusim's recomputed), nothing else changed."""
    return splice(doc, MARKER, END, section(xla_compile.load_cache(CACHE)) if text is None
                  else text)


def section(cache: dict) -> str:
    """The section, from its begin marker to its end marker."""
    tab, by_name = table(cache)
    errs = list(by_name.values())
    abs_e = [abs(e) for e in errs]
    med = statistics.median(abs_e) if abs_e else float("nan")
    worst = max(errs, key=abs) if errs else float("nan")
    return "\n".join([
        MARKER, "",
        "## Peak HBM against XLA's compiled programs", "",
        "_Generated by `python -m validation.xla_memory --write` from the cached compiles in "
        "`validation/results/xla_memory.json`._", "",
        _setup_note(), "",
        tab, "",
        f"{len(errs)} programs: median |error| {med:.1%}, worst {worst:+.1%}, "
        f"{sum(1 for e in abs_e if e <= 0.10)} within 10% (target: every program within "
        "10%).", "",
        flash_paragraph(by_name), "",
        _OFFLOAD_NOTE, "",
        f"Not compiled yet (in `CONFIGS`; `--compile` adds them): "
        f"{', '.join(n for n in ALL if n not in cache) or 'none'}.", "",
        _RULES_NOTE, "",
        _LONG_RING_NOTE,
        END,
    ])


def _setup_note() -> str:
    """The two sides of the comparison: the compiled decoder and tpusim's run of it."""
    m = DIMS
    return (
        f"XLA side: a LLaMA-style decoder (d_model {m['d_model']}, {m['num_heads']} heads / "
        f"{m['num_kv_heads']} KV heads of {m['head_dim']}, SwiGLU d_ff {m['d_ff']}, vocab "
        f"{m['vocab_size']}, untied embeddings, {LAYERS} layers (2 where the row says so) scanned "
        "(`jax.lax.scan` over stacked weights, as MaxText), RMSNorm in f32, dot attention "
        "with f32 scores, bf16 params, f32 Adam moments, donated arguments) compiled deviceless "
        "by `jax[tpu]==0.10.2` (the rows marked `splash attention`: jax's Pallas "
        "splash-attention kernel in place of dot attention, below); the peak is the HBM "
        "peak of XLA's buffer assignment "
        "(`hbm_peak_bytes`: `validation/xla_live_ranges.py`'s occupancy of the compile's "
        "dump, host, VMEM and SMEM values left out), which equals "
        "`compiled.memory_analysis().peak_memory_in_bytes` to 0.01% on every dense training "
        "program; where they differ the row shows both. "
        "tpusim side: `tpusim train --attention dot --remat R --tp-activations T --json` "
        "(`--attention flash` for the splash rows) on the "
        "same model, mesh and batch (`hbm_peak_bytes`; the last column is the largest entries "
        "of `hbm_peak_breakdown`). Remat `minimal` is `jax.checkpoint` with "
        "`checkpoint_dots_with_no_batch_dims`. The residual stream is replicated over `tensor` "
        "unless the row says `tp-act sharded` (its sequence dim split over `tensor`)."
    )


def flash_paragraph(by_name: dict[str, float]) -> str:
    """What the splash rows show (issue 11: flash attention where the program can express it),
    with their errors, and what the kernels' custom calls say they cost
    (`xla_flash_cost.py`'s cache)."""
    flash = {n: e for n, e in by_name.items() if CONFIGS.get(n, {}).get("attention") == "splash"}
    if not flash:
        return "No flash-attention program is in the cache yet (`--compile` adds them)."
    med = statistics.median(abs(e) for e in flash.values())
    worst = max(flash, key=lambda n: abs(flash[n]))
    text = (
        "### Flash attention\n\n"
        f"The {len(flash)} `splash attention` rows are the same decoder and steps with "
        "jax's Pallas splash-attention TPU kernel (`jax.experimental.pallas.ops.tpu."
        "splash_attention`, what MaxText calls: `make_splash_mha` with a causal mask, q "
        "scaled before it, `[batch, heads, seq, head_dim]` layout, the kernel vmapped over "
        "each chip's sequences inside a `shard_map` with the batch on fsdp and the heads on "
        f"`tensor`, every block size {FLASH_BLOCK}: MaxText's default `sa_block_*`; "
        "unfused dq and dkv backward kernels) in place of dot attention. A deviceless "
        "compile lowers the kernel on every chip and mesh tried (Mosaic runs inside "
        "libtpu's compiler): three `tpu_custom_call`s per layer, the forward "
        "(`splash_mha_fwd_residuals`) and the backward's dq and dkv kernels (1.5-4.2 MB "
        "of scoped VMEM each in `xla_flash_cost.py`'s compiles). tpusim's `--attention "
        "flash` against them: "
        f"median |error| {med:.1%}, worst {flash[worst]:+.1%} (`{worst}`); "
        f"{sum(1 for e in flash.values() if abs(e) <= 0.10)} of {len(flash)} within 10%. "
        "No score-sized buffer reaches HBM in any of them (the kernel keeps its scores in "
        "VMEM, as tpusim assumes), so most peak at the loss (the f32 and bf16 logits and "
        "the gathered output projection) where the dot programs peak inside an attention; "
        "v5e fsdp x tensor `full`, v6e fsdp x tensor `minimal` and v5e's one sequence of "
        "4096 (whose f32 logits v5e keeps through the backward loop) peak in a layer's "
        "backward. What a layer keeps for the backward "
        "(`none`): q, k, v and the kernel's output in its `[heads, seq, head_dim]` layout, "
        "the output again in `[seq, heads x head_dim]` for the output projection's "
        "backward (tpusim keeps one copy), and the f32 log-sum-exp per row and head, which "
        "the kernel writes padded to 128 lanes (a 32 MiB temporary per layer at two "
        "sequences of 2048 and 16 heads; the stack keeps it compact, 1 MiB) and the dq "
        "kernel reads padded again; tpusim counts the compact one. One rule differs from "
        "dot attention: on fsdp x tensor the dot programs keep the bf16 logits and the "
        "final norm's output through the backward loop whatever the gather form (the "
        "output projection's weight gradient deferred past the loop), the splash programs "
        "only where the gathers are async (v5e); v6e and v5p, blocking, free them before "
        "the loop (`full` was +14.2% on both; tpusim now defers them under `--attention "
        "flash` only with async or windowed gathers, docs/model.md \"Memory\": -5.0% and "
        "-5.1%; held out on v6e fsdp x tensor `minimal`, compiled after the rule was read "
        "off `full` with tpusim's peak written down first, 2.56 GB with the deferral: "
        "+8.0%, now -3.5%). The `none` programs "
        "on fsdp x tensor are tpusim's largest flash errors (+7.0% to +7.7%): XLA's "
        "stacks hold two of the four d_model-wide bf16 tensors tpusim keeps per layer "
        "(the layer input, the normed attention input, the mid residual, the normed MLP "
        "input; 128 MiB a layer at fsdp=4 x tensor=4, the residual replicated over "
        "`tensor`) and the second copy of the output above (16 MiB): 112 MiB a layer, "
        "448 MiB over the four layers, more than the whole difference (v5e: 0.44 GB; on "
        "fsdp=16 the same pair is 32 MiB a layer, +0.4% to +0.9%). They are the bf16 "
        "layer input and mid residual: the forward loop's output tuple (v5e fsdp=16 "
        "`none`) stacks, per norm, its f32 input, two f32 row statistics, the f32 scale, "
        "the f32 normalised rows and the bf16 normed output, and the bf16 residual stream "
        "itself only as the loop carry (JAX's autodiff keeps the norm's f32 input, which "
        "tpusim counts as well, `norm_attn_f32`). The dot programs' stacks were not "
        "re-read for this; their `none` rows, which count these two tensors, are "
        "-4.7% to +4.8%; the rule is unchanged, as every flash row is within 10%. "
        "v5e with one sequence per chip (`full`, seq 4096 and the `b1` row at "
        "2048) peaks in a layer's recomputation, where XLA holds, besides the f32 logits "
        "v5e keeps for the loss value (which tpusim holds too), the bf16 logit gradients "
        "(`add_convert_fusion`, [tokens, vocab], 256 and 128 MiB, from the loss to after "
        "the backward loop: the output projection's windowed weight-gradient ring "
        "deferred past the loop, as v6e does with cast weights or offload), where the dot "
        "twin at seq 4096 (`v5e_fsdp_full_s4096`, dumped again to read it) frees them "
        "before the loop. Read off the seq 4096 row (-21.0% without the rule); the `b1` "
        "row was compiled after that reading, with tpusim's peak written down first "
        "(0.877 GB: -15.1%), and showed the same buffer; tpusim now keeps them under "
        "`--attention flash` on a chip that keeps the loss value's logits "
        "(`windowed_head_gradient_bytes`, docs/model.md \"Memory\": -4.5% and -1.2%).")

    cost = xla_compile.load_cache(xla_flash_cost.CACHE)
    if cost:
        text += "\n\n" + xla_flash_cost.section(cost)
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--dump", help="XLA dump directory (worker: this program's; driver: one "
                                   "subdirectory per program)")
    ap.add_argument("--compile", action="store_true",
                    help="compile the programs missing from the cache with the jax python")
    ap.add_argument("--recompile", action="store_true", help="compile every selected program")
    ap.add_argument("--jax-python", default=xla_compile.DEFAULT_JAX_PYTHON,
                    help="python with jax[tpu]==0.10.2 (default %(default)s)")
    ap.add_argument("--configs", default=",".join(ALL), help="comma list of programs")
    ap.add_argument("--from-dumps", nargs="+", metavar="DIR",
                    help="set the cached programs' hbm_peak_bytes from earlier --dump "
                         "directories (DIR/PROGRAM) and exit")
    ap.add_argument("--write", action="store_true",
                    help="rewrite its section of docs/validation.md")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.dump)
        return 0
    names = args.configs.split(",")
    unknown = [n for n in names if n not in ALL]
    if unknown:
        ap.error(f"unknown program(s) {', '.join(unknown)}; known: {', '.join(ALL)}")
    if args.from_dumps:
        cache = xla_compile.load_cache(CACHE)
        done = backfill_from_dumps(cache, args.from_dumps)
        xla_compile.write_cache(CACHE, cache)
        print(f"hbm_peak_bytes set for {len(done)} programs: {', '.join(done) or 'none'}")
        return 0
    if args.compile or args.recompile:
        cache = xla_compile.compile_into_cache(
            names, CACHE, lambda n: run_xla(n, args.jax_python, args.dump),
            recompile=args.recompile,
            report=lambda n, r: f"peak {r['peak_bytes'] / 1e9:.3f} GB")
    else:
        cache = xla_compile.load_cache(CACHE)
    text = section({n: cache[n] for n in names if n in cache})
    if args.write:
        DOC.write_text(splice(DOC.read_text(), MARKER, END, text))
        print(f"wrote {DOC.relative_to(REPO)}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
