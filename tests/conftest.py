"""Shared test fixtures: chip presets, a topology builder, and the reference-data directory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from sim.chips import get_chip
from sim.hardware import ChipSpec
from topologies.slices import resolve_topology
from topologies.torus import Topology

# The reference material, copied into the repo with its sources (docs/reference/README.md).
REFERENCE_DIR = Path(__file__).resolve().parents[1] / "docs" / "reference"


def make_topology(
    chip: ChipSpec, shape: str, wrap: str = "auto", slices: int = 1
) -> Topology:
    """The pod the CLI would build from `--chip/--shape/--wraparound/--slices`."""
    return resolve_topology(
        chip_name=chip.name,
        wrap_rule=chip.generation_rule,
        max_pod_shape=chip.max_pod_shape,
        shape=shape,
        wraparound=wrap,
        num_slices=slices,
    )


@pytest.fixture
def v5e() -> ChipSpec:
    return get_chip("v5e")


@pytest.fixture
def v5p() -> ChipSpec:
    return get_chip("v5p")


@pytest.fixture
def v4() -> ChipSpec:
    return get_chip("v4")


@pytest.fixture
def topo() -> Callable[..., Topology]:
    """`topo(chip, "8x4", wrap="auto", slices=1)` -> Topology, as the CLI resolves it."""
    return make_topology


@pytest.fixture
def reference_dir() -> Path:
    """The reference data copied into the repo (docs/reference/, sources in its README)."""
    return REFERENCE_DIR
