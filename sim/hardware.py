"""TPU chip descriptions (`ChipSpec`), the preset registry, and custom chips from YAML.

Every preset number cites `../shared/reference/tpu.md` (the textbook *How to Scale Your Model*,
restated) or a public Google Cloud spec. Efficiency factors scale the peak numbers to what the
hardware achieves; they default to 1.0 (the textbook's idealisation) unless a fit says otherwise.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from topologies.errors import TpusimError
from topologies.quantities import parse_quantity
from topologies.registry import Registry
from topologies.validate import number, one_of, short_repr
from workloads.xla_compiler import COMPILER_RULES, XlaCompilerSpec

# Assumed (no public figure): seconds to swap a spare cube in for a failed one (ChipSpec).
OCS_RECONFIGURATION_S = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ChipSpec:
    """One TPU chip, as the simulator sees it. Rates are per chip (all TensorCores together).

    Attributes:
        name: registry name (`v5e`).
        generation_rule: which wraparound rule its slices follow (`cube` for v4/v5p-style optical
            cubes, `full-axis` for v5e/v6e-style 2D pods that wrap only full-length axes).
        max_pod_shape: the largest ICI slice (chips per axis).
        mxu_flops_per_s: dense bf16 peak of all MXUs.
        mxu_int8_ops_per_s: int8 peak of all MXUs.
        mxu_fp8_ops_per_s: fp8 peak of all MXUs; 0 (every preset: their source, tpu.md §1.1,
            gives bf16 and int8 rates only) for a chip without fp8 matmuls, which refuses
            `--matmul-dtype fp8`. Listed by `to_dict()` only when set.
        vpu_flops_per_s: fp32 vector-unit peak.
        hbm_bytes: HBM capacity.
        hbm_bytes_per_s: HBM bandwidth.
        ici_link_bytes_per_s: one ICI link, one direction (the book's "one-way"; bidi is 2x).
        ici_hop_latency_s: latency added per ICI hop.
        ocs_hop_latency_s: latency a hop adds on top of `ici_hop_latency_s` when its link goes
            through an optical circuit switch (a v4/v5p link leaving a 4x4x4 cube). Assumed 0
            for the presets: a switch is a set of mirrors, so what it adds is fiber (about 5 ns
            a metre), well inside tpu.md's "about 1 µs" a hop; `--set ocs_hop_latency_s=...`
            asks what a slower switch path would cost. Listed by `to_dict()` only when set.
        ocs_reconfiguration_s: one-time time to swap a spare 4x4x4 cube in for one holding a
            failed chip (`--failed-chip` with `--spare-cubes`, docs/model/pods.md): the optical
            switches re-aim their mirrors and the new links come up. Assumed 10 s (no public
            figure; MEMS mirrors themselves settle in milliseconds, most of it is bringing the
            links up and remapping the slice); the job's restart from its checkpoint is not
            part of it. Listed by `to_dict()` only when it differs from 10 s.
        ici_links_per_chip: ICI links (each full duplex) leaving one chip.
        dcn_bytes_per_s: data-center-network egress per chip (and ingress, full duplex).
        dcn_latency_s: one-way DCN latency between slices.
        dcn_message_overhead_s: time a chip's DCN endpoint spends on each message it sends in
            one collective step, one message after another (host-side handling of a DCN
            transfer); a ring or direct DCN collective over N slices pays it 2(N-1) times.
        pcie_bytes_per_s: host <-> HBM bandwidth per chip.
        tensorcores_per_chip: TensorCores sharing the chip's HBM (megacore counts as one device).
        mxu_dim: side of one MXU systolic array (128, or 256 on v6e). A matmul operand dimension
            narrower than this (attention's head_dim 128 on a 256-wide MXU) leaves part of the
            array idle: the op runs at dim / (dim rounded up to `mxu_dim`) of the MXU peak.
        mxu_efficiency, vpu_efficiency, hbm_efficiency, ici_efficiency, dcn_efficiency: achievable
            fraction of each peak (1.0 = the textbook's roofline).
        op_overhead_s: fixed cost added to every compute op (launch / pipeline fill).
        mxu_j_per_flop, mxu_int8_j_per_op, vpu_j_per_flop: dynamic energy per bf16 MXU FLOP,
            per int8 MXU op and per VPU FLOP (joules), at `clock_scale` 1.
        hbm_j_per_byte, ici_j_per_byte, dcn_j_per_byte, pcie_j_per_byte: dynamic energy per
            byte read or written in HBM, sent on an ICI link, sent over DCN, moved over PCIe.
        idle_power_w: static power of a powered chip doing nothing (watts).
        host_power_share: the host's energy (CPU, DRAM, NIC) per joule the chip draws.
        pue: data-centre power usage effectiveness (>= 1): facility energy per IT joule.
        usd_per_chip_hour: price of one chip for an hour (on-demand list price); None: no
            public price (cost fields are null).
        clock_scale: the MXU and VPU clock as a fraction of nominal (DVFS; HBM and links keep
            their rates): their achieved rates scale by it, their energy per operation by
            `clock_scale ** clock_energy_exponent`.
        clock_energy_exponent: how energy per MXU/VPU operation follows the clock (2: voltage
            scales with frequency and switching energy with voltage squared).
        Every power coefficient's source: `power_sources(chip)`, docs/model/energy.md.
        compiler: what this generation's XLA compiler does to a training step's memory
            (`workloads.xla_compiler.XlaCompilerSpec`: score_exp_fusion, score_grad_fusion,
            bwd_probs_buffer, loss_after_backward, mlp_grad_after_attention,
            head_grad_after_backward), read and written under its rules' own names: chip
            YAML keys, `--set` keys, `to_dict()` and attributes of the chip.
    """

    name: str
    generation_rule: str
    max_pod_shape: tuple[int, ...]
    mxu_flops_per_s: float
    mxu_int8_ops_per_s: float
    vpu_flops_per_s: float
    hbm_bytes: float
    hbm_bytes_per_s: float
    ici_link_bytes_per_s: float
    ici_hop_latency_s: float
    ici_links_per_chip: int
    dcn_bytes_per_s: float
    dcn_latency_s: float
    pcie_bytes_per_s: float
    tensorcores_per_chip: int
    mxu_dim: int = 128
    mxu_efficiency: float = 1.0
    vpu_efficiency: float = 1.0
    hbm_efficiency: float = 1.0
    ici_efficiency: float = 1.0
    dcn_efficiency: float = 1.0
    op_overhead_s: float = 0.0
    dcn_message_overhead_s: float = 0.0
    ocs_hop_latency_s: float = 0.0
    ocs_reconfiguration_s: float = OCS_RECONFIGURATION_S
    mxu_fp8_ops_per_s: float = 0.0
    mxu_j_per_flop: float = 0.0
    mxu_int8_j_per_op: float = 0.0
    vpu_j_per_flop: float = 0.0
    hbm_j_per_byte: float = 0.0
    ici_j_per_byte: float = 0.0
    dcn_j_per_byte: float = 0.0
    pcie_j_per_byte: float = 0.0
    idle_power_w: float = 0.0
    host_power_share: float = 0.0
    pue: float = 1.0
    usd_per_chip_hour: float | None = None
    clock_scale: float = 1.0
    clock_energy_exponent: float = 2.0
    compiler: XlaCompilerSpec = XlaCompilerSpec()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not 0 < len(self.name) <= 64 \
                or not self.name.isprintable():
            raise TpusimError(
                f"chip name {short_repr(self.name)} is not a name; give `name:` as text of 1 to "
                f"64 printable characters (quote numbers)"
            )
        if not isinstance(self.generation_rule, str) or self.generation_rule not in WRAP_RULES:
            raise TpusimError(
                f"chip {self.name!r}: generation_rule {short_repr(self.generation_rule)} is not a "
                f"known wraparound rule; use one of: {', '.join(WRAP_RULES)}"
            )
        for f in dataclasses.fields(self):
            if f.name in _FIELD_RANGES:
                if f.name in NULLABLE_CHIP_FIELDS and getattr(self, f.name) is None:
                    continue
                lo, hi, lo_open, integer, why = _FIELD_RANGES[f.name]
                number(getattr(self, f.name), f"chip {self.name!r}: {f.name}", lo=lo, hi=hi,
                       lo_open=lo_open, integer=integer, fix=why)
        if not isinstance(self.compiler, XlaCompilerSpec):
            raise TpusimError(f"chip {self.name!r}: compiler {short_repr(self.compiler)} is not "
                              f"an XlaCompilerSpec")
        for name in CHIP_BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise TpusimError(
                    f"chip {self.name!r}: {name} = {short_repr(getattr(self, name))} must be "
                    f"true or false"
                )
        shape = self.max_pod_shape
        if not isinstance(shape, tuple) or not 1 <= len(shape) <= 3 or any(
            isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 4096 for n in shape
        ):
            raise TpusimError(
                f"chip {self.name!r}: max_pod_shape = {short_repr(shape)} must be a list of 1 to "
                f"3 whole numbers in [1, 4096] such as [16, 16]"
            )

    def compiler_rules(self) -> dict[str, bool]:
        """What this generation's compiler keeps in memory (`CHIP_BOOL_FIELDS`), as the
        `TrainingConfig` fields of the same names: the settings a step compiled for this chip
        takes."""
        return self.compiler.rules()

    # The compiler's rules read as the chip's attributes, as chip files and `--set` name them.
    score_exp_fusion = property(lambda self: self.compiler.score_exp_fusion)
    score_grad_fusion = property(lambda self: self.compiler.score_grad_fusion)
    bwd_probs_buffer = property(lambda self: self.compiler.bwd_probs_buffer)
    loss_after_backward = property(lambda self: self.compiler.loss_after_backward)
    mlp_grad_after_attention = property(lambda self: self.compiler.mlp_grad_after_attention)
    head_grad_after_backward = property(lambda self: self.compiler.head_grad_after_backward)

    def mxu_fill(self, narrow_dim: float) -> float:
        """Fraction of the MXU a matmul keeps busy when one of its tiled operand dimensions
        (contraction or output) is `narrow_dim` wide (0: every dimension is wide): the array is
        `mxu_dim` square and a dimension is padded up to a multiple of it (tpu.md §1.2)."""
        if narrow_dim <= 0:
            return 1.0
        t = self.mxu_dim
        return narrow_dim / (math.ceil(narrow_dim / t) * t)

    # The rates as achieved (peak x the fitted efficiency): what every engine costs ops and
    # transfers at. One place for the product, so that every site computes the same bits.
    @property
    def eff_mxu_flops_per_s(self) -> float:
        """bf16 MXU FLOP/s achieved: `mxu_flops_per_s * mxu_efficiency * clock_scale`."""
        return self.mxu_flops_per_s * self.mxu_efficiency * self.clock_scale

    @property
    def eff_mxu_int8_ops_per_s(self) -> float:
        """int8 MXU op/s achieved: `mxu_int8_ops_per_s * mxu_efficiency * clock_scale`."""
        return self.mxu_int8_ops_per_s * self.mxu_efficiency * self.clock_scale

    @property
    def eff_vpu_flops_per_s(self) -> float:
        """VPU FLOP/s achieved: `vpu_flops_per_s * vpu_efficiency * clock_scale`."""
        return self.vpu_flops_per_s * self.vpu_efficiency * self.clock_scale

    @property
    def eff_hbm_bytes_per_s(self) -> float:
        """HBM bytes/s achieved: `hbm_bytes_per_s * hbm_efficiency`."""
        return self.hbm_bytes_per_s * self.hbm_efficiency

    @property
    def eff_ici_link_bytes_per_s(self) -> float:
        """One ICI link direction's bytes/s achieved: `ici_link_bytes_per_s * ici_efficiency`."""
        return self.ici_link_bytes_per_s * self.ici_efficiency

    @property
    def eff_dcn_bytes_per_s(self) -> float:
        """DCN bytes/s per chip achieved: `dcn_bytes_per_s * dcn_efficiency`."""
        return self.dcn_bytes_per_s * self.dcn_efficiency

    def unit_rate(self, op, speed: float = 1.0) -> float:
        """The op-cost kernel's rate: a compute op's FLOP/s on this chip at `speed` (a per-chip
        factor), its unit's achieved rate times `speed` (the MXU's int8 or bf16 rate times the
        fill of a narrow dimension, `mxu_fill`; else the VPU's)."""
        # The `eff_*` products written out: this runs once per op per chip class. The clock
        # multiplies in the same place as in `eff_*` (at 1.0 the bits are the same).
        if op.unit == "mxu":
            peak = self.mxu_int8_ops_per_s if op.dtype == "int8" else \
                self.mxu_fp8_ops_per_s if op.dtype == "fp8" else self.mxu_flops_per_s
            return peak * self.mxu_efficiency * self.clock_scale * speed \
                * self.mxu_fill(op.narrow_dim)
        return self.vpu_flops_per_s * self.vpu_efficiency * self.clock_scale * speed

    @property
    def ici_bidi_bytes_per_s(self) -> float:
        """The book's `W_ici`: both directions of one link."""
        return 2.0 * self.ici_link_bytes_per_s

    @property
    def num_dims(self) -> int:
        return len(self.max_pod_shape)

    def to_dict(self) -> dict[str, Any]:
        """The fields under their chip YAML keys (`chip_from_dict` inverts it exactly)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "compiler"}
        data["max_pod_shape"] = list(self.max_pod_shape)
        # At its default (no extra latency through a switch) the key is left out, so that a
        # chip, and every result recording one, reads as it did before the field existed.
        for key in ("ocs_hop_latency_s", "mxu_fp8_ops_per_s"):
            if not data[key]:
                del data[key]
        if data["ocs_reconfiguration_s"] == OCS_RECONFIGURATION_S:
            del data["ocs_reconfiguration_s"]
        return {**data, **self.compiler_rules()}

    def check_matmul_dtype(self, dtype: str, flag: str = "--matmul-dtype") -> None:
        """A chip without an MXU rate for `dtype` (fp8 on every preset) refuses it."""
        if dtype == "fp8" and not self.mxu_fp8_ops_per_s:
            raise TpusimError(
                f"{flag} fp8: chip {self.name!r} has no fp8 MXU rate (mxu_fp8_ops_per_s is 0; "
                f"its source, tpu.md §1.1, gives bf16 and int8 rates only); use {flag} int8, "
                f"or give the rate with --set mxu_fp8_ops_per_s=... or a chip file")

    def with_overrides(self, **changes: Any) -> ChipSpec:
        """A copy with some fields changed (what-if studies), validated like a preset."""
        unknown = sorted(set(changes) - set(CHIP_FIELDS))
        if unknown:
            raise TpusimError(
                f"chip override {', '.join(unknown)[:80]} is not a ChipSpec field; "
                f"{one_of(unknown[0], CHIP_FIELDS, listing=_CHIP_KEYS_LISTING)}"
            )
        rules = {k: v for k, v in changes.items() if k in CHIP_BOOL_FIELDS}
        silicon = {k: v for k, v in changes.items() if k not in CHIP_BOOL_FIELDS}
        if rules:
            silicon["compiler"] = dataclasses.replace(self.compiler, **rules)
        return dataclasses.replace(self, **silicon)


WRAP_RULES = ("cube", "full-axis")
# Chip keys that are true or false (what the generation's compiler does), not numbers.
CHIP_BOOL_FIELDS = COMPILER_RULES
_POSITIVE_FIELDS = {
    "mxu_flops_per_s",
    "mxu_int8_ops_per_s",
    "vpu_flops_per_s",
    "hbm_bytes",
    "hbm_bytes_per_s",
    "ici_link_bytes_per_s",
    "ici_hop_latency_s",
    "ici_links_per_chip",
    "dcn_bytes_per_s",
    "dcn_latency_s",
    "pcie_bytes_per_s",
    "tensorcores_per_chip",
    "mxu_dim",
}
# Accepted range of every numeric field: (low, high, low excluded, integer, hint). The bounds
# are validation limits, not hardware numbers: wide enough for any real or what-if chip, narrow
# enough that no time or byte count overflows or divides by (nearly) zero.
_RATE = (1.0, 1e21, False, False, "a rate in units per second")
_FIELD_RANGES: dict[str, tuple] = {
    "mxu_flops_per_s": _RATE, "mxu_int8_ops_per_s": _RATE, "vpu_flops_per_s": _RATE,
    "hbm_bytes_per_s": _RATE, "ici_link_bytes_per_s": _RATE, "dcn_bytes_per_s": _RATE,
    "pcie_bytes_per_s": _RATE,
    "hbm_bytes": (1.0, 1e18, False, False, "the HBM capacity in bytes"),
    "ici_hop_latency_s": (1e-18, 1.0, False, False, "seconds per hop"),
    "dcn_latency_s": (1e-18, 1.0, False, False, "seconds"),
    "ici_links_per_chip": (1, 64, False, True, "a count of links"),
    "tensorcores_per_chip": (1, 64, False, True, "a count of cores"),
    "mxu_dim": (8, 4096, False, True, "the side of one MXU systolic array (128 or 256)"),
    "op_overhead_s": (0.0, 1.0, False, False, "seconds added to every compute op"),
    "dcn_message_overhead_s": (0.0, 1.0, False, False, "seconds per DCN message"),
    "ocs_hop_latency_s": (0.0, 1.0, False, False, "seconds a switched hop adds"),
    "ocs_reconfiguration_s": (0.0, 1e6, False, False, "seconds to swap a spare cube in"),
    "mxu_fp8_ops_per_s": (0.0, 1e21, False, False,
                          "the fp8 MXU rate in ops per second (0: no fp8 matmuls)"),
    **{f"{u}_efficiency": (1e-6, 1.0, False, False,
                           "the achievable fraction of the peak")
       for u in ("mxu", "vpu", "hbm", "ici", "dcn")},
    # Power and price: every coefficient >= 0 (0 leaves that part out); an upper bound far above
    # any chip keeps joules finite.
    **{f: (0.0, 1e-6, False, False, "joules per operation or byte, >= 0 (e.g. 2e-13)")
       for f in ("mxu_j_per_flop", "mxu_int8_j_per_op", "vpu_j_per_flop", "hbm_j_per_byte",
                 "ici_j_per_byte", "dcn_j_per_byte", "pcie_j_per_byte")},
    "idle_power_w": (0.0, 1e5, False, False, "watts a powered idle chip draws, >= 0"),
    "host_power_share": (0.0, 100.0, False, False,
                         "the host's joules per chip joule, >= 0 (e.g. 0.43)"),
    "pue": (1.0, 10.0, False, False,
            "a PUE is facility energy over IT energy, at least 1 (e.g. 1.09)"),
    "usd_per_chip_hour": (0.0, 1e6, False, False, "dollars per chip-hour, >= 0 (e.g. 1.2)"),
    "clock_scale": (1e-3, 4.0, True, False,
                    "the MXU/VPU clock as a fraction of nominal, > 0 (e.g. 0.8)"),
    "clock_energy_exponent": (0.0, 4.0, False, False,
                              "energy per op ~ clock_scale ** this, in [0, 4] (e.g. 2)"),
}
# Chip fields whose null means "not known" (a chip with no public list price).
NULLABLE_CHIP_FIELDS = ("usd_per_chip_hour",)
# Every chip key: the silicon's fields, then the compiler's rules.
CHIP_FIELDS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(ChipSpec) if f.name != "compiler") + CHIP_BOOL_FIELDS

CHIPS: Registry[ChipSpec] = Registry("chip", listing="`tpusim presets` lists them")

# Shared numbers, each cited once.
_HOP_LATENCY_S = 1e-6  # tpu.md §1.1 "Per-hop ICI latency: about 1 µs" (the book's T_min)
# No public per-hop DCN latency is given in the reference; 10 µs is an assumption (a datacenter
# network one-way latency is tens of µs), documented in docs/model.md and overridable via YAML.
_DCN_LATENCY_S = 10e-6
# tpu.md §1.2: the VPU is "about 30x below the MXU" (stated for v5p). Applying the same ratio to
# v3, v4, v6e and TPU7x is an assumption: the reference gives no VPU figure for them.
_MXU_TO_VPU = 30.0
# Fitted to measured MaxText runs on v5e (docs/validation.md, benchmarks/validate_maxtext.py):
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

# Power, from docs/reference/power.md (public figures; see docs/model/energy.md for the model and
# how far to trust each number). Google publishes measured chip power for v3 and v4 only; every
# later generation is an estimate derived from a published efficiency ratio.
MEASURED_POWER_W = {"v3": (123.0, 220.0, 262.0), "v4": (90.0, 170.0, 192.0)}  # min, mean, max
# Assumed, per byte (no public TPU figure): HBM of the order published for HBM2 stacks (about
# 3.9 pJ/bit, O'Connor et al., MICRO 2017); ICI and PCIe as SerDes links of about 5 pJ/bit;
# DCN about 10 pJ/bit (it crosses PCIe, the host's NIC and the network).
_HBM_J_PER_BYTE = 31.2e-12
_ICI_J_PER_BYTE = 40e-12
_PCIE_J_PER_BYTE = 40e-12
_DCN_J_PER_BYTE = 80e-12
# Assumed: a VPU FLOP (fp32 vector) costs 3x a bf16 MXU FLOP, as a 32-bit floating multiply
# costs about 3.4x a 16-bit one (Horowitz, ISSCC 2014: 3.7 pJ against 1.1 pJ at 45 nm).
_VPU_OVER_MXU_J = 3.0
# The fleet serving split (power.md, arXiv 2508.15734): 58% active accelerators, 25% host,
# 10% idle provisioned machines, 8% data-centre overhead. Host energy per accelerator joule is
# 25/58; the overhead is 8% of the whole, so PUE = 1/(1 - 0.08). The 10% idle capacity belongs
# to the fleet, not to a job's chips, and is left out.
_HOST_POWER_SHARE = 25.0 / 58.0
_PUE = 1.0 / (1.0 - 0.08)
# On-demand list prices per chip-hour, USD (power.md; prices change, check before relying).
_USD_PER_CHIP_HOUR = {"v4": 3.22, "v5e": 1.20, "v5p": 4.20, "v6e": 2.70}


def _roofline_power_w(mxu_j: float, hbm_j: float, idle_w: float, peak: float,
                      hbm_bw: float) -> float:
    """A chip at its roofline: MXU at its bf16 peak while HBM streams at full bandwidth (the
    operating point the measured maximum is fitted to and the ratios are applied at)."""
    return idle_w + mxu_j * peak + hbm_j * hbm_bw


def _measured_power(name: str, peak: float, int8_peak: float, hbm_bw: float) -> dict:
    """v3/v4: idle power is the measured minimum; the MXU's energy per FLOP is fitted so the
    roofline power (`_roofline_power_w`) equals the measured maximum; the measured mean is held
    out (a heavy training step must land near it: tests/test_energy.py)."""
    lo, _mean, hi = MEASURED_POWER_W[name]
    mxu_j = (hi - lo - _HBM_J_PER_BYTE * hbm_bw) / peak
    return _power(mxu_j, _HBM_J_PER_BYTE, lo, peak, int8_peak, name)


def _derived_power(base: dict, base_peak: float, base_hbm_bw: float, ratio: float, peak: float,
                   int8_peak: float, hbm_bw: float, name: str) -> dict:
    """A generation without measured power, from a base generation and a published ratio of
    performance per watt (`ratio`, new over base): at the roofline the new chip does `ratio`
    times the base's FLOPs per joule, so its roofline power is `peak / (ratio * base FLOP/J)`;
    that power is split into static, MXU and HBM in the base's proportions (assumed)."""
    p_base = _roofline_power_w(base["mxu_j_per_flop"], base["hbm_j_per_byte"],
                               base["idle_power_w"], base_peak, base_hbm_bw)
    p_new = peak / (ratio * base_peak / p_base)
    k = p_new / p_base
    return _power(base["mxu_j_per_flop"] * base_peak * k / peak,
                  base["hbm_j_per_byte"] * base_hbm_bw * k / hbm_bw,
                  base["idle_power_w"] * k, peak, int8_peak, name)


def _power(mxu_j: float, hbm_j: float, idle_w: float, peak: float, int8_peak: float,
           name: str) -> dict:
    return dict(
        mxu_j_per_flop=mxu_j,
        # Assumed: the MXU draws the same power at its int8 peak as at its bf16 peak.
        mxu_int8_j_per_op=mxu_j * peak / int8_peak,
        vpu_j_per_flop=mxu_j * _VPU_OVER_MXU_J,
        hbm_j_per_byte=hbm_j, ici_j_per_byte=_ICI_J_PER_BYTE, dcn_j_per_byte=_DCN_J_PER_BYTE,
        pcie_j_per_byte=_PCIE_J_PER_BYTE, idle_power_w=idle_w,
        host_power_share=_HOST_POWER_SHARE, pue=_PUE,
        usd_per_chip_hour=_USD_PER_CHIP_HOUR.get(name))


# (bf16 peak, int8 peak, HBM bytes/s) of each preset, as cited in its definition below.
_PEAKS = {"v3": (1.4e14, 1.4e14, 9.0e11), "v4": (2.75e14, 2.75e14, 1.2e12),
          "v5e": (1.97e14, 3.94e14, 8.2e11), "v5p": (4.59e14, 9.18e14, 2.8e12),
          "v6e": (9.20e14, 1.84e15, 1.6e12), "tpu7x": (2.30e15, 4.61e15, 7.4e12)}
# Which generation each estimate is derived from, with which performance-per-watt ratio
# (power.md): v6e "over 67% more energy-efficient" than v5e; TPU7x 2x v6e's performance per
# watt. v5e and v5p have no published ratio or power: v4's FLOPs per joule at the roofline are
# carried over (ratio 1, assumed). The v4/v3 ratio (2.7x) is not used: both are measured, and
# the model's v4/v3 ratio is checked against it instead.
POWER_DERIVATION = {"v5e": ("v4", 1.0), "v5p": ("v4", 1.0), "v6e": ("v5e", 1.67),
                    "tpu7x": ("v6e", 2.0)}
PUBLISHED_V4_OVER_V3_PERF_PER_W = 2.7  # power.md (Jouppi et al., ISCA 2023)
_POWER: dict[str, dict] = {n: _measured_power(n, *_PEAKS[n]) for n in MEASURED_POWER_W}
for _name, (_base, _ratio) in POWER_DERIVATION.items():
    _POWER[_name] = _derived_power(_POWER[_base], _PEAKS[_base][0], _PEAKS[_base][2], _ratio,
                                   *_PEAKS[_name], _name)

CHIPS.add(
    "v3",
    ChipSpec(
        name="v3",
        **_POWER["v3"],  # power and price: docs/model/energy.md, power_sources()
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
        **_POWER["v4"],  # power and price: docs/model/energy.md, power_sources()
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
        **_POWER["v5e"],  # power and price: docs/model/energy.md, power_sources()
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
        # Fitted to measured MaxText runs (docs/validation.md, benchmarks/validate_maxtext.py):
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
        **_POWER["v5p"],  # power and price: docs/model/energy.md, power_sources()
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
        **_POWER["v6e"],  # power and price: docs/model/energy.md, power_sources()
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
        # Fitted to measured MaxText runs (docs/validation.md, benchmarks/validate_maxtext.py):
        # the achievable MXU fraction of the tpu-recipes v6e training runs (the 12 odd-indexed
        # usable v6e runs of docs/reference/maxtext_runs.json, mean |log error| on a 0.01
        # grid), with attention's head_dim-128 matmuls at half rate on the 256-wide MXU
        # (mxu_dim); the held-out even-indexed half and its refit are in docs/validation.md.
        # HBM/ICI/DCN/VPU factors stay 1.0: the fit cannot identify them. Fitted with the
        # fluid engine's max-min sharing, the runs' f32 weights, XLA's per-matrix gradient
        # collectives (`--fsdp-grad auto`: synchronous whole-gradient all-reduces over FSDP
        # groups of more than 32 chips) and per-matrix cross-slice all-reduces; the even half
        # gives 0.64 (the factor's history: CHANGELOG.md).
        mxu_efficiency=0.65,
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
        **_POWER["tpu7x"],  # power and price: docs/model/energy.md, power_sources()
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
        "measured v5e MaxText runs (docs/validation.md, benchmarks/validate_maxtext.py); held "
        "out: the even half, its refit and its errors are in docs/validation.md"),
        "dcn_message_overhead_s": (
        "fitted", "jointly with mxu_efficiency to the odd-indexed half of the measured v5e "
        "MaxText runs, whose 1-32 slices are data parallel over DCN, rebuilt with one "
        "cross-slice all-reduce a layer (docs/validation.md, effect 2); held out: the even "
        "half")},
    "v6e": {"mxu_efficiency": (
        "fitted", "to the odd-indexed half (12 runs) of the measured v6e MaxText runs, with "
        "head_dim-128 attention at half rate on the 256-wide MXU and XLA's per-matrix gradient "
        "collectives (--fsdp-grad auto; docs/validation.md, effect 7, "
        "benchmarks/validate_maxtext.py); held out: the even half, its refit and its errors are "
        "in docs/validation.md"),
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
    the preset of the same name (a chip file or `--set`) is `given`.
    """
    preset = CHIPS.get(chip.name) if chip.name in CHIPS else None
    out = {}
    for f in EFFICIENCY_FIELDS:
        value = getattr(chip, f)
        if preset is None or getattr(preset, f) != value:
            kind, source = "given", "set by a chip file or --set, not a preset value"
        else:
            default = _OVERHEADS.get(f, _ROOFLINE)
            kind, source = _FITTED.get(chip.name, {}).get(f, default)
        out[f] = {"value": value, "kind": kind, "source": source}
    return out


# The power and price fields and where each preset's value comes from (`tpusim presets`).
POWER_FIELDS = ("mxu_j_per_flop", "mxu_int8_j_per_op", "vpu_j_per_flop", "hbm_j_per_byte",
                "ici_j_per_byte", "dcn_j_per_byte", "pcie_j_per_byte", "idle_power_w",
                "host_power_share", "pue", "usd_per_chip_hour", "clock_scale",
                "clock_energy_exponent")
_POWER_ASSUMED = {
    "hbm_j_per_byte": "31.2 pJ/byte for v3 and v4, of the order published for HBM2 (3.9 pJ/bit, "
                      "O'Connor et al., MICRO 2017); no public TPU figure",
    "ici_j_per_byte": "40 pJ/byte (about 5 pJ/bit, a SerDes link); no public TPU figure",
    "pcie_j_per_byte": "40 pJ/byte (about 5 pJ/bit, a SerDes link); no public TPU figure",
    "dcn_j_per_byte": "80 pJ/byte (about 10 pJ/bit: PCIe, the host NIC and the network); no "
                      "public TPU figure",
    "vpu_j_per_flop": "3x the MXU's energy per FLOP (an fp32 multiply costs about 3.4x a "
                      "16-bit one, Horowitz ISSCC 2014)",
    "mxu_int8_j_per_op": "the MXU draws the same power at its int8 peak as at its bf16 peak "
                         "(mxu_j_per_flop x bf16 peak / int8 peak)",
    "host_power_share": "25/58 = 0.43 host joules per accelerator joule: the published "
                        "split of Google's fleet serving energy (58% accelerators, 25% host; "
                        "arXiv 2508.15734, power.md)",
    "pue": "1/(1 - 0.08) = 1.087: the same split's 8% data-centre overhead (power.md)",
    "clock_scale": "1.0, the nominal clock",
    "clock_energy_exponent": "2: energy per operation ~ voltage squared, voltage ~ frequency "
                             "in the DVFS range",
}


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
            kind, source = "given", "set by a chip file or --set, not a preset value"
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
            kind, source = "published", _POWER_ASSUMED[f]
        else:
            kind, source = "assumed", _POWER_ASSUMED.get(f, "")
        out[f] = {"value": value, "kind": kind, "source": source}
    return out


def get_chip(name: str) -> ChipSpec:
    """A preset by name (`v5e`, `v5p`, ...); `v4p` is accepted for `v4`."""
    if name.lower() == "v4p":
        name = "v4"
    return CHIPS.get(name)


# Where every chip key is listed (the unknown-key messages point there).
_CHIP_KEYS_LISTING = "`tpusim presets --json --chip v5e` prints every key"


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
            f"{one_of(unknown[0], ('base', *CHIP_FIELDS), listing=_CHIP_KEYS_LISTING)}"
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
        lo, hi, lo_open, integer, why = _FIELD_RANGES[key]
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
    """A chip file's text value read by the `--set` parser (`topologies.quantities`): a
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
    from topologies.yamlio import read_yaml_mapping

    return chip_from_dict(read_yaml_mapping(path, what="chip"), source=f"chip file {path}")
