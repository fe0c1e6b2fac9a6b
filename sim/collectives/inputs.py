"""A collective's inputs checked and resolved before anything is routed: its bytes, its mode, the
slow and dead links it runs under (a collective runs on links only), and its group axes."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from sim.collectives.algorithms import CollectiveKind
from topologies.errors import TpusimError
from topologies.groups import GroupAxis, group_axes, with_twist
from topologies.scenario import Scenario, parse_slow_link
from topologies.torus import AXIS_NAMES, DCN_AXIS, Topology

MODES = ("auto", "symmetric", "full", "per-chip")


def check_links_only(scenario: Scenario) -> None:
    """Refuse the perturbations a collective cannot take: it runs on links, not chips."""
    if scenario.perturbs_chips or scenario.expert_skew or scenario.capacity_factor:
        raise TpusimError(
            "a collective is simulated on links only: {slow_chip}, {chip_variation}, "
            "{expert_skew} and {capacity_factor} do not apply to it; use them with train, "
            "decode, prefill or replay", "slow_chip", "chip_variation", "expert_skew",
            "capacity_factor")


def slow_link_factors(
    topology: Topology, slow_links: tuple[str, ...] | dict[int, float], scenario: Scenario | None
) -> dict[int, float]:
    """{link id: bandwidth factor} of the `slow_links` argument plus the scenario's."""
    if isinstance(slow_links, dict):
        slow = dict(slow_links)
    else:
        extra = Scenario(slow_links=tuple(parse_slow_link(s) for s in slow_links))
        slow = extra.slow_link_factors_for(topology)
    if scenario is not None:
        check_links_only(scenario)
        for link, f in scenario.slow_link_factors_for(topology).items():
            slow[link] = slow.get(link, 1.0) * f
    return slow


def check_bytes(nbytes: Any, kind: CollectiveKind, group_size: int, name: str = "nbytes") -> int:
    """`nbytes` as a whole number of bytes > 0 that splits evenly over `group_size` chips
    (send and permute move it whole); errors name it as the argument `name` (`nbytes` of
    `simulate_collective`, `bytes` of a request)."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)):
        if isinstance(nbytes, float) and nbytes.is_integer():
            nbytes = int(nbytes)
        else:
            raise TpusimError(f"{{{name}}} {nbytes!r} must be a whole number of bytes", name)
    if nbytes <= 0:
        raise TpusimError(f"{{{name}}} {nbytes} must be > 0 (V is the size of the whole array)",
                          name)
    if kind in (CollectiveKind.SEND, CollectiveKind.PERMUTE):
        return int(nbytes)
    if nbytes % group_size:
        raise TpusimError(
            f"{{{name}}} {nbytes} is not divisible by the group size {group_size}: each chip "
            f"holds V/{group_size}; use a multiple of {group_size} (e.g. "
            f"{math.ceil(nbytes / group_size) * group_size})", name)
    return int(nbytes)


def link_axis(topology: Topology, link: int) -> str:
    if link >= topology.num_ici_links:
        return DCN_AXIS
    return AXIS_NAMES[(link % (2 * topology.ndim)) // 2]


def link_src(topology: Topology, link: int) -> int:
    return link // (2 * topology.ndim)


def scenario_without_dead_links(scenario: Scenario | None) -> Scenario | None:
    if scenario is None:
        return None
    return dataclasses.replace(scenario, dead_links=(), failed_chips=())


def group_axes_of(topology: Topology, axes: tuple[str, ...] | tuple[GroupAxis, ...] | str
                  ) -> tuple[GroupAxis, ...]:
    """The replica group's axes: physical axis names (`("y",)`, `"x,y"`, `dcn`), or factors of
    physical axes (`GroupAxis`es, from a logical mesh), with the pod's twist applied."""
    if isinstance(axes, str):
        axes = tuple(a.strip() for a in axes.split(",") if a.strip())
    if axes and all(isinstance(a, GroupAxis) for a in axes):
        gaxes = tuple(axes)
    else:
        gaxes = group_axes(topology, tuple(axes))
    return with_twist(topology, gaxes)


def dead_link_ids(topology: Topology, dead_links: tuple[int, ...],
                  scenario: Scenario | None) -> tuple[int, ...]:
    """The `dead_links` argument and the scenario's dead links, as sorted ICI link ids."""
    dead = tuple(sorted(
        {int(d) for d in dead_links}
        | set(scenario.dead_link_ids_for(topology) if scenario is not None else ())
    ))
    if any(not 0 <= d < topology.num_ici_links or not topology.link_mask()[d] for d in dead):
        raise TpusimError(f"dead link ids {dead} must be ICI links of the {topology.name} pod")
    return dead
