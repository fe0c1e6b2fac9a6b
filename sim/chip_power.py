"""The chip presets' power and price coefficients, from docs/reference/power.md's public
figures: v3 and v4 fitted to their measured power, later generations derived from a published
ratio of performance per watt (docs/model/energy.md says how far to trust each number).
`PRESET_POWER[name]` holds the `ChipSpec` power and price fields of each preset
(`sim/chips.py`); `POWER_ASSUMED` says where each assumed coefficient comes from.
"""

from __future__ import annotations

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
PRESET_POWER: dict[str, dict] = {n: _measured_power(n, *_PEAKS[n]) for n in MEASURED_POWER_W}
for _name, (_base, _ratio) in POWER_DERIVATION.items():
    PRESET_POWER[_name] = _derived_power(PRESET_POWER[_base], _PEAKS[_base][0],
                                         _PEAKS[_base][2], _ratio, *_PEAKS[_name], _name)

# The power and price fields (`tpusim presets` says where each preset's value comes from).
POWER_FIELDS = ("mxu_j_per_flop", "mxu_int8_j_per_op", "vpu_j_per_flop", "hbm_j_per_byte",
                "ici_j_per_byte", "dcn_j_per_byte", "pcie_j_per_byte", "idle_power_w",
                "host_power_share", "pue", "usd_per_chip_hour", "clock_scale",
                "clock_energy_exponent")
POWER_ASSUMED = {
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

