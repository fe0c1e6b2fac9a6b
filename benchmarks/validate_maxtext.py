"""Validate tpusim's training-step predictions against measured MaxText runs on TPU v5e / v6e.

Reads `../shared/reference/maxtext_runs.json` (public MaxText / tpu-recipes measurements, see
`maxtext.md` beside it), rebuilds every usable run in the simulator (model from its stored dims,
mesh from its parallelism, the slice, the number of slices, the remat policy), predicts the step
time under the shipped chip presets and compares it with the measured step time:

    .venv/bin/python benchmarks/validate_maxtext.py            # table + median errors
    .venv/bin/python benchmarks/validate_maxtext.py --fit      # also re-run the factor fit
    .venv/bin/python benchmarks/validate_maxtext.py --write    # fit + regenerate docs/validation.md

The error is `(predicted - measured) / measured` of the step time (tokens/s per chip is
`batch x seq / step`, so its error is the reciprocal one). Medians are of the absolute error.
Cases graded `low` by the reference are shown, but kept out of the headline medians and the fit.

The fit (`--fit`, `--write`) is a grid search per chip generation over physics knobs only
(`mxu_efficiency`, `hbm_efficiency`, `ici_efficiency`; never a per-case constant), minimising the
mean absolute log error on the odd-indexed cases of that generation (file order) and reporting
the held-out error on the even-indexed ones. The output is deterministic: no timings, no dates.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from sim.engine import replay  # noqa: E402
from sim.hardware import ChipSpec, get_chip  # noqa: E402
from topologies.errors import TpusimError  # noqa: E402
from topologies.mesh import parse_mesh  # noqa: E402
from topologies.slices import SLICES, resolve_topology  # noqa: E402
from workloads.models import TransformerSpec, model_from_dict  # noqa: E402
from workloads.training import Remat, TrainingConfig, compile_training_step  # noqa: E402

REFERENCE_DIR = ROOT.parent / "shared" / "reference"
RUNS_FILE = REFERENCE_DIR / "maxtext_runs.json"
DOC_FILE = ROOT / "docs" / "validation.md"
GENERATIONS = ("v5e", "v6e")
FIT_KNOBS = ("mxu_efficiency", "hbm_efficiency", "ici_efficiency")
TARGET_MEDIAN = 0.10

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
    maxtext_remat: str
    seq_len: int
    batch_per_chip: int
    measured_step_s: float
    measured_tokens_s: float
    step_source: str  # "log" (printed step time) or "derived" (from MFU / TFLOP/s)
    quality: str
    notes: tuple[str, ...] = ()

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
        return self.mesh + (f" dcn {self.dcn}" if self.dcn else "")


@dataclass(frozen=True, slots=True, kw_only=True)
class Skip:
    id: str
    chip: str
    quality: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Prediction:
    case: Case
    step_s: float
    fits_in_hbm: bool
    hbm_peak_gb: float
    breakdown: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_s(self) -> float:
        return self.case.batch_per_chip * self.case.seq_len / self.step_s

    @property
    def error(self) -> float:
        """Signed relative error of the predicted step time."""
        return (self.step_s - self.case.measured_step_s) / self.case.measured_step_s

    @property
    def log_error(self) -> float:
        return math.log(self.step_s / self.case.measured_step_s)


# ---- reading the reference -------------------------------------------------------------------


def _model_for(raw: dict) -> TransformerSpec | str:
    """The case's model as a `TransformerSpec`, or the reason it cannot be expressed."""
    m = raw["model"]
    if m.get("sliding_window_size") or m.get("attention_pattern"):
        return ("sliding-window / local-global attention pattern (Gemma-3: 5 of 6 layers attend "
                "to a 1024-token window); TransformerSpec has full attention only")
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
    if m.get("num_experts"):
        spec["num_experts"] = m["num_experts"]
        spec["experts_per_token"] = m["num_experts_per_tok"]
    try:
        return model_from_dict(spec, source=f"case {raw['id']}")
    except TpusimError as exc:
        return f"model not expressible: {exc}"


def _mesh_for(raw: dict) -> tuple[str, str] | str:
    """(ICI mesh, DCN mesh) strings for `parse_mesh`, or the reason there is none."""
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
    return fmt(ici) or f"fsdp={chips}", fmt(dcn)


def remat_for(text: str) -> Remat:
    """MaxText remat policy -> tpusim Remat (see docs/validation.md, "Remat mapping").

    `full` and `minimal` map directly. The `custom` / `qkv_proj_offloaded` policies of the
    tpu-recipes keep (or offload to host) only the decoder-layer input and the attention
    projections and *rematerialise the rest*, i.e. the MLP matmuls (60-80% of a layer's matmul
    FLOPs) and the attention core are recomputed in the backward pass. Their compute is therefore
    that of `Remat.FULL` (within ~10-20% of the recompute), and the host offload runs
    concurrently with compute; `Remat.FULL` is used for them.
    """
    t = text.strip().lower()
    if t.startswith("minimal"):
        return Remat.MINIMAL
    return Remat.FULL


def load_cases(path: Path = RUNS_FILE) -> tuple[list[Case], list[Skip]]:
    """Every v5e / v6e training run of the reference file, as usable cases or skips."""
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
        model = _model_for(raw)
        if isinstance(model, str):
            skips.append(Skip(id=cid, chip=chip, quality=quality, reason=model))
            continue
        mesh = _mesh_for(raw)
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
        if cf and cf != 1.0:
            notes.append(f"MoE capacity factor {cf} (tpusim computes top-k exactly, so "
                         f"{cf}x expert work is not simulated)")
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
        if rem_text.startswith(("custom", "qkv_proj")):
            notes.append("custom remat mapped to full (MLP rematerialised)")
        cases.append(Case(
            id=cid, index=counters[chip], chip=chip,
            slice_name=raw["hardware"]["slice"], num_slices=slices, model=model,
            mesh=mesh[0], dcn=mesh[1], remat=remat_for(rem_text),
            maxtext_remat=rem_text.split(" ")[0], seq_len=int(seq), batch_per_chip=int(pdbs),
            measured_step_s=float(step), measured_tokens_s=float(tok_s), step_source=source,
            quality=quality, notes=tuple(notes),
        ))
        if quality != "low":
            counters[chip] += 1
    # Low-quality cases get no fit/held-out index of their own (index -1 is never "fit").
    cases = [c if not c.low_quality else _replace(c, index=-1) for c in cases]
    return cases, skips


def _replace(case: Case, **changes) -> Case:
    import dataclasses

    return dataclasses.replace(case, **changes)


# ---- predicting -------------------------------------------------------------------------------

_TRACES: dict[str, tuple] = {}


def _trace(case: Case):
    """Compiled trace and topology of a case (chip-independent, so cached across the fit)."""
    if case.id not in _TRACES:
        base = get_chip(case.chip)
        shape = SLICES.get(case.slice_name).shape
        topo = resolve_topology(chip_name=base.name, wrap_rule=base.generation_rule,
                                max_pod_shape=base.max_pod_shape, shape=tuple(shape),
                                num_slices=case.num_slices)
        cfg = TrainingConfig(seq_len=case.seq_len, batch_per_chip=case.batch_per_chip,
                             remat=case.remat, attention="flash")
        trace = compile_training_step(case.model, parse_mesh(case.mesh, case.dcn or None),
                                      topo.num_chips, cfg)
        _TRACES[case.id] = (trace, topo)
    return _TRACES[case.id]


def predict(case: Case, chip: ChipSpec | None = None) -> Prediction:
    """Replay the case on `chip` (default: the shipped preset of its generation)."""
    chip = chip or get_chip(case.chip)
    trace, topo = _trace(case)
    r = replay(trace, chip, topo)
    return Prediction(case=case, step_s=float(r.step_time_s), fits_in_hbm=bool(r.fits_in_hbm),
                      hbm_peak_gb=float(r.hbm_peak_bytes) / 1e9,
                      breakdown={k: float(v) for k, v in r.breakdown.items()})


def predict_all(cases: list[Case], overrides: dict[str, dict] | None = None) -> list[Prediction]:
    overrides = overrides or {}
    chips = {g: get_chip(g).with_overrides(**overrides.get(g, {})) for g in GENERATIONS}
    return [predict(c, chips[c.chip]) for c in cases]


# ---- statistics -------------------------------------------------------------------------------


def median_abs(preds: list[Prediction]) -> float:
    return statistics.median(abs(p.error) for p in preds) if preds else float("nan")


def summary(preds: list[Prediction]) -> dict[str, dict[str, float]]:
    """Median absolute error by group: all usable (non-low), per generation, fit/held-out."""
    good = [p for p in preds if not p.case.low_quality]
    groups = {"all": good}
    for g in GENERATIONS:
        groups[g] = [p for p in good if p.case.chip == g]
    groups["fit subset"] = [p for p in good if p.case.fit_subset]
    groups["held out"] = [p for p in good if not p.case.fit_subset]
    for g in GENERATIONS:
        groups[f"{g} held out"] = [p for p in good if p.case.chip == g and not p.case.fit_subset]
    groups["low quality"] = [p for p in preds if p.case.low_quality]
    groups["all incl. low"] = list(preds)
    return {k: {"n": len(v), "median_abs": median_abs(v),
                "max_abs": max((abs(p.error) for p in v), default=float("nan")),
                "mean_signed": statistics.fmean(p.error for p in v) if v else float("nan")}
            for k, v in groups.items()}


# ---- output -----------------------------------------------------------------------------------


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def table_rows(preds: list[Prediction]) -> list[tuple[str, ...]]:
    rows = []
    for p in preds:
        c = p.case
        split = "low" if c.low_quality else ("fit" if c.fit_subset else "held")
        rows.append((
            c.id, c.chip, c.model_label, c.mesh_label, str(c.remat), split,
            f"{c.measured_step_s:.3f}", f"{p.step_s:.3f}", _pct(p.error),
            f"{c.measured_tokens_s:.0f}", f"{p.tokens_s:.0f}", "yes" if p.fits_in_hbm else "NO",
        ))
    return rows


HEADER = ("id", "chip", "model", "mesh", "remat", "set", "meas step s", "pred step s", "error",
          "meas tok/s/chip", "pred tok/s/chip", "fits HBM")


def print_table(preds: list[Prediction], out=sys.stdout) -> None:
    rows = [HEADER] + table_rows(preds)
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    for j, r in enumerate(rows):
        print("  ".join(v.ljust(w) if i < 6 else v.rjust(w)
                        for i, (v, w) in enumerate(zip(r, widths, strict=True))), file=out)
        if j == 0:
            print("  ".join("-" * w for w in widths), file=out)


def print_summary(stats: dict[str, dict[str, float]], out=sys.stdout) -> None:
    print("\nmedian |error| of the step time:", file=out)
    for k, v in stats.items():
        print(f"  {k:<14} n={v['n']:<3d} median {100 * v['median_abs']:5.1f}%   "
              f"max {100 * v['max_abs']:5.1f}%   mean signed {_pct(v['mean_signed'])}", file=out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, default=RUNS_FILE, help="maxtext_runs.json to use")
    ap.add_argument("--fit", action="store_true", help="re-run the efficiency fit")
    ap.add_argument("--write", action="store_true",
                    help=f"fit and regenerate {DOC_FILE.relative_to(ROOT)}")
    args = ap.parse_args(argv)
    if not args.runs.is_file():
        print(f"reference file {args.runs} is absent; nothing to validate", file=sys.stderr)
        return 2
    cases, skips = load_cases(args.runs)
    preds = predict_all(cases)
    print_table(preds)
    print_summary(summary(preds))
    print("\nskipped:")
    for s in skips:
        print(f"  {s.id} ({s.chip}, {s.quality}): {s.reason}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
