"""The request of one collective (`tpusim collective`) and of one collective under every
algorithm (`tpusim compare-collectives`)."""

from __future__ import annotations

from typing import ClassVar

from sim.runs.requests.base import (
    PERTURB_FIELDS,
    POD_FIELDS,
    SPARE_FIELDS,
    PerturbedRequest,
    request_dataclass,
)


@request_dataclass
class CollectiveRequest(PerturbedRequest):
    """One collective (`tpusim collective`): `op` over the pod's `axes` with `bytes` V."""

    COMMAND: ClassVar[str] = "collective"
    FLAGS: ClassVar[tuple[str, ...]] = (
        *POD_FIELDS, "overrides", "op", "axes", "bytes", "algorithm", "src", "dst", "shift",
        *PERTURB_FIELDS, *SPARE_FIELDS, "mode", "chunks")
    REQUIRED: ClassVar[tuple[str, ...]] = ("op", "bytes")
    SET_SCOPE: ClassVar[tuple[str, ...] | None] = ("chip", "topology", "collective")

    op: str | None = None
    axes: str = ""
    bytes: str | int | None = None
    algorithm: str = "auto"
    src: str | None = None
    dst: str | None = None
    shift: int = 1
    chunks: int = 1


@request_dataclass
class CompareCollectivesRequest(CollectiveRequest):
    """One collective under every algorithm (`tpusim compare-collectives`)."""

    COMMAND: ClassVar[str] = "compare-collectives"
    SET_SCOPE: ClassVar[tuple[str, ...] | None] = ("chip", "topology")
    FLAGS: ClassVar[tuple[str, ...]] = (
        *POD_FIELDS, "overrides", "op", "axes", "bytes", "src", "dst", "shift", *PERTURB_FIELDS,
        *SPARE_FIELDS, "mode", "chunks")


