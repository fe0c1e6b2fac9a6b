"""The energy model's calibration table in docs/validation.md ("Energy"): TPU v3 and v4 chip
power on a heavy training step against the measured minimum, mean and maximum
(docs/reference/power.md), the model's v4-over-v3 performance per watt against the published
2.7x, and each derived generation's ratio on the reference workload it was derived at.

    .venv/bin/python -m validation.energy            # print the section
    .venv/bin/python -m validation.energy --write    # replace it in docs/validation.md

A few seconds of CPU: it needs none of the MaxText fit, so it rewrites only its own section
(`validation.maxtext --write` renders the same text through the template).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import sim
from sim.chip_power import MEASURED_POWER_W, POWER_DERIVATION, PUBLISHED_V4_OVER_V3_PERF_PER_W
from sim.chips import get_chip
from sim.energy import CHIP_UNITS, step_energy
from sim.engine.executors import simulate_step
from topologies.mesh import parse_mesh
from topologies.slices import resolve_topology
from workloads.trace import Op, OpKind, Trace, Unit

DOC_FILE = Path(__file__).resolve().parents[1] / "docs" / "validation.md"
HEADER = "## Energy"
# The heavy step the measured means are compared with: Llama-3 8B at over 50% MFU.
WORKLOAD = dict(model="llama3-8b", seq_len=2048, batch_per_chip=1, mesh="fsdp=16")
SHAPES = {"v3": "4x4", "v4": "4x4x1"}


def _heavy(chip: str):
    return sim.run(sim.TrainRequest(chip=chip, shape=SHAPES[chip], **WORKLOAD))


def _roofline_flop_per_j(name: str) -> float:
    """FLOPs per chip joule of one matmul at the roofline (MXU at peak, HBM at full bandwidth,
    efficiencies 1): the workload the ratios are applied at."""
    c = get_chip(name).with_overrides(mxu_efficiency=1.0, hbm_efficiency=1.0)
    topo = resolve_topology(chip_name=c.name, wrap_rule=c.generation_rule,
                            max_pod_shape=c.max_pod_shape,
                            shape="2x2" if c.num_dims == 2 else "2x2x1", wraparound="auto",
                            num_slices=1)
    f = 1e13
    trace = Trace(mesh=parse_mesh("fsdp=4"), meta={}, ops=(Op(
        id=0, name="mm", kind=OpKind.COMPUTE, unit=Unit.MXU, flops=f,
        hbm_bytes=f * c.hbm_bytes_per_s / c.mxu_flops_per_s),))
    e = step_energy(simulate_step(trace, c, topo), trace, c, tokens=None)
    return 4 * f / sum(e.step_j_by_unit[u] for u in CHIP_UNITS)


def section() -> str:
    """The "Energy" section of docs/validation.md (markdown, no trailing newline)."""
    runs = {chip: _heavy(chip) for chip in SHAPES}
    lines = [
        HEADER,
        "",
        "The energy model ([model/energy.md](model/energy.md)) against Google's measured chip "
        "power ([reference/power.md](reference/power.md)). For TPU v3 and v4, `idle_power_w` is "
        "the measured minimum and `mxu_j_per_flop` is fitted so that the chip at its roofline "
        "draws the measured maximum; the measured mean is held out. The step: "
        f"{WORKLOAD['model']}, seq {WORKLOAD['seq_len']}, batch {WORKLOAD['batch_per_chip']} "
        f"per chip, `{WORKLOAD['mesh']}` on 16 chips (v3 {SHAPES['v3']}, v4 {SHAPES['v4']}), "
        "a heavily loaded, MXU-bound training step.",
        "",
        "| chip | MFU | measured min / mean / max W | model mean W | model peak W (1 ms) "
        "| mean vs measured mean | inside min-max |",
        "|---|---:|---|---:|---:|---:|---|",
    ]
    for chip, run in runs.items():
        lo, mean, hi = MEASURED_POWER_W[chip]
        e = run.energy
        p = e["chip_power_w_mean"]
        inside = "yes" if lo <= p <= hi and e["chip_power_w_peak"] <= hi else "no"
        lines.append(f"| {chip} | {run.mfu:.1%} | {lo:g} / {mean:g} / {hi:g} | {p:.1f} "
                     f"| {e['chip_power_w_peak']:.1f} | {p / mean - 1:+.1%} | {inside} |")
    ratio = runs["v3"].energy["j_per_token"] / runs["v4"].energy["j_per_token"]
    lines += [
        "",
        f"Performance per watt, v4 over v3, on the same step (joules per token): the model "
        f"gives {ratio:.2f}x, the TPU v4 paper {PUBLISHED_V4_OVER_V3_PERF_PER_W:g}x "
        f"({ratio / PUBLISHED_V4_OVER_V3_PERF_PER_W - 1:+.1%}); the fit does not use the "
        f"ratio, so this is a check.",
        "",
        "The later generations have no measured power: their coefficients are derived from a "
        "published ratio of performance per watt (or, for v5e and v5p, none: v4's carried "
        "over), applied at the roofline. On that workload each reproduces its ratio by "
        "construction; the table is a consistency check of the derivation, not a validation.",
        "",
        "| chip | derived from | ratio used | model ratio at the roofline |",
        "|---|---|---:|---:|",
    ]
    for chip, (base, r) in POWER_DERIVATION.items():
        got = _roofline_flop_per_j(chip) / _roofline_flop_per_j(base)
        lines.append(f"| {chip} | {base} | {r:g} | {got:.4f} |")
    return "\n".join(lines)


def updated(text: str, new: str | None = None) -> str:
    """`text` (docs/validation.md's) with its "Energy" section (from its header to the next
    `## `, a marker comment or the end) replaced by `new` (else computed)."""
    new = section() if new is None else new
    start = text.find("\n" + HEADER + "\n")
    if start < 0:
        return text.rstrip("\n") + "\n\n" + new + "\n"
    after = [i for i in (text.find("\n## ", start + 1), text.find("\n<!-- ", start + 1))
             if i >= 0]
    if not after:
        return text[:start + 1] + new + "\n"
    end = min(after)
    # A heading follows after a blank line; a marker comment (the next generated section's)
    # on the line after the section's last.
    return text[:start + 1] + new + ("\n" if text.startswith("\n## ", end) else "") + text[end:]


def write(doc: Path = DOC_FILE) -> None:
    """Replace the "Energy" section of `doc`."""
    doc.write_text(updated(doc.read_text(encoding="utf-8")), encoding="utf-8")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="replace the section in "
                                                         "docs/validation.md")
    args = ap.parse_args()
    if args.write:
        write()
        print(f"wrote the {HEADER!r} section of {DOC_FILE}")
    else:
        print(section())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
