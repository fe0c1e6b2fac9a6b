"""A TPU chip as the simulator sees it (`ChipSpec`) and the rules of its fields: every key a
chip file or the `set` overrides may name, each numeric field's accepted range, the
wraparound rules.

The presets (every number cited) and chip files are `sim/chips.py`; the presets' power and
price figures are derived in `sim/chip_power.py`. Efficiency factors scale the peak numbers to
what the hardware achieves; they default to 1.0 (the textbook's idealisation).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from topologies.errors import TpusimError
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
            `matmul_dtype` fp8. Listed by `to_dict()` only when set.
        vpu_flops_per_s: fp32 vector-unit peak.
        hbm_bytes: HBM capacity.
        hbm_bytes_per_s: HBM bandwidth.
        ici_link_bytes_per_s: one ICI link, one direction (the book's "one-way"; bidi is 2x).
        ici_hop_latency_s: latency added per ICI hop.
        ocs_hop_latency_s: latency a hop adds on top of `ici_hop_latency_s` when its link goes
            through an optical circuit switch (a v4/v5p link leaving a 4x4x4 cube). Assumed 0
            for the presets: a switch is a set of mirrors, so what it adds is fiber (about 5 ns
            a metre), well inside tpu.md's "about 1 µs" a hop; the override `ocs_hop_latency_s=...`
            asks what a slower switch path would cost. Listed by `to_dict()` only when set.
        ocs_reconfiguration_s: one-time time to swap a spare 4x4x4 cube in for one holding a
            failed chip (`failed_chip` with `spare_cubes`, docs/model/pods.md): the optical
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
            YAML keys, `set` override keys, `to_dict()` and attributes of the chip.
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
            if f.name in FIELD_RANGES:
                if f.name in NULLABLE_CHIP_FIELDS and getattr(self, f.name) is None:
                    continue
                lo, hi, lo_open, integer, why = FIELD_RANGES[f.name]
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
    def eff_mxu_fp8_ops_per_s(self) -> float:
        """fp8 MXU op/s achieved: `mxu_fp8_ops_per_s * mxu_efficiency * clock_scale`."""
        return self.mxu_fp8_ops_per_s * self.mxu_efficiency * self.clock_scale

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
        if op.unit == "mxu":
            rate = self.eff_mxu_int8_ops_per_s if op.dtype == "int8" else \
                self.eff_mxu_fp8_ops_per_s if op.dtype == "fp8" else self.eff_mxu_flops_per_s
            return rate * speed * self.mxu_fill(op.narrow_dim)
        return self.eff_vpu_flops_per_s * speed

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

    def check_matmul_dtype(self, dtype: str, name: str = "matmul_dtype") -> None:
        """A chip without an MXU rate for `dtype` (fp8 on every preset) refuses it, naming the
        setting `name` (a Python argument name, TpusimError's placeholders)."""
        if dtype == "fp8" and not self.mxu_fp8_ops_per_s:
            raise TpusimError(
                f"{{{name}}} fp8: chip {self.name!r} has no fp8 MXU rate (mxu_fp8_ops_per_s is "
                f"0; its source, tpu.md §1.1, gives bf16 and int8 rates only); use {{{name}}} "
                f"int8, or give the rate with {{set}} mxu_fp8_ops_per_s=... or a chip file",
                name, "set")

    def with_overrides(self, **changes: Any) -> ChipSpec:
        """A copy with some fields changed (what-if studies), validated like a preset."""
        unknown = sorted(set(changes) - set(CHIP_FIELDS))
        if unknown:
            raise TpusimError(
                f"chip override {', '.join(unknown)[:80]} is not a ChipSpec field; "
                f"{one_of(unknown[0], CHIP_FIELDS, listing=CHIP_KEYS_LISTING)}", CHIP_KEYS_CALL
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
FIELD_RANGES: dict[str, tuple] = {
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

# Where every chip key is listed (the unknown-key messages point there): a Python call, a
# placeholder of the message (its param) that the CLI spells as the command that prints them
# (`sim.cli.common.API_COMMANDS`).
CHIP_KEYS_CALL = "sim.get_chip('v5e').to_dict()"
CHIP_KEYS_LISTING = "`{" + CHIP_KEYS_CALL + "}` prints every key"
