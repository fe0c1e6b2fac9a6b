"""Shared test fixtures: chip presets, a topology builder, and the reference-data directory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from sim.hardware import ChipSpec, get_chip
from topologies.slices import resolve_topology
from topologies.torus import Topology

# The reference material lives beside the repo (../shared/reference), not inside it.
REFERENCE_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "reference"


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
    """`../shared/reference` beside the repo; tests that need it skip in a bare clone."""
    if not REFERENCE_DIR.is_dir():
        pytest.skip(
            f"reference data {REFERENCE_DIR} is absent (it lives outside the repo, in shared/)"
        )
    return REFERENCE_DIR
