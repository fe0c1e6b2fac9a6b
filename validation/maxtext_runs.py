"""The measured MaxText runs as tpusim cases: reads `docs/reference/maxtext_runs.json` (public
MaxText / tpu-recipes measurements, see `maxtext.md` beside it) and rebuilds every usable run in
the simulator's terms (model from its stored dims, mesh from its parallelism, the slice, the
number of slices, the remat policy, the compiler settings of its generation), with the compiled
trace of each. The fit and the validation document built on them are `validation.maxtext`;
`validation.xla_moe_pair` reads the same cases.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from sim.chips import get_chip
from topologies.errors import TpusimError
from topologies.mesh import parse_mesh
from topologies.slices import SLICES, resolve_topology
from workloads.models import TransformerSpec
from workloads.moe import MoeConfig
from workloads.training import Remat, TrainingConfig, compile_training_step
from workloads.zoo import model_from_dict

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_DIR = ROOT / "docs" / "reference"
RUNS_FILE = REFERENCE_DIR / "maxtext_runs.json"
GENERATIONS = ("v5e", "v6e")


# MaxText `mlp_activations` -> tpusim MLP kind (maxtext.md §2; a second "linear" entry is the
# up projection of a gated MLP).
_MLP_KINDS = {
    ("relu",): "relu",
    ("gelu",): "gelu",
    ("silu", "linear"): "swiglu",
    ("gelu", "linear"): "geglu",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    """One measured MaxText run, expressed in the simulator's terms."""

    id: str
    index: int  # position among this generation's usable cases (file order); drives the split
    chip: str
    slice_name: str
    num_slices: int
    model: TransformerSpec
    mesh: str
    dcn: str
    remat: Remat
    axis_map: str = ""  # `--axis-map` of a MaxText custom device order ("" = default placement)
    maxtext_remat: str
    seq_len: int
    batch_per_chip: int
    measured_step_s: float
    measured_tokens_s: float
    step_source: str  # "log" (printed step time) or "derived" (from MFU / TFLOP/s)
    quality: str
    notes: tuple[str, ...] = ()
    capacity_factor: float | None = None  # MoE dropping path (None: dropless / dense model)
    # XLA overlaps the data-parallel gradient all-reduce only with the recipes'
    # DATA_PARALLEL_OVERLAP flags; without them it blocks the next layer's backward.
    dp_allreduce: str = "blocking"
    vocab_tiling: int = 1  # MaxText's num_vocab_tiling (the Gemma-3 recipes: 16)
    optimizer: str = "adam"  # MaxText's opt_type: adamw (every run but the 750B MoE) or sgd
    # MaxText's weight_dtype (`params_dtype_for`): f32 master weights, cast to bf16 (its
    # dtype) before they are gathered, on nearly every run; bf16 on a few.
    param_dtype: str = "fp32"
    # FSDP weight gradients (`FSDP_GRAD`): XLA's choice per matrix on the current-compiler
    # (v6e) runs (`--fsdp-grad auto`), async reduce-scatters on the 2023 v5e runs; the other
    # forms as what-ifs (effect 7).
    fsdp_grad: str = "reduce-scatter"
    # How the data-parallel gradient reduction crosses slices (`DP_GRAD_SPLIT`).
    dp_grad_split: str = "per-matrix"

    @property
    def low_quality(self) -> bool:
        return self.quality == "low"

    @property
    def fit_subset(self) -> bool:
        """Odd-indexed, non-low cases fit the factors; the even-indexed ones are held out."""
        return not self.low_quality and self.index % 2 == 1

    @property
    def model_label(self) -> str:
        return self.model.name

    @property
    def mesh_label(self) -> str:
        return self.mesh + (f" dcn {self.dcn}" if self.dcn else "") + (
            f" axis-map {self.axis_map}" if self.axis_map else "")


@dataclass(frozen=True, slots=True, kw_only=True)
class Skip:
    id: str
    chip: str
    quality: str
    reason: str



# ---- reading the reference -------------------------------------------------------------------


def model_for(raw: dict) -> TransformerSpec | str:
    """The case's model as a `TransformerSpec`, or the reason it cannot be expressed."""
    m = raw["model"]
    pattern = m.get("attention_pattern") or {}
    if pattern and pattern.get("kind") != "sliding_window_mixed":
        return f"attention pattern {pattern.get('kind')!r} has no tpusim equivalent"
    acts = tuple(m.get("mlp_activations") or ())
    if acts not in _MLP_KINDS:
        return f"MLP activations {list(acts)} have no tpusim MLP kind"
    spec = {
        "name": m["name"].split(" ")[0] if m["name"].startswith("maxtext-default") else m["name"],
        "num_layers": m["num_layers"],
        "d_model": m["emb_dim"],
        "num_heads": m["num_query_heads"],
        "num_kv_heads": m["num_kv_heads"],
        "head_dim": m["head_dim"],
        "d_ff": m["mlp_dim"],
        "mlp": _MLP_KINDS[acts],
        "vocab_size": m["vocab_size"],
        "tied_embeddings": bool(m.get("tied_embeddings", False)),
        "parallel_block": bool(m.get("parallel_attn_mlp_block", False)),
    }
    if m["name"].startswith("maxtext-default"):
        spec["name"] = "maxtext-" + m["name"].split("~")[-1].rstrip(")").lower()
    if m.get("sliding_window_size"):
        # Local layers attend to a causal sliding window; the last layer of every `period`
        # is global (MaxText's gemma3 decoder: 5 local per global, the 6th global).
        spec["attention_window"] = m["sliding_window_size"]
        spec["global_layer_period"] = pattern.get("period", 0)
    if m.get("decoder_block") == "gemma3":
        # MaxText's gemma3 decoder layer: pre- and post-norms around both sublayers, and
        # RMSNorms of the queries and keys (the record's note).
        spec["post_norms"] = spec["qk_norm"] = True
    if m.get("num_experts"):
        spec["num_experts"] = m["num_experts"]
        spec["experts_per_token"] = m["num_experts_per_tok"]
    try:
        return model_from_dict(spec, source=f"case {raw['id']}")
    except TpusimError as exc:
        return f"model not expressible: {exc}"


def mesh_for(raw: dict) -> tuple[str, str, str] | str:
    """(ICI mesh, DCN mesh, axis map) strings for `parse_mesh`, or the reason there is none."""
    par = raw.get("parallelism") or {}
    ici: dict[str, int] = {}
    dcn: dict[str, int] = {}
    known = {
        "ici_fsdp_parallelism": (ici, "fsdp"),
        "ici_fsdp_transpose_parallelism": (ici, "fsdp"),
        "ici_tensor_parallelism": (ici, "tensor"),
        "ici_expert_parallelism": (ici, "expert"),
        "ici_data_parallelism": (ici, "data"),
        "dcn_data_parallelism": (dcn, "data"),
        "dcn_fsdp_parallelism": (dcn, "fsdp"),
    }
    for key, value in par.items():
        if key in known:
            if not isinstance(value, int) or value < 1:
                return f"parallelism {key}={value!r} is not a size"
            target, axis = known[key]
            target[axis] = target.get(axis, 1) * value
        elif key.endswith("_parallelism") and value not in (1, None):
            return f"parallelism {key}={value} has no tpusim mesh axis"
    slices = int(raw.get("slices") or 1)
    if "dcn" in par and slices > 1 and "dcn_data_parallelism" not in par:
        dcn["data"] = slices  # "presumably data parallel (not stated)"
    chips = raw["hardware"].get("chips_per_slice")
    n_ici = math.prod(ici.values()) if ici else 0
    if not ici or chips is None or n_ici != chips:
        return (f"parallelism {par.get('note') or par} does not cover the {chips} chips of the "
                f"slice")
    if math.prod(dcn.values() or [1]) != slices:
        return f"DCN parallelism {dcn} does not match {slices} slices"
    order = ("data", "fsdp", "expert", "tensor")
    fmt = lambda d: ",".join(f"{a}={d[a]}" for a in order if d.get(a, 1) > 1)  # noqa: E731
    axis_map = custom_mesh_axis_map(par.get("custom_mesh"), ici)
    if axis_map.startswith("!"):
        return axis_map[1:]
    return fmt(ici) or f"fsdp={chips}", fmt(dcn), axis_map


# MaxText's custom device orders for a 16x16 slice (`maxtext.utils.max_utils.
# reshape_mesh_to_rings`): `hybrid_ring_64x4` makes the size-4 mesh axis a 2x2 block of chips
# (a ring of 4 using both torus axes) and the size-64 axis the 8x8 grid of those blocks;
# `hybrid_ring_32x8` the size-8 axis a 2x4 block and the size-32 axis the 8x4 grid of blocks.
_CUSTOM_MESHES = {"hybrid_ring_64x4": (4, "x:2+y:2", 64, "x:8+y:8"),
                  "hybrid_ring_32x8": (8, "x:4+y:2", 32, "x:4+y:8")}


def custom_mesh_axis_map(name: str | None, ici: dict[str, int]) -> str:
    """`--axis-map` text reproducing a MaxText custom mesh ("" for none; "!reason" if it does
    not apply to the run's axes)."""
    if not name:
        return ""
    if name not in _CUSTOM_MESHES:
        return f"!custom mesh {name!r} has no tpusim placement"
    ring, ring_map, grid, grid_map = _CUSTOM_MESHES[name]
    big = {a: v for a, v in ici.items() if v > 1}
    by_size = {v: a for a, v in big.items()}
    if sorted(big.values()) != sorted((ring, grid)) or len(by_size) != 2:
        return f"!custom mesh {name} needs ICI axes of {grid} and {ring}, the run has {ici}"
    return f"{by_size[ring]}={ring_map},{by_size[grid]}={grid_map}"


# The shipped mapping of the recipes' custom policies (each to the tpusim policy that names
# what it offloads); the fit's remat check replaces it by one policy for all of them.
NAMED = "named"


def remat_for(text: str, custom: Remat | None = None) -> Remat:
    """MaxText remat policy -> tpusim Remat (see docs/validation.md, "Remat mapping").

    `full` and `minimal` map directly. The tpu-recipes' `custom` policies offload the
    decoder-layer input and the outputs of the named projections to host memory and
    *rematerialise the rest*: with query/key/value (and out) projections named they are
    `Remat.QKV_OFFLOAD` (`Remat.QKVO_OFFLOAD`), as is MaxText's `qkv_proj_offloaded`; a custom
    policy naming only the layer input, or keeping the projections rematerialised, is
    `Remat.FULL`. `custom` (the fit's remat check) maps every custom / qkv_proj_offloaded
    policy to that one policy instead.
    """
    t = text.strip().lower()
    if t.startswith("minimal"):
        return Remat.MINIMAL
    if not t.startswith(("custom", "qkv_proj")):
        return Remat.FULL
    if custom is not None:
        return custom
    if t.startswith("qkv_proj_offloaded"):
        return Remat.QKV_OFFLOAD
    if "projections rematerialized" in t or not any(
            k in t for k in ("query_proj", "q/k/v", "query/key/value")):
        return Remat.FULL
    if any(k in t for k in ("out_proj", "q/k/v/out")):
        return Remat.QKVO_OFFLOAD
    return Remat.QKV_OFFLOAD


# How each generation's runs reduce their FSDP weight gradients. v6e (tpu-recipes runs of
# 2024-2025, the compiler era of jax/libtpu 0.10.2): XLA's choice per matrix (`--fsdp-grad
# auto`), as every deviceless compile of such a program shows (docs/model.md). v5e (the 2023
# table): async reduce-scatters; the same rule on these runs worsens both halves' fits (effect
# 7), and no 2023 program can be compiled to see what that compiler did.
FSDP_GRAD = {"v5e": "reduce-scatter", "v6e": "auto"}
# How each generation's runs send their data-parallel gradient reduction across slices. v6e:
# one all-reduce per weight matrix and one for the norm scales, as jax/libtpu 0.10.2 compiles
# a 2-slice step (`validation/xla_dcn_schedule.py`). v5e (2023): one all-reduce a layer, an
# assumption (effect 2 gives the reasons and the per-matrix alternative's numbers); today's
# compiler splits it on v5e too.
DP_GRAD_SPLIT = {"v5e": "per-layer", "v6e": "per-matrix"}


def load_cases(
    path: Path = RUNS_FILE, *, custom_remat: Remat | None = None
) -> tuple[list[Case], list[Skip]]:
    """Every v5e / v6e training run of the reference file, as usable cases or skips.

    `custom_remat` is the tpusim policy used for MaxText's custom / qkv_proj_offloaded policies
    (None: the named mapping of `remat_for`; the fit's remat check tries the alternatives).
    """
    raws = json.loads(path.read_text())
    cases: list[Case] = []
    skips: list[Skip] = []
    counters = dict.fromkeys(GENERATIONS, 0)
    for raw in raws:
        chip = raw["hardware"]["tpu"]
        cid = raw["id"]
        quality = raw.get("quality", "")
        if chip not in GENERATIONS:
            skips.append(Skip(id=cid, chip=chip, quality=quality, reason="not v5e/v6e"))
            continue
        if raw.get("kind") != "training":
            skips.append(Skip(id=cid, chip=chip, quality=quality,
                              reason=f"{raw.get('kind')} run, not a training step"))
            continue
        batch = raw.get("batch") or {}
        pdbs, seq = batch.get("per_device_batch_size"), batch.get("seq_len")
        if not pdbs or not seq:
            skips.append(Skip(id=cid, chip=chip, quality=quality,
                              reason="no per-device batch / sequence length published "
                                     "(MFU only)"))
            continue
        model = model_for(raw)
        if isinstance(model, str):
            skips.append(Skip(id=cid, chip=chip, quality=quality, reason=model))
            continue
        mesh = mesh_for(raw)
        if isinstance(mesh, str):
            skips.append(Skip(id=cid, chip=chip, quality=quality, reason=mesh))
            continue
        meas = raw.get("measured") or {}
        acct = raw.get("maxtext_flop_accounting") or {}
        step = meas.get("step_time_s")
        source = "log"
        if not step:
            step = acct.get("implied_step_time_s")
            source = "derived"
        if not step:
            skips.append(Skip(id=cid, chip=chip, quality=quality,
                              reason="no step time (logged or derivable)"))
            continue
        notes = []
        slices = int(raw.get("slices") or 1)
        tok_s = pdbs * seq / step
        cf = raw["model"].get("capacity_factor")
        moe = raw.get("other_settings", {}).get("moe", "")
        if "capacity_factor" in moe and cf is None:
            cf = float(moe.split("capacity_factor=")[1].split(",")[0])
        if cf:
            notes.append(f"MoE capacity factor {cf}, dense one-hot dispatch (simulated)")
        sgd = raw.get("other_settings", {}).get("opt_type", "").startswith("sgd")
        if sgd:
            notes.append("SGD optimizer (simulated: no optimizer state) and bf16 weights")
        if raw["model"].get("learned_position_embedding_size"):
            notes.append("learned position embedding and biases not modelled")
        if source == "derived":
            notes.append("step time derived from MFU/TFLOP/s with the era's FLOP formula")
        if "dcn" in (raw.get("parallelism") or {}):
            notes.append("DCN axis assumed data-parallel (not stated)")
        if meas.get("tokens_per_sec_per_chip") and source == "derived":
            notes.append(f"published {meas['tokens_per_sec_per_chip']} tok/s/chip disagrees "
                         f"with its MFU (maxtext.md §5 item 6)")
        rem_text = raw.get("remat") or ""
        flags = str(raw.get("other_settings", {}).get("xla_flags", ""))
        dp_allreduce = "async" if "DATA_PARALLEL_OVERLAP" in flags else "blocking"
        cases.append(Case(
            id=cid, index=counters[chip], chip=chip,
            slice_name=raw["hardware"]["slice"], num_slices=slices, model=model,
            mesh=mesh[0], dcn=mesh[1], axis_map=mesh[2],
            remat=remat_for(rem_text, custom_remat),
            maxtext_remat=rem_text.split(" ")[0], seq_len=int(seq), batch_per_chip=int(pdbs),
            measured_step_s=float(step), measured_tokens_s=float(tok_s), step_source=source,
            quality=quality, notes=tuple(notes), capacity_factor=float(cf) if cf else None,
            dp_allreduce=dp_allreduce, fsdp_grad=FSDP_GRAD[chip],
            dp_grad_split=DP_GRAD_SPLIT[chip],
            vocab_tiling=int(raw.get("other_settings", {}).get("num_vocab_tiling") or 1),
            optimizer="sgd" if sgd else "adam", param_dtype=params_dtype_for(raw),
        ))
        if quality != "low":
            counters[chip] += 1
    # Low-quality cases get no fit/held-out index of their own (index -1 is never "fit").
    cases = [c if not c.low_quality else with_changes(c, index=-1) for c in cases]
    return cases, skips


def params_dtype_for(raw: dict) -> str:
    """tpusim's --param-dtype for a run's stored weights: its `dtype.params` (MaxText's
    weight_dtype as the reference read it), else `other_settings.weight_dtype`, else the
    `weight_dtype=` default it lists in `defaults_used`, else base.yml's default, float32."""
    text = (raw.get("dtype") or {}).get("params") \
        or (raw.get("other_settings") or {}).get("weight_dtype") \
        or next((d.split("=", 1)[1] for d in raw.get("defaults_used") or []
                 if d.startswith("weight_dtype=")), "float32")
    if text.startswith("float32"):
        return "fp32"
    if text.startswith("bfloat16"):
        return "bf16"
    raise ValueError(f"{raw['id']}: params dtype {text!r} is neither float32 nor bfloat16")


def with_changes(case: Case, **changes) -> Case:
    return dataclasses.replace(case, **changes)


# ---- compiling -------------------------------------------------------------------------------

_TRACES: dict[str, tuple] = {}


def trace_config(case: Case) -> TrainingConfig:
    """The run settings a case is rebuilt with (see the module docstring), with the compiler
    rules of its generation's preset (`ChipSpec.compiler_rules`: what XLA keeps in memory),
    as `tpusim train --chip` compiles them."""
    return TrainingConfig(**get_chip(case.chip).compiler_rules(),
                          seq_len=case.seq_len, batch_per_chip=case.batch_per_chip,
                          remat=case.remat, attention="flash",
                          moe=MoeConfig(capacity_factor=case.capacity_factor),
                          dp_allreduce=case.dp_allreduce, vocab_tiling=case.vocab_tiling,
                          optimizer=case.optimizer, param_dtype=case.param_dtype,
                          gather_dtype="bf16", fsdp_grad=case.fsdp_grad,
                          dp_grad_split=case.dp_grad_split)


def case_trace(case: Case):
    """Compiled trace and topology of a case (chip-independent, so cached across the fit)."""
    key = (case.id, str(case.remat))
    if key not in _TRACES:
        base = get_chip(case.chip)
        shape = SLICES.get(case.slice_name).shape
        topo = resolve_topology(chip_name=base.name, wrap_rule=base.generation_rule,
                                max_pod_shape=base.max_pod_shape, shape=tuple(shape),
                                num_slices=case.num_slices)
        cfg = trace_config(case)
        trace = compile_training_step(case.model, parse_mesh(case.mesh, case.dcn or None,
                                                             case.axis_map or None),
                                      topo.num_chips, cfg)
        _TRACES[key] = (trace, topo)
    return _TRACES[key]


