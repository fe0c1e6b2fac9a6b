"""Perturbations of a pod (`Scenario`): slow or fast chips, slow and dead links, chip-to-chip
speed variation and MoE router skew, parsed from a run's settings (`scenario_from_flags`) or a
scenario YAML and checked against a `Topology`.

A `Scenario` holds coordinates, not ids, so it can be built before the pod is known; the
`*_for(topology)` methods validate it against a pod and resolve it to chip and link ids.

The settings, by their Python names (the lists take one entry per item; the same strings are
accepted as list entries in YAML):

* `slow_chip` `X,Y[,Z]:FACTOR`: the chip's MXU, VPU and HBM run at FACTOR x their speed;
* `slow_link` `X,Y[,Z]:AXISDIR[:FACTOR]`: the directed link leaving chip X,Y[,Z] along AXISDIR
  (`x+`, `y-`, ...) carries FACTOR x its bandwidth (default 0.5, as `collective` always had);
* `dead_link` `X,Y[,Z]:AXISDIR`: that directed link carries nothing (a dead cable is both
  directions: give `X,Y:x+` and the neighbour's `x-`);
* `chip_variation` SIGMA and `seed` N: every chip's speed is drawn independently from a lognormal
  with median 1 and log-standard-deviation SIGMA;
* `expert_skew` S, `capacity_factor` C: MoE router imbalance and token capacity;
* `failed_chip` `X,Y[,Z]` with `spare_cubes` N and `no_ocs`: a chip that has failed. On a
  v4/v5p slice of whole 4x4x4 cubes (optical switches, `Topology.ocs`) with a spare cube left,
  the switches swap the cube holding it for a spare: the slice is whole again (`Failures`
  lists the swap; its one-time cost is `ChipSpec.ocs_reconfiguration_s`). Without a spare, with
  `no_ocs` (a static pod) or on a pod without switches, the chip's links in and out are dead
  and routes detour around it (`dead_link_ids_for`); a transfer to or from the chip itself has
  no route, and the run is refused.

FACTOR > 1 is allowed everywhere (a faster chip or link). On a multi-slice pod a coordinate may
carry the slice index last (`X,Y,Z,S`); without it it names slice 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from topologies.errors import TpusimError
from topologies.torus import AXIS_NAMES, Topology
from topologies.validate import (
    CAPACITY_FACTOR_RANGE,
    CHIP_VARIATION_RANGE,
    EXPERT_SKEW_RANGE,
    NumberRange,
    ascii_float,
    ascii_int,
    interval_text,
    one_of,
    short_repr,
)

Coords = tuple[int, ...]

# YAML keys of a scenario file (the flag names with `_` for `-`).
SCENARIO_KEYS = (
    "slow_chip", "slow_link", "dead_link", "chip_variation", "seed", "expert_skew",
    "capacity_factor", "failed_chip", "spare_cubes", "no_ocs", "twist",
)
# The most spare cubes a run may name (a v5p pod has 140 cubes in all).
MAX_SPARE_CUBES = 10_000
DEFAULT_SLOW_LINK_FACTOR = 0.5




@dataclass(frozen=True, slots=True, kw_only=True)
class SlowChip:
    coords: Coords
    factor: float

    def to_flag(self) -> str:
        return f"{_coord_text(self.coords)}:{self.factor!r}"


@dataclass(frozen=True, slots=True, kw_only=True)
class SlowLink:
    coords: Coords
    axisdir: str  # e.g. "x+"
    factor: float

    def to_flag(self) -> str:
        return f"{_coord_text(self.coords)}:{self.axisdir}:{self.factor!r}"


@dataclass(frozen=True, slots=True, kw_only=True)
class DeadLink:
    coords: Coords
    axisdir: str

    def to_flag(self) -> str:
        return f"{_coord_text(self.coords)}:{self.axisdir}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Failures:
    """What the failed chips of a scenario do to one pod (`Scenario.failures_for`).

    Attributes:
        failed_chips: chip ids that failed, in the order given (each once).
        swapped_cubes: the cubes swapped for spares, as (slice, cube x, cube y, cube z) in
            cube units, in the order their first failed chip was given.
        routed_chips: failed chips no spare replaces: their links are dead.
        dead_links: every ICI link id into or out of a routed chip, sorted.
        spare_cubes: spares available; `spares_left` after the swaps.
        why_not_swapped: why the routed chips were not swapped ("" if every cube was), a
            message template naming the settings of `SCENARIO_SETTINGS` as `{name}` placeholders
            (`TpusimError`'s): `failure_report` renders it, an error builds on it.
    """

    failed_chips: tuple[int, ...] = ()
    swapped_cubes: tuple[tuple[int, ...], ...] = ()
    routed_chips: tuple[int, ...] = ()
    dead_links: tuple[int, ...] = ()
    spare_cubes: int = 0
    why_not_swapped: str = ""

    @property
    def spares_left(self) -> int:
        return self.spare_cubes - len(self.swapped_cubes)

    @property
    def action(self) -> str:
        """`cube swap`, `route around`, `cube swap and route around`, or `none`."""
        if not self.failed_chips:
            return "none"
        if self.swapped_cubes and self.routed_chips:
            return "cube swap and route around"
        return "cube swap" if self.swapped_cubes else "route around"


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    """The perturbations of one run. The default (empty) scenario is the healthy pod.

    Attributes:
        slow_chips: chips whose MXU, VPU and HBM run at `factor` x (repeats multiply).
        slow_links: directed links whose bandwidth is `factor` x (repeats multiply).
        dead_links: directed links that carry nothing.
        chip_variation_sigma: log-standard-deviation of every chip's speed (0 = none).
        seed: seed of the chip-variation draw.
        expert_skew: Zipf exponent of the MoE router's expert loads (0 = balanced).
        capacity_factor: MoE expert capacity as a multiple of the balanced load (None = no
            dropping).
        failed_chips: coordinates of chips that failed (`failures_for`).
        spare_cubes: spare 4x4x4 cubes the optical switches may swap in for failed ones.
        no_ocs: the pod's switches do not swap cubes (a static pod): failed chips are routed
            around whatever the spares.
        twist: the slice is a twisted torus (a scenario file's `twist: true`, read when the pod
            is built; the `twist` setting of a run).
    """

    slow_chips: tuple[SlowChip, ...] = ()
    slow_links: tuple[SlowLink, ...] = ()
    dead_links: tuple[DeadLink, ...] = ()
    chip_variation_sigma: float = 0.0
    seed: int = 0
    expert_skew: float = 0.0
    capacity_factor: float | None = None
    failed_chips: tuple[Coords, ...] = ()
    spare_cubes: int = 0
    no_ocs: bool = False
    twist: bool = False

    def __post_init__(self) -> None:
        for s in self.slow_chips:
            _check_factor(s.factor, f"{{slow_chip}} {s.to_flag()}")
        for s in self.slow_links:
            _check_factor(s.factor, f"{{slow_link}} {s.to_flag()}")
        sigma = self.chip_variation_sigma
        if not CHIP_VARIATION_RANGE.holds(sigma):
            raise TpusimError(
                f"{{chip_variation}} {short_repr(sigma)} must be {CHIP_VARIATION_RANGE.text} (the "
                f"log-standard-deviation of chip speed, e.g. 0.02 for 2%)", "chip_variation"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or not (
            0 <= self.seed < 2**63
        ):
            raise TpusimError(f"{{seed}} {short_repr(self.seed)} must be a whole number in "
                              f"[0, 2^63)", "seed")
        s = self.expert_skew
        if not EXPERT_SKEW_RANGE.holds(s):
            raise TpusimError(
                f"{{expert_skew}} {short_repr(s)} must be {EXPERT_SKEW_RANGE.text} (the Zipf "
                f"exponent of expert loads; 0 = a balanced router)", "expert_skew"
            )
        n = self.spare_cubes
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) \
                or not 0 <= n <= MAX_SPARE_CUBES:
            raise TpusimError(f"{{spare_cubes}} {short_repr(n)} must be a whole number from 0 to "
                              f"{MAX_SPARE_CUBES:,} (spare 4x4x4 cubes the switches may swap "
                              f"in)", "spare_cubes")
        c = self.capacity_factor
        if c is not None and not CAPACITY_FACTOR_RANGE.holds(c):
            raise TpusimError(
                f"{{capacity_factor}} {short_repr(c)} must be {CAPACITY_FACTOR_RANGE.text} (tokens "
                f"an expert accepts as a multiple of the balanced load, e.g. 1.25)",
                "capacity_factor"
            )

    # -- what it touches ---------------------------------------------------------------------
    @property
    def is_healthy(self) -> bool:
        """True when nothing differs from the uniform pod (the fast path applies)."""
        return not (self.slow_chips or self.slow_links or self.dead_links
                    or self.chip_variation_sigma > 0 or self.expert_skew > 0
                    or self.capacity_factor is not None or self.failed_chips)

    @property
    def perturbs_links(self) -> bool:
        return bool(self.slow_links or self.dead_links)

    @property
    def perturbs_chips(self) -> bool:
        return bool(self.slow_chips or self.chip_variation_sigma > 0)

    # -- resolution against a pod ------------------------------------------------------------
    def validate(self, topology: Topology) -> None:
        """Raise a one-line `TpusimError` for anything that does not fit `topology`."""
        self.chip_speed_factors_for(topology)
        self.link_factors_for(topology)
        if self.twist and not topology.twisted:
            raise TpusimError(
                f"the scenario says twist: true but the {topology.name} pod is plain; build it "
                f"with {{twist}} (or drop twist from the scenario)", "twist")

    def failures_for(self, topology: Topology) -> Failures:
        """What the failed chips do on `topology`: which cubes are swapped for spares (a pod of
        cubes joined by optical switches, `Topology.ocs`, not `no_ocs`: one spare per cube
        holding a failed chip, in the order given, while spares last) and which chips are
        routed around (their links dead). A chip outside the pod is an error."""
        chips: list[int] = []
        for c in self.failed_chips:
            chip = _chip_id(topology, c, f"{{failed_chip}} {_coord_text(c)}")
            if chip not in chips:
                chips.append(chip)
        if not chips:
            return Failures(spare_cubes=int(self.spare_cubes))
        if not topology.ocs:
            why = (f"the {topology.name} pod has no optical switches to swap a cube in (a "
                   f"v4/v5p slice of whole 4x4x4 cubes has)")
        elif self.no_ocs:
            why = "{no_ocs}: the switches do not swap cubes"
        else:
            why = ""
        swapped: list[tuple[int, ...]] = []
        routed: list[int] = []
        for chip in chips:
            cube = _cube_of(topology, chip)
            if cube in swapped:
                continue
            if not why and len(swapped) < self.spare_cubes:
                swapped.append(cube)
            else:
                routed.append(chip)
        if routed and not why:
            why = ("{spare_cubes} 0" if not self.spare_cubes else
                   f"{{spare_cubes}} {self.spare_cubes}: no spare left for "
                   f"{'the cube' if len(routed) == 1 else 'every cube'} of "
                   f"{', '.join(_fmt_chip(topology, c) for c in routed)}")
        routed = [c for c in routed if _cube_of(topology, c) not in swapped]
        return Failures(failed_chips=tuple(chips), swapped_cubes=tuple(swapped),
                        routed_chips=tuple(routed), dead_links=_links_of(topology, routed),
                        spare_cubes=int(self.spare_cubes), why_not_swapped=why if routed else "")

    def slow_chip_factors_for(self, topology: Topology) -> dict[int, float]:
        """{chip id: speed factor} of the `slow_chips` (repeats multiply)."""
        out: dict[int, float] = {}
        for s in self.slow_chips:
            chip = _chip_id(topology, s.coords, f"{{slow_chip}} {s.to_flag()}")
            out[chip] = out.get(chip, 1.0) * s.factor
            _check_factor(out[chip], f"{{slow_chip}} {s.to_flag()} (with the others for this chip)")
        return out

    def chip_speed_factors_for(self, topology: Topology) -> np.ndarray:
        """Speed factor of every chip (float array, `num_chips` long): the chip-variation draw
        (lognormal, median 1, from `seed`) times the slow-chip factors. All ones when healthy."""
        speed = np.ones(topology.num_chips)
        if self.chip_variation_sigma > 0:
            rng = np.random.default_rng(self.seed)
            speed = rng.lognormal(mean=0.0, sigma=self.chip_variation_sigma,
                                  size=topology.num_chips)
        for chip, f in self.slow_chip_factors_for(topology).items():
            speed[chip] *= f
        return speed

    def slow_link_factors_for(self, topology: Topology) -> dict[int, float]:
        """{ICI link id: bandwidth factor} of the `slow_links` (repeats multiply)."""
        out: dict[int, float] = {}
        for s in self.slow_links:
            link = _link_id(topology, s.coords, s.axisdir, f"{{slow_link}} {s.to_flag()}")
            out[link] = out.get(link, 1.0) * s.factor
            _check_factor(out[link], f"{{slow_link}} {s.to_flag()} (with the others for this link)")
        return out

    def dead_link_ids_for(self, topology: Topology) -> tuple[int, ...]:
        """Sorted ICI link ids of the dead links: the `dead_links`, and every link into or
        out of a failed chip no spare cube replaces (`failures_for`)."""
        return tuple(sorted({
            _link_id(topology, d.coords, d.axisdir, f"{{dead_link}} {d.to_flag()}")
            for d in self.dead_links
        } | set(self.failures_for(topology).dead_links)))

    def link_factors_for(self, topology: Topology) -> np.ndarray:
        """Bandwidth factor of every link id (`topology.num_links` long): the slow-link factors,
        0 on dead links, 1 elsewhere. A link both slow and dead is an error."""
        f = np.ones(topology.num_links)
        slow = self.slow_link_factors_for(topology)
        for link, x in slow.items():
            f[link] = x
        failed = set(self.failures_for(topology).dead_links)
        for link in self.dead_link_ids_for(topology):
            if link in slow and link not in failed:  # a failed chip's links are dead anyway
                raise TpusimError(
                    f"link {topology.describe_link(link)} is given both as {{slow_link}} and "
                    f"{{dead_link}}; a dead link carries nothing, so drop one of them", "slow_link",
                    "dead_link"
                )
            f[link] = 0.0
        return f

    # -- files -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The scenario YAML mapping (only the keys that differ from the default)."""
        d: dict[str, Any] = {}
        if self.slow_chips:
            d["slow_chip"] = [s.to_flag() for s in self.slow_chips]
        if self.slow_links:
            d["slow_link"] = [s.to_flag() for s in self.slow_links]
        if self.dead_links:
            d["dead_link"] = [s.to_flag() for s in self.dead_links]
        if self.chip_variation_sigma:
            d["chip_variation"] = float(self.chip_variation_sigma)
        if self.seed:
            d["seed"] = int(self.seed)
        if self.expert_skew:
            d["expert_skew"] = float(self.expert_skew)
        if self.capacity_factor is not None:
            d["capacity_factor"] = float(self.capacity_factor)
        if self.failed_chips:
            d["failed_chip"] = [_coord_text(c) for c in self.failed_chips]
        if self.spare_cubes:
            d["spare_cubes"] = int(self.spare_cubes)
        if self.no_ocs:
            d["no_ocs"] = True
        if self.twist:
            d["twist"] = True
        return d

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def merged(self, other: Scenario) -> Scenario:
        """`self` with `other`'s entries added (lists concatenate; `other`'s scalars win where
        they are not the default)."""
        return Scenario(
            slow_chips=self.slow_chips + other.slow_chips,
            slow_links=self.slow_links + other.slow_links,
            dead_links=self.dead_links + other.dead_links,
            chip_variation_sigma=other.chip_variation_sigma or self.chip_variation_sigma,
            seed=other.seed or self.seed,
            expert_skew=other.expert_skew or self.expert_skew,
            capacity_factor=(other.capacity_factor if other.capacity_factor is not None
                             else self.capacity_factor),
            failed_chips=self.failed_chips + other.failed_chips,
            spare_cubes=other.spare_cubes or self.spare_cubes,
            no_ocs=self.no_ocs or other.no_ocs,
            twist=self.twist or other.twist,
        )


# -- parsing -----------------------------------------------------------------------------------
# The settings a scenario's errors name, as `{name}` placeholders (topologies/errors.py): a
# message built on a `what` prefix (`{slow_chip} 0,0:0.5`) may hold any of them.
SCENARIO_SETTINGS = ("slow_chip", "slow_link", "dead_link", "failed_chip", "chip_variation", "seed",
             "expert_skew", "capacity_factor", "spare_cubes", "no_ocs", "twist")


def _error(message: str) -> TpusimError:
    """A scenario error whose message may name any of `SCENARIO_SETTINGS`."""
    return TpusimError(message, *SCENARIO_SETTINGS)


def _coord_text(c: Coords) -> str:
    return ",".join(str(v) for v in c)


# Range of a slow-chip/slow-link factor (alone, or several given for one chip or link
# multiplied): a validation limit that keeps every time finite and every rate far from
# underflow (a factor of 1e-320 used to pass and print Infinity).
MIN_FACTOR, MAX_FACTOR = 1e-6, 1e6


def _check_factor(factor: Any, what: str) -> None:
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (
        math.isfinite(factor) and MIN_FACTOR <= factor <= MAX_FACTOR
    ):
        raise _error(
            f"{what}: factor {short_repr(factor)} must be a finite number > 0, in "
            f"{interval_text(MIN_FACTOR, MAX_FACTOR)} (speed relative to nominal; 0.5 = half "
            f"speed, 2 = twice as fast; "
            f"factors given for the same chip or link multiply)"
        )


def _parse_coords(text: str, flag: str, spec: str) -> Coords:
    try:
        coords = tuple(ascii_int(c, max_digits=9) for c in text.split(","))
    except ValueError:
        raise _error(
            f"{flag} {short_repr(spec)}: chip coordinates {short_repr(text)} must be integers "
            f"like 0,0 or 1,2,3"
        ) from None
    return coords


def _parse_factor(text: str, flag: str, spec: str) -> float:
    try:
        f = ascii_float(text)
    except ValueError:
        raise _error(
            f"{flag} {short_repr(spec)}: factor {short_repr(text)} is not a number; give e.g. "
            f"0.5 (half speed)"
        ) from None
    _check_factor(f, f"{flag} {spec}")
    return f


def _parse_axisdir(text: str, flag: str, spec: str) -> str:
    ad = text.strip()
    if len(ad) != 2 or ad[0] not in AXIS_NAMES or ad[1] not in "+-":
        raise _error(
            f"{flag} {short_repr(spec)}: the link {short_repr(ad)} must be an axis letter and a "
            f"direction, such as "
            f"x+ or y-"
        )
    return ad


def parse_slow_chip(spec: str) -> SlowChip:
    """`"3,5,7:0.8"` -> SlowChip((3, 5, 7), 0.8)."""
    parts = str(spec).split(":")
    if len(parts) != 2:
        raise TpusimError(
            f"{{slow_chip}} {short_repr(spec)} is not like 3,5,7:0.8 (chip coordinates : speed "
            f"factor)", "slow_chip"
        )
    return SlowChip(coords=_parse_coords(parts[0], "{slow_chip}", spec),
                    factor=_parse_factor(parts[1], "{slow_chip}", spec))


def parse_slow_link(spec: str) -> SlowLink:
    """`"0,0:x+:0.5"` -> SlowLink((0, 0), "x+", 0.5); the factor defaults to 0.5."""
    parts = str(spec).split(":")
    if len(parts) not in (2, 3):
        raise TpusimError(
            f"{{slow_link}} {short_repr(spec)} is not like 0,0:x+:0.5 (chip coordinates : axis and "
            f"direction "
            f": bandwidth factor)", "slow_link"
        )
    factor = (_parse_factor(parts[2], "{slow_link}", spec) if len(parts) == 3
              else DEFAULT_SLOW_LINK_FACTOR)
    return SlowLink(coords=_parse_coords(parts[0], "{slow_link}", spec),
                    axisdir=_parse_axisdir(parts[1], "{slow_link}", spec), factor=factor)


def parse_dead_link(spec: str) -> DeadLink:
    """`"0,0:x+"` -> DeadLink((0, 0), "x+")."""
    parts = str(spec).split(":")
    if len(parts) != 2:
        raise TpusimError(
            f"{{dead_link}} {short_repr(spec)} is not like 0,0:x+ (chip coordinates : axis and "
            f"direction)", "dead_link"
        )
    return DeadLink(coords=_parse_coords(parts[0], "{dead_link}", spec),
                    axisdir=_parse_axisdir(parts[1], "{dead_link}", spec))


def parse_failed_chip(spec: str) -> Coords:
    """`"1,2,3"` -> (1, 2, 3): a failed chip's coordinates (slice index last if several)."""
    text = str(spec).strip()
    if ":" in text or not text:
        raise TpusimError(
            f"{{failed_chip}} {short_repr(spec)} is not like 1,2,3 (the chip's coordinates, "
            f"x,y[,z][,slice])", "failed_chip")
    return _parse_coords(text, "{failed_chip}", spec)


def scenario_from_flags(
    *,
    slow_chip: tuple[str, ...] | list[str] = (),
    slow_link: tuple[str, ...] | list[str] = (),
    dead_link: tuple[str, ...] | list[str] = (),
    chip_variation: float = 0.0,
    seed: int = 0,
    expert_skew: float = 0.0,
    capacity_factor: float | None = None,
    failed_chip: tuple[str, ...] | list[str] = (),
    spare_cubes: int = 0,
    no_ocs: bool = False,
    twist: bool = False,
) -> Scenario:
    """A `Scenario` from the flag strings (not yet checked against a pod)."""
    return Scenario(
        slow_chips=tuple(parse_slow_chip(s) for s in slow_chip),
        slow_links=tuple(parse_slow_link(s) for s in slow_link),
        dead_links=tuple(parse_dead_link(s) for s in dead_link),
        chip_variation_sigma=chip_variation,
        seed=seed,
        expert_skew=expert_skew,
        capacity_factor=capacity_factor,
        failed_chips=tuple(parse_failed_chip(s) for s in failed_chip),
        spare_cubes=spare_cubes,
        no_ocs=bool(no_ocs),
        twist=bool(twist),
    )


def scenario_from_dict(data: dict[str, Any], *, source: str = "scenario") -> Scenario:
    """A `Scenario` from a scenario YAML mapping (keys `SCENARIO_KEYS`).

    List entries are flag strings (`"3,5,7:0.8"`) or mappings (`{chip: [3, 5, 7], factor:
    0.8}`; links add `link: x+`).
    """
    if not isinstance(data, dict):
        raise TpusimError(f"{source} must be a mapping of `key: value` lines")
    unknown = sorted(str(k) for k in data if k not in SCENARIO_KEYS)
    if unknown:
        raise TpusimError(
            f"{source}: unknown key(s) {', '.join(unknown)[:200]}; "
            f"{one_of(unknown[0], SCENARIO_KEYS)}"
        )
    lists = {}
    for key, kind in (("slow_chip", "chip"), ("slow_link", "link"), ("dead_link", "dead"),
                      ("failed_chip", "failed")):
        value = data.get(key) or []
        if not isinstance(value, list):
            raise TpusimError(
                f"{source}: {key} must be a list (one entry per {key.replace('_', ' ')}), got "
                f"{type(value).__name__}"
            )
        lists[key] = [_entry_text(v, key, kind, source) for v in value]
    scalars: dict[str, Any] = {}
    for key in ("chip_variation", "expert_skew", "capacity_factor"):
        v = data.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TpusimError(f"{source}: {key} {v!r} must be a number")
        scalars[key] = float(v)
    seed = data.get("seed", 0)
    if seed is None:
        seed = 0
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TpusimError(f"{source}: seed {seed!r} must be a whole number >= 0")
    spares = data.get("spare_cubes", 0)
    if spares is None:
        spares = 0
    if isinstance(spares, bool) or not isinstance(spares, int):
        raise TpusimError(f"{source}: spare_cubes {short_repr(spares)} must be a whole number "
                          f">= 0")
    switches = {}
    for key in ("no_ocs", "twist"):
        v = data.get(key, False)
        if v is None:
            v = False
        if not isinstance(v, bool):
            raise TpusimError(f"{source}: {key} {short_repr(v)} must be true or false")
        switches[key] = v
    return scenario_from_flags(**lists, seed=seed, **scalars, spare_cubes=spares, **switches)


def _entry_text(v: Any, key: str, kind: str, source: str) -> str:
    if isinstance(v, str):
        return v
    if kind == "failed" and isinstance(v, list):  # [x, y, z]
        v = {"chip": v}
    if isinstance(v, dict):
        allowed = {"chip": ("chip", "factor"), "link": ("chip", "link", "factor"),
                   "dead": ("chip", "link"), "failed": ("chip",)}[kind]
        bad = sorted(str(k) for k in v if k not in allowed)
        missing = [k for k in allowed if k not in v and not (k == "factor" and kind == "link")]
        if bad or missing:
            raise TpusimError(
                f"{source}: a {key} entry {v!r} must have the keys {', '.join(allowed)}"
                + (" (factor optional)" if kind == "link" else "")
            )
        chip = v["chip"]
        if not isinstance(chip, list) or not all(
            isinstance(c, int) and not isinstance(c, bool) for c in chip
        ):
            raise TpusimError(
                f"{source}: {key} chip {chip!r} must be a list of integers like [0, 0, 0]"
            )
        text = _coord_text(tuple(chip))
        if kind not in ("chip", "failed"):
            text += f":{v['link']}"
        if "factor" in v:
            f = v["factor"]
            if isinstance(f, bool) or not isinstance(f, (int, float)):
                raise TpusimError(f"{source}: {key} factor {f!r} must be a number")
            text += f":{float(f)!r}"
        return text
    raise TpusimError(
        f"{source}: a {key} entry must be a string like the flag's or a mapping, got {v!r}"
    )


def load_scenario(path) -> Scenario:
    """Read a scenario YAML (or JSON) file; the only function here that touches the disk."""
    from pathlib import Path

    # deferred: PyYAML (topologies.yamlio) loads only when a scenario file is read
    from topologies.yamlio import read_yaml_mapping

    p = Path(path)
    data = read_yaml_mapping(p, what="scenario")
    return scenario_from_dict(data, source=f"scenario file {str(p)!r}")


# -- resolution helpers ------------------------------------------------------------------------
def _chip_id(topology: Topology, coords: Coords, what: str) -> int:
    n_ok = (topology.ndim, topology.ndim + 1) if topology.num_slices > 1 else (topology.ndim,)
    if len(coords) not in n_ok:
        raise _error(
            f"{what}: chip coordinates {_coord_text(coords)} have {len(coords)} value(s) but the "
            f"{topology.name} pod needs {' or '.join(map(str, n_ok))} (x"
            f"{', y' if topology.ndim > 1 else ''}{', z' if topology.ndim > 2 else ''}"
            f"{', slice' if topology.num_slices > 1 else ''})"
        )
    for name, n, c in zip(AXIS_NAMES, topology.shape, coords, strict=False):
        if not 0 <= c < n:
            raise _error(
                f"{what}: coordinate {name}={c} is outside the {topology.name} pod; "
                f"{name} must be in 0..{n - 1}"
            )
    if len(coords) > topology.ndim and not 0 <= coords[-1] < topology.num_slices:
        raise _error(
            f"{what}: slice index {coords[-1]} is outside 0..{topology.num_slices - 1}"
        )
    return topology.chip_id(coords)


def _cube_of(topology: Topology, chip: int) -> tuple[int, ...]:
    """(slice, cube coordinates) of a chip: the 4x4x4 cube holding it on a pod of cubes."""
    c = topology.coords(chip)
    sl = c[topology.ndim] if topology.num_slices > 1 else 0
    return (sl, *(v // _CUBE for v in c[: topology.ndim]))


_CUBE = 4  # the side of a v4/v5p cube (topologies/slices.py CUBE_SIDE)


def _fmt_chip(topology: Topology, chip: int) -> str:
    return _coord_text(topology.coords(chip))


def _links_of(topology: Topology, chips: list[int]) -> tuple[int, ...]:
    """Every existing ICI link id into or out of the given chips, sorted."""
    if not chips:
        return ()
    src, dst = topology.link_endpoints()
    hit = np.isin(src, chips) | np.isin(dst, chips)
    return tuple(int(x) for x in np.flatnonzero(hit & (src >= 0)))


def _link_id(topology: Topology, coords: Coords, axisdir: str, what: str) -> int:
    chip = _chip_id(topology, coords, what)
    axis = axisdir[0]
    if axis not in AXIS_NAMES[: topology.ndim]:
        raise _error(
            f"{what}: the {topology.name} pod has no {axis} axis; its axes are "
            f"{', '.join(AXIS_NAMES[: topology.ndim])}"
        )
    a = AXIS_NAMES.index(axis)
    link = topology.ici_link_id(chip, a, 1 if axisdir[1] == "+" else -1)
    if not topology.link_mask()[link]:
        why = ("the axis has a single chip" if topology.shape[a] == 1 else
               "edge of an axis without wraparound")
        raise _error(
            f"{what}: chip {_coord_text(coords)} has no {axisdir} link in the {topology.name} "
            f"pod ({why}); pick a link that exists"
        )
    return link


__all__ = [
    "CAPACITY_FACTOR_RANGE", "CHIP_VARIATION_RANGE", "DeadLink", "EXPERT_SKEW_RANGE", "Failures",
    "NumberRange", "SCENARIO_KEYS", "SCENARIO_SETTINGS", "Scenario", "SlowChip", "SlowLink",
    "load_scenario",
    "parse_dead_link", "parse_failed_chip", "parse_slow_chip", "parse_slow_link",
    "scenario_from_dict",
    "scenario_from_flags",
]
