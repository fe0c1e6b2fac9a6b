"""The TPU chip presets (`CHIPS`), where each of their numbers comes from, and custom chips
from YAML.

Every preset number cites `../shared/reference/tpu.md` (the textbook *How to Scale Your Model*,
restated) or a public Google Cloud spec. Efficiency factors default to 1.0 (the textbook's
idealisation) unless a fit says otherwise (`efficiency_sources`); power and price come from
`sim/chip_power.py` (`power_sources`). The fields and their rules are `sim/hardware.py`'s.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from sim.chip_power import (
    MEASURED_POWER_W,
    POWER_ASSUMED,
    POWER_DERIVATION,
    POWER_FIELDS,
    PRESET_POWER,
)
from sim.hardware import (
    CHIP_BOOL_FIELDS,
    CHIP_FIELDS,
    CHIP_KEYS_CALL,
    CHIP_KEYS_LISTING,
    FIELD_RANGES,
    NULLABLE_CHIP_FIELDS,
    ChipSpec,
)
from topologies.errors import Said, TpusimError
from topologies.quantities import parse_quantity
from topologies.registry import Registry
from topologies.validate import number, one_of, short_repr
from workloads.xla_compiler import XlaCompilerSpec

CHIPS: Registry[ChipSpec] = Registry("chip", listing="`tpusim presets` lists them")

# Shared numbers, each cited once.
_HOP_LATENCY_S = 1e-6  # tpu.md §1.1 "Per-hop ICI latency: about 1 µs" (the book's T_min)
# No public per-hop DCN latency is given in the reference; 10 µs is an assumption (a datacenter
# network one-way latency is tens of µs), documented in docs/model.md and overridable via YAML.
_DCN_LATENCY_S = 10e-6
# tpu.md §1.2: the VPU is "about 30x below the MXU" (stated for v5p). Applying the same ratio to
# v3, v4, v6e and TPU7x is an assumption: the reference gives no VPU figure for them.
_MXU_TO_VPU = 30.0
# Fitted to measured MaxText runs on v5e (docs/validation.md, validation/maxtext.py):
# the 12 odd-indexed usable v5e runs of docs/reference/maxtext_runs.json (the 2023 v5e-256
# table, 1-32 slices), mean |log error| on a 0.01 grid; checked on the 12 even-indexed ones
# (0.77 too). Fitted with the fluid engine's max-min sharing, so compute ops beside
# collectives do not lose HBM the collectives cannot use (its history: CHANGELOG.md).
_V5E_MXU_EFFICIENCY = 0.77
# Fitted jointly with it on the same runs (seconds per DCN message, cross-slice collectives as
# 2(N-1) messages; docs/model.md "Links and collectives"); checked on the even-indexed ones.
# Those 2023 runs are rebuilt with one cross-slice all-reduce a layer (an assumption,
# docs/validation.md effect 2); counted per message it is close to v6e's fit per message of
# its per-matrix all-reduces (0.55 ms), so it is read as the DCN endpoint's cost per message,
# whatever the split (a reading that rests on that assumption, which was taken partly because
# of this agreement: with both generations per matrix the fits are 0.1 and 0.55 ms).
_V5E_DCN_MESSAGE_S = 0.5e-3


CHIPS.add(
    "v3",
    ChipSpec(
        name="v3",
        **PRESET_POWER["v3"],  # power and price: docs/model/energy.md, power_sources()
        generation_rule="full-axis",  # assumption: 2D pod like v5e; the book gives no rule
        max_pod_shape=(32, 32),  # tpu.md §1.1 "32x32 (2D)"
        mxu_flops_per_s=1.4e14,  # tpu.md §1.1 bf16
        mxu_int8_ops_per_s=1.4e14,  # tpu.md §1.1 int8
        vpu_flops_per_s=1.4e14 / _MXU_TO_VPU,  # tpu.md §1.2 ratio
        hbm_bytes=32e9,  # tpu.md §1.1 "32 GB"
        hbm_bytes_per_s=9.0e11,  # tpu.md §1.1
        ici_link_bytes_per_s=1.0e11,  # tpu.md §1.1 one-way
        ici_hop_latency_s=_HOP_LATENCY_S,
        ici_links_per_chip=4,  # tpu.md §1.1 "4 nearest neighbours in 2D tori (v2, v3, ...)"
        dcn_bytes_per_s=6.25e9,  # tpu.md §1.1 DCN egress 6.25e9 B/s per chip (generic figure)
        dcn_latency_s=_DCN_LATENCY_S,
        pcie_bytes_per_s=1.6e10,  # tpu.md §1.1 PCIe "1.6e10 B/s per chip typical"
        tensorcores_per_chip=2,  # tpu.md §1.2 "v3 and older: 2 separate devices"
        # Not fitted to this chip: v5e's fitted MXU fraction (docs/validation.md) carried over,
        # because its MXUs are the same 128x128 systolic arrays (tpu.md §1.2); no measured runs
        # of this generation were used. The roofline is `with_overrides(mxu_efficiency=1.0)`.
        mxu_efficiency=_V5E_MXU_EFFICIENCY,
    ),
)
CHIPS.add(
    "v4",
    ChipSpec(
        name="v4",
        **PRESET_POWER["v4"],  # power and price: docs/model/energy.md, power_sources()
        generation_rule="cube",  # tpu.md §1.3 v4/v5p: 4x4x4 optical cubes
        max_pod_shape=(16, 16, 16),  # tpu.md §1.1 / §1.3 "16x16x16 for v4"
        mxu_flops_per_s=2.75e14,  # tpu.md §1.1 bf16
        mxu_int8_ops_per_s=2.75e14,  # tpu.md §1.1 int8
        vpu_flops_per_s=2.75e14 / _MXU_TO_VPU,  # tpu.md §1.2 ratio
        hbm_bytes=32e9,  # tpu.md §1.1 "32 GB"
        hbm_bytes_per_s=1.2e12,  # tpu.md §1.1 (1.23e12 in one worked answer, §7 item 9)
        ici_link_bytes_per_s=4.5e10,  # tpu.md §1.1 one-way
        ici_hop_latency_s=_HOP_LATENCY_S,
        ici_links_per_chip=6,  # tpu.md §1.1 "6 in 3D tori (v4, v5p)"
        dcn_bytes_per_s=6.25e9,  # tpu.md §1.1 DCN egress per chip (generic figure)
        dcn_latency_s=_DCN_LATENCY_S,
        pcie_bytes_per_s=1.6e10,  # tpu.md §1.1 "v4 is 16 GB/s each way"
        tensorcores_per_chip=2,  # tpu.md §1.2 megacore
        # Not fitted to this chip: v5e's fitted MXU fraction (docs/validation.md) carried over,
        # because its MXUs are the same 128x128 systolic arrays (tpu.md §1.2); no measured runs
        # of this generation were used. The roofline is `with_overrides(mxu_efficiency=1.0)`.
        mxu_efficiency=_V5E_MXU_EFFICIENCY,
    ),
)
CHIPS.add(
    "v5e",
    ChipSpec(
        name="v5e",
        **PRESET_POWER["v5e"],  # power and price: docs/model/energy.md, power_sources()
        generation_rule="full-axis",  # tpu.md §1.3 "an axis wraps only if its length is 16"
        max_pod_shape=(16, 16),  # tpu.md §1.1 "16x16 = 256 (2D)"
        mxu_flops_per_s=1.97e14,  # tpu.md §1.1 bf16
        mxu_int8_ops_per_s=3.94e14,  # tpu.md §1.1 int8
        # tpu.md §1.2: 8 sublanes x 128 lanes x 4 ALUs per core at 1.5 GHz, 1 core.
        vpu_flops_per_s=8 * 128 * 4 * 1.5e9,
        hbm_bytes=16e9,  # tpu.md §1.1 "16 GB"
        hbm_bytes_per_s=8.2e11,  # tpu.md §1.1
        ici_link_bytes_per_s=4.5e10,  # tpu.md §1.1 one-way
        ici_hop_latency_s=_HOP_LATENCY_S,
        ici_links_per_chip=4,  # tpu.md §1.1 2D torus
        dcn_bytes_per_s=3.125e9,  # tpu.md §1.1 "3.125e9 per chip on v5e"
        dcn_latency_s=_DCN_LATENCY_S,
        pcie_bytes_per_s=1.6e10,  # tpu.md §1.1
        tensorcores_per_chip=1,  # tpu.md §1.2 "v5e = 1"
        # Fitted to measured MaxText runs (docs/validation.md, validation/maxtext.py):
        # the achievable MXU fraction of the 2023 v5e-256 training table (fitted on the
        # odd-indexed runs; the other half of the runs, its refit and errors are in
        # docs/validation.md). HBM/ICI/DCN/VPU factors stay 1.0: the fit cannot identify them.
        mxu_efficiency=_V5E_MXU_EFFICIENCY,
        # Fitted jointly with mxu_efficiency to the same half: the 1-32-slice runs' slowdown
        # with the slice count (docs/validation.md, effect 2; docs/model.md).
        dcn_message_overhead_s=_V5E_DCN_MESSAGE_S,
        compiler=XlaCompilerSpec(
            # A recomputing attention backward holds two bf16 score-sized buffers at the score
            # gradient (the recomputed scores and the probability gradient) in every v5e program
            # of benchmarks/xla_memory.py; v5p and v6e write the score gradient too (docs/model.md
            # "Memory").
            score_grad_fusion=True,
            # With one sequence per chip the f32 logits live from the loss to the end of the
            # backward loop in every such v5e program of benchmarks/xla_memory.py (fsdp=16 none,
            # full, minimal, offload; data=2 x fsdp=8 minimal); the v5p and v6e ones free them at
            # the loss (docs/model.md "Memory").
            loss_after_backward=True,
            # With windowed gathers the MLP's recomputed tensors (its gate, up and gated product)
            # are live at the attention backward's score gradient in every full and minimal v5e
            # program of benchmarks/xla_memory.py; v6e's seq-2048 two-sequence ones free them
            # first (docs/model.md "Memory").
            mlp_grad_after_attention=True,
        ),
    ),
)
CHIPS.add(
    "v5p",
    ChipSpec(
        name="v5p",
        **PRESET_POWER["v5p"],  # power and price: docs/model/energy.md, power_sources()
        generation_rule="cube",  # tpu.md §1.3
        max_pod_shape=(16, 20, 28),  # tpu.md §1.1 "16x20x28 = 8960 (3D)"
        mxu_flops_per_s=4.59e14,  # tpu.md §1.1 bf16
        mxu_int8_ops_per_s=9.18e14,  # tpu.md §1.1 int8
        # tpu.md §1.2: 8·128·4·1.75e9 ≈ 7e12 FLOP/s per core, 2 cores per chip.
        vpu_flops_per_s=2 * 8 * 128 * 4 * 1.75e9,
        hbm_bytes=96e9,  # tpu.md §1.1 "96 GB"
        hbm_bytes_per_s=2.8e12,  # tpu.md §1.1
        ici_link_bytes_per_s=9.0e10,  # tpu.md §1.1 one-way
        ici_hop_latency_s=_HOP_LATENCY_S,
        ici_links_per_chip=6,  # tpu.md §1.1 3D torus
        dcn_bytes_per_s=6.25e9,  # tpu.md §1.1 "6.25e9 B/s per chip (v5p ...)"
        dcn_latency_s=_DCN_LATENCY_S,
        pcie_bytes_per_s=1.6e10,  # tpu.md §1.1
        tensorcores_per_chip=2,  # tpu.md §1.2 "v5p: 2 cores"
        # Not fitted to this chip: v5e's fitted MXU fraction (docs/validation.md) carried over,
        # because its MXUs are the same 128x128 systolic arrays (tpu.md §1.2); no measured runs
        # of this generation were used. The roofline is `with_overrides(mxu_efficiency=1.0)`.
        mxu_efficiency=_V5E_MXU_EFFICIENCY,
        compiler=XlaCompilerSpec(
            # The recomputing attention backward writes the bf16 probabilities; under minimal and
            # offload in the probability-gradient matmul's fusion, live at the score gradient (4
            # score-sized buffers in v5p's minimal and offload programs of benchmarks/
            # xla_memory.py, 3 in its full programs; docs/model.md "Memory").
            bwd_probs_buffer=True,
        ),
    ),
)
CHIPS.add(
    "v6e",
    ChipSpec(
        name="v6e",
        **PRESET_POWER["v6e"],  # power and price: docs/model/energy.md, power_sources()
        generation_rule="full-axis",  # tpu.md §1.3 v5e and v6e: one 16x16 torus
        max_pod_shape=(16, 16),  # tpu.md §1.1
        mxu_flops_per_s=9.20e14,  # tpu.md §1.1 bf16 (MaxText uses 918, maxtext.md §5 item 9)
        mxu_int8_ops_per_s=1.84e15,  # tpu.md §1.1 int8
        vpu_flops_per_s=9.20e14 / _MXU_TO_VPU,  # tpu.md §1.2 ratio
        hbm_bytes=32e9,  # tpu.md §1.1 "32 GB"
        hbm_bytes_per_s=1.6e12,  # tpu.md §1.1
        ici_link_bytes_per_s=9.0e10,  # tpu.md §1.1 one-way
        ici_hop_latency_s=_HOP_LATENCY_S,
        ici_links_per_chip=4,  # tpu.md §1.1 2D torus
        dcn_bytes_per_s=1.25e10,  # tpu.md §1.1 "1.25e10 per chip on v6e"
        dcn_latency_s=_DCN_LATENCY_S,
        pcie_bytes_per_s=3.2e10,  # tpu.md §1.1 "3.2e10 on v6e"
        # tpu.md §1.2 leaves v6e ambiguous; Google Cloud's v6e page lists one TensorCore per chip.
        tensorcores_per_chip=1,
        mxu_dim=256,  # tpu.md §1.2 "128x128 systolic array (256x256 on v6e)"
        # Fitted to measured MaxText runs (docs/validation.md, validation/maxtext.py):
        # the achievable MXU fraction of the tpu-recipes v6e training runs (the 12 odd-indexed
        # usable v6e runs of docs/reference/maxtext_runs.json, mean |log error| on a 0.01
        # grid), with attention's head_dim-128 matmuls at half rate on the 256-wide MXU
        # (mxu_dim); the held-out even-indexed half and its refit are in docs/validation.md.
        # HBM/ICI/DCN/VPU factors stay 1.0: the fit cannot identify them. Fitted with the
        # fluid engine's max-min sharing, the runs' f32 weights, XLA's per-matrix gradient
        # collectives (`--fsdp-grad auto`: synchronous whole-gradient all-reduces over FSDP
        # groups of more than 32 chips) and per-matrix cross-slice all-reduces, with every
        # compute op streaming HBM at its own pace beside the collectives' DMA (docs/model/
        # training.md "HBM"); the even half gives 0.63 (the factor's history: CHANGELOG.md).
        mxu_efficiency=0.64,
        # Fitted to the slice-count slowdown of the odd half's data-parallel multi-slice run
        # (Gemma-3 12B over 2 v6e-256 slices against its 1-slice run; seconds per DCN message,
        # cross-slice collectives as 2(N-1) messages, the data-parallel gradient reduction as
        # one all-reduce per weight matrix and one for the norm scales, 8 a layer here:
        # docs/model.md "Links and collectives"), on a 0.05 ms grid, with mxu_efficiency held
        # at its fit; checked on the even half's 4-slice run, whose own fit gives 0.4 ms
        # (docs/validation.md, effect 6). 3.5 ms when it was one all-reduce a layer.
        dcn_message_overhead_s=0.55e-3,
        compiler=XlaCompilerSpec(
            # The forward's score matmul, mask, max, subtract, exp and row sum are one output
            # fusion in every v6e program of benchmarks/xla_memory.py (none, full, minimal,
            # offload); v5e's and v5p's write the f32 scores first (docs/model.md "Memory").
            score_exp_fusion=True,
            # The output projection's weight-gradient ring runs after the backward loop, keeping
            # the bf16 logit gradients, in the windowed fsdp=16 v6e programs of
            # benchmarks/xla_memory.py with f32 weights cast to bf16 (full, minimal); v5e's with
            # f32 weights and v6e's with bf16 weights (none, full, minimal) run it before the loop
            # (docs/model.md "Memory").
            head_grad_after_backward=True,
        ),
    ),
)
CHIPS.add(
    "tpu7x",
    ChipSpec(
        name="tpu7x",
        **PRESET_POWER["tpu7x"],  # power and price: docs/model/energy.md, power_sources()
        # Assumption: tpu.md §7 says the book describes no TPU7x torus; we treat it like v5p.
        generation_rule="cube",
        max_pod_shape=(4, 4, 576),  # tpu.md §1.1 "4x4x576 (3D shape)"
        mxu_flops_per_s=2.30e15,  # tpu.md §1.1 bf16
        mxu_int8_ops_per_s=4.61e15,  # tpu.md §1.1 int8
        vpu_flops_per_s=2.30e15 / _MXU_TO_VPU,  # tpu.md §1.2 ratio
        hbm_bytes=192e9,  # tpu.md §1.1 "192 GB"
        hbm_bytes_per_s=7.4e12,  # tpu.md §1.1
        ici_link_bytes_per_s=9.0e10,  # tpu.md §1.1 one-way
        ici_hop_latency_s=_HOP_LATENCY_S,
        ici_links_per_chip=6,  # tpu.md §1.1 3D torus
        dcn_bytes_per_s=1.25e10,  # tpu.md §1.1 "1.25e10 per chip on v6e and TPU7x"
        dcn_latency_s=_DCN_LATENCY_S,
        pcie_bytes_per_s=1.6e10,  # tpu.md §1.1 typical figure
        tensorcores_per_chip=2,  # tpu.md §1.2 "TPU7x: 2 cores joined by a high-bandwidth link"
        # Assumption: v6e's 256x256 MXUs (tpu.md §1.2 states the size for v6e only).
        mxu_dim=256,
    ),
)


# Where each preset's efficiency factors come from (`tpusim presets` shows it). Kinds: `fitted`
# (to measured runs, with the held-out check), `carried over` (another generation's fit, applied
# by assumption), `assumed` (the textbook's roofline, 1.0, or no overhead: nothing identifies it).
# The source of a value set by hand: it names the overrides (`set`), which the CLI writes as
# its flag (`presets` renders it).
_GIVEN = Said(TpusimError("set by a chip file or {set}, not a preset value", "set"))
EFFICIENCY_FIELDS = ("mxu_efficiency", "vpu_efficiency", "hbm_efficiency", "ici_efficiency",
                     "dcn_efficiency", "op_overhead_s", "dcn_message_overhead_s")
_ROOFLINE = ("assumed", "1.0, the textbook's roofline (tpu.md); the measured MaxText runs "
             "(docs/validation.md) cannot identify this factor separately")
_NO_OVERHEAD = ("assumed", "0: no fixed per-op cost beyond the roofline (tpu.md)")
_NO_DCN_OVERHEAD = ("assumed", "0: no per-message DCN cost beyond the latency (tpu.md); no "
                    "measured data-parallel multi-slice runs of this generation identify it")
_OVERHEADS = {"op_overhead_s": _NO_OVERHEAD, "dcn_message_overhead_s": _NO_DCN_OVERHEAD}
_CARRIED = ("carried over", "v5e's fitted MXU fraction: same 128x128 MXUs (tpu.md §1.2); no "
            "measured runs of this generation were used")
_FITTED: dict[str, dict[str, tuple[str, str]]] = {
    "v5e": {"mxu_efficiency": (
        "fitted", "jointly with dcn_message_overhead_s to the odd-indexed half (12 runs) of the "
        "measured v5e MaxText runs (docs/validation.md, validation/maxtext.py); held "
        "out: the even half, its refit and its errors are in docs/validation.md"),
        "dcn_message_overhead_s": (
        "fitted", "jointly with mxu_efficiency to the odd-indexed half of the measured v5e "
        "MaxText runs, whose 1-32 slices are data parallel over DCN, rebuilt with one "
        "cross-slice all-reduce a layer (docs/validation.md, effect 2); held out: the even "
        "half")},
    "v6e": {"mxu_efficiency": (
        # Names the setting `fsdp_grad` (a Said, which `tpusim presets` writes as its flag).
        "fitted", Said(TpusimError(
            "to the odd-indexed half (12 runs) of the measured v6e MaxText runs, with "
            "head_dim-128 attention at half rate on the 256-wide MXU and XLA's per-matrix "
            "gradient collectives ({fsdp_grad} auto; docs/validation.md, effect 7, "
            "validation/maxtext.py); held out: the even half, its refit and its errors are "
            "in docs/validation.md", "fsdp_grad"))),
        "dcn_message_overhead_s": (
        "fitted", "to the slice-count slowdown (step over the same run's 1-slice step) of the "
        "odd-indexed half's data-parallel multi-slice v6e run, the Gemma-3 12B over 2 slices, "
        "per message of the per-matrix cross-slice all-reduces (8 a layer), with "
        "mxu_efficiency held at its fit: on step times it would also absorb the Gemma runs' "
        "common offset (docs/validation.md, effect 6); held out: the 4-slice run, whose own "
        "fit gives 0.4 ms")},
    "v3": {"mxu_efficiency": _CARRIED},
    "v4": {"mxu_efficiency": _CARRIED},
    "v5p": {"mxu_efficiency": _CARRIED},
}


def efficiency_sources(chip: ChipSpec) -> dict[str, dict[str, Any]]:
    """{field: {"value", "kind", "source"}} for every efficiency factor and the op overhead.

    A preset's factors are `fitted`, `carried over` or `assumed`; a factor that differs from
    the preset of the same name (a chip file or the `set` overrides) is `given`.
    """
    preset = CHIPS.get(chip.name) if chip.name in CHIPS else None
    out = {}
    for f in EFFICIENCY_FIELDS:
        value = getattr(chip, f)
        if preset is None or getattr(preset, f) != value:
            kind, source = "given", _GIVEN
        else:
            default = _OVERHEADS.get(f, _ROOFLINE)
            kind, source = _FITTED.get(chip.name, {}).get(f, default)
        out[f] = {"value": value, "kind": kind, "source": source}
    return out


def power_sources(chip: ChipSpec) -> dict[str, dict[str, Any]]:
    """{field: {"value", "kind", "source"}} for every power and price field.

    Kinds: `measured` (power.md's measured chip power), `fitted` (to a measured figure, with
    what it is checked on), `estimate` (derived from a published efficiency ratio or carried
    over from another generation), `published` (read off a published figure), `assumed` (no
    public figure; why is said), `list price`;
    a value that differs from the preset of the same name is `given`.
    """
    preset = CHIPS.get(chip.name) if chip.name in CHIPS else None
    name = chip.name
    out = {}
    for f in POWER_FIELDS:
        value = getattr(chip, f)
        if preset is None or getattr(preset, f) != value:
            kind, source = "given", _GIVEN
        elif f == "usd_per_chip_hour":
            kind, source = (("list price", "Google Cloud on-demand list price per chip-hour "
                             "(power.md); prices change") if value is not None else
                            ("assumed", "no reliable public list price (power.md): cost "
                             "fields are null; set usd_per_chip_hour"))
        elif name in MEASURED_POWER_W and f == "idle_power_w":
            kind, source = "measured", f"the measured minimum chip power, {value:g} W (power.md)"
        elif name in MEASURED_POWER_W and f == "mxu_j_per_flop":
            lo, mean, hi = MEASURED_POWER_W[name]
            kind, source = "fitted", (
                f"so that the chip at its roofline (MXU at its bf16 peak, HBM at full "
                f"bandwidth) draws the measured maximum, {hi:g} W (power.md); checked on the "
                f"measured mean, {mean:g} W, which a heavy training step lands near "
                f"(docs/validation.md)")
        elif name in POWER_DERIVATION and f in ("mxu_j_per_flop", "hbm_j_per_byte",
                                                 "idle_power_w"):
            base, ratio = POWER_DERIVATION[name]
            why = (f"{ratio:g}x {base}'s performance per watt (power.md)" if ratio != 1.0 else
                   f"{base}'s FLOPs per joule carried over: no public power figure or ratio")
            kind, source = "estimate", (
                f"derived: at the roofline this chip does {why}, split into static, MXU and "
                f"HBM power in {base}'s proportions (assumed)")
        elif f in ("host_power_share", "pue"):
            kind, source = "published", POWER_ASSUMED[f]
        else:
            kind, source = "assumed", POWER_ASSUMED.get(f, "")
        out[f] = {"value": value, "kind": kind, "source": source}
    return out


def get_chip(name: str) -> ChipSpec:
    """A preset by name (`v5e`, `v5p`, ...); `v4p` is accepted for `v4`."""
    if name.lower() == "v4p":
        name = "v4"
    return CHIPS.get(name)



def chip_from_dict(data: dict[str, Any], *, source: str = "chip YAML") -> ChipSpec:
    """Build a `ChipSpec` from a mapping; `base: <preset>` starts from a preset.

    Unknown keys are errors that list the allowed ones.
    """
    if not isinstance(data, dict):
        raise TpusimError(
            f"{source}: expected a mapping of ChipSpec fields, got {type(data).__name__}; "
            f"write `key: value` lines such as `hbm_bytes_per_s: 1.6e12`"
        )
    data = dict(data)
    base_name = data.pop("base", None)
    allowed = set(CHIP_FIELDS)
    unknown = sorted(k[:40] if isinstance(k, str) else short_repr(k, 40) for k in data
                     if not isinstance(k, str) or k not in allowed)[:5]
    if unknown:
        raise TpusimError(
            f"{source}: unknown key(s) {', '.join(unknown)}; "
            f"{one_of(unknown[0], ('base', *CHIP_FIELDS), listing=CHIP_KEYS_LISTING)}",
            CHIP_KEYS_CALL
        )
    if "max_pod_shape" in data:
        shape = data["max_pod_shape"]
        if isinstance(shape, str):
            parts = shape.lower().split("x")
            if not all(p.strip().isdigit() and len(p.strip()) <= 6 for p in parts):
                raise TpusimError(
                    f"{source}: max_pod_shape {short_repr(shape)} is not like 16x16"
                )
            shape = [int(p) for p in parts]
        if not isinstance(shape, (list, tuple)):
            raise TpusimError(f"{source}: max_pod_shape must be a list like [16, 16]")
        data["max_pod_shape"] = tuple(shape)
    base = None
    if base_name is not None:
        if not isinstance(base_name, str):
            raise TpusimError(
                f"{source}: base = {short_repr(base_name)} is not a preset name; "
                f"{one_of(base_name, CHIPS.names())}"
            )
        base = get_chip(base_name)
    for key, value in data.items():
        if key in ("name", "generation_rule", "max_pod_shape"):
            continue
        if key in NULLABLE_CHIP_FIELDS and value is None:
            continue
        if key in CHIP_BOOL_FIELDS:
            if not isinstance(value, bool):
                raise TpusimError(f"{source}: {key} = {short_repr(value)} must be true or false")
            continue
        lo, hi, lo_open, integer, why = FIELD_RANGES[key]
        if isinstance(value, str):
            # Text as `--set` reads it: `918T`, `180GB/s`, `2us`, or `x2` of the base preset.
            value = _quantity(source, key, value, base, integer)
        data[key] = number(value, f"{source}: {key}", lo=lo, hi=hi, lo_open=lo_open,
                           integer=integer, fix=why)
    if base is not None:
        data.setdefault("name", f"{base.name}-custom")
        return base.with_overrides(**data)
    missing = [
        f.name
        for f in dataclasses.fields(ChipSpec)
        if f.name not in data and f.default is dataclasses.MISSING
    ]
    if missing:
        raise TpusimError(
            f"{source}: missing key(s) {', '.join(missing)}; give them, or start from a preset "
            f"with `base: v5e`"
        )
    rules = {k: data.pop(k) for k in CHIP_BOOL_FIELDS if k in data}
    try:
        return ChipSpec(**data, compiler=XlaCompilerSpec(**rules))
    except TypeError as exc:  # pragma: no cover - guarded by the checks above
        raise TpusimError(f"{source}: {exc}") from None


def _quantity(source: str, key: str, text: str, base: ChipSpec | None, integer: bool) -> Any:
    """A chip file's text value read by the overrides' parser (`topologies.quantities`): a
    number, a number with a unit, or `xF` of the `base:` preset's value."""
    what = f"{source}: {key} = {short_repr(text)}"
    q = parse_quantity(what, key, text, base_word="the base preset")
    if q.multiplier is None:
        return q.value
    base_value = None if base is None else getattr(base, key)
    if not isinstance(base_value, (int, float)) or isinstance(base_value, bool):
        raise TpusimError(
            f"{what}: a multiplier needs a base preset with a numeric {key}"
            + ("; add `base: v5e` (or another preset) or give an absolute value" if base is None
               else f" ({base.name}'s is {base_value!r}); give an absolute value"))
    v = q.resolve(base_value)
    if integer and not float(v).is_integer():
        raise TpusimError(f"{what}: {base_value} x {q.multiplier:g} = {v:g} is not a whole "
                          f"number; {key} counts whole units")
    return int(v) if integer else float(v)


def load_chip(name_or_path: str) -> ChipSpec:
    """A preset name, or a YAML file of ChipSpec fields (see `chip_from_dict`)."""
    if name_or_path.lower() in CHIPS or name_or_path.lower() == "v4p":
        return get_chip(name_or_path)
    path = Path(name_or_path)
    if path.suffix.lower() not in (".yaml", ".yml", ".json") and not path.exists():
        CHIPS.get(name_or_path)  # raises the "unknown chip" error listing presets
    # deferred: PyYAML (topologies.yamlio) loads only when a chip file is read, not at start-up
    from topologies.yamlio import read_yaml_mapping

    return chip_from_dict(read_yaml_mapping(path, what="chip"), source=f"chip file {path}")
