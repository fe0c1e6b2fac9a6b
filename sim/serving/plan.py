"""The serving plan search (`sim.plan_serving`): the deployment that serves a workload at its
rate within an SLO with the most output tokens per second per chip.

The base is a `ServeRequest`: the pod (chip and slice, one replica's), the model, the workload
(its `rate`, lengths, `requests` or `duration`, seed) and the `slo`. The search space
(`ServePlanConfig`) is every combination of a replica slice (the base's, or each of
`replica_slices`: slice names or shapes of the base's chip), a mesh of that slice's chips, a
weight and a KV-cache dtype, a batch limit and a per-iteration token budget, and a deployment:
colocated replicas, or a prefill:decode split (`(1, 2)`: one prefill replica per two decode
replicas, scaled together). For each combination the search finds the fewest replicas (up to
`max_replicas`; split deployments in whole multiples of their ratio) whose run meets the SLO:
at least `attainment` of the requests within both bounds and not saturated. Meeting the SLO is
taken as monotone in the replica count (more replicas never serve the same arrivals worse), so
the count is bisected: one run at the most replicas, then about log2 of it more. At a fixed
rate the output tokens per second are the workload's, so the most per chip is the fewest chips
that meet the SLO; ties go to the earlier candidate in the search order.

A combination whose replicas cannot hold the model or one request's cache (or whose mesh does
not fit the slice) is kept in the table with the reason and no runs. Every run is
`sim.run(ServeRequest)`, so a replica configuration's cost model is built once and reused by
every replica count tried (the grids are cached in the process).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sim.runs import run as run_request
from sim.runs.bind import resolve_pod
from sim.runs.requests import ServeRequest
from topologies.errors import Said, TpusimError, python_name, render_said
from topologies.progress import tracked


@dataclass(frozen=True, slots=True, kw_only=True)
class ServePlanConfig:
    """The search space of `plan_serving` (see the module docstring).

    Attributes:
        replica_slices: replica slices to try: slice names ("v5e-8") or shapes ("2x4", of the base's
            chip); empty: the base's.
        meshes: replica meshes to try (e.g. "tensor=8", "data=2,tensor=4"); empty: every
            data x tensor split of each slice's chips (a mesh that does not cover a slice's
            chips is a row with the reason).
        weight_dtypes, kv_dtypes: the dtypes to try (empty: the base's).
        max_batches: batch limits to try (empty: the base's).
        max_tokens_per_iter: per-iteration token budgets to try (None: no budget; empty: the
            base's).
        splits: deployments: None for colocated replicas, (p, d) for p prefill replicas per d
            decode replicas.
        max_replicas: the most replicas a deployment may use.
        attainment: the share of requests that must meet both SLO bounds.
    """

    replica_slices: tuple[str, ...] = ()
    meshes: tuple[str, ...] = ()
    weight_dtypes: tuple[str, ...] = ()
    kv_dtypes: tuple[str, ...] = ()
    max_batches: tuple[int, ...] = ()
    max_tokens_per_iter: tuple[int | None, ...] = ()
    splits: tuple[tuple[int, int] | None, ...] = (None,)
    max_replicas: int = 16
    attainment: float = 0.99


@dataclass(kw_only=True)
class ServePlan:
    """The search's outcome: `rows` (one per combination, in search order) and `best` (the
    winning row, None when no combination meets the SLO within `max_replicas`)."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    best: dict[str, Any] | None = None
    runs: int = 0

    def table(self, spell: Callable[[str], str] = python_name):
        """The rows as a DataFrame; a row's note that names settings (a refused run's error,
        a `Said`) written as `spell` writes them (the Python name; the CLI: its flags)."""
        import pandas as pd

        return pd.DataFrame(render_said(self.rows, spell))


def _default_meshes(chips: int) -> tuple[str, ...]:
    out = []
    for t in sorted({d for d in range(1, chips + 1) if chips % d == 0}, reverse=True):
        dp = chips // t
        out.append(f"tensor={t}" if dp == 1 else f"data={dp}" if t == 1 else
                   f"data={dp},tensor={t}")
    return tuple(out)


def _check(base: ServeRequest, cfg: ServePlanConfig) -> None:
    if base.rate is None or base.slo is None:
        raise TpusimError("a serving plan needs the rate to serve ({rate}) and the bounds to "
                          "meet ({slo}, e.g. ttft=0.5,tpot=0.05); give both", "rate", "slo")
    if base.prefill_replicas is not None or base.decode_replicas is not None:
        raise TpusimError("a serving plan searches the deployment: leave {prefill_replicas} "
                          "and {decode_replicas} out of the base (give splits instead)",
                          "prefill_replicas", "decode_replicas")
    if not 0 < cfg.attainment <= 1:
        raise TpusimError(f"{{attainment}} {cfg.attainment!r} is not a share; give a number "
                          f"in (0, 1], e.g. 0.99", "attainment")
    if cfg.max_replicas < 1:
        raise TpusimError(f"{{max_replicas}} {cfg.max_replicas!r} must be at least 1",
                          "max_replicas")
    for s in cfg.splits:
        if s is not None and (len(s) != 2 or min(s) < 1):
            raise TpusimError(f"{{splits}} entry {s!r} is not (prefill, decode) replicas, each "
                              f"at least 1; give e.g. (1, 2), or None for colocated",
                              "splits")


def _meets(summary, attainment: float) -> bool:
    return isinstance(summary, dict) and not summary["saturated"] and \
        summary["slo_attainment"] >= attainment


def _on_slice(base: ServeRequest, where: str | None) -> ServeRequest:
    """`base` with its replica slice set to `where` (a slice name or a shape; None: as is)."""
    if where is None:
        return base
    if where[:1].isdigit():
        chip = base.chip if base.chip is not None or base.chip_spec is not None else \
            resolve_pod(base).chip.name
        return base.replace(shape=where, slice=None, chip=chip)
    return base.replace(slice=where, shape=None, chip=None, chip_spec=None)


def _request(base: ServeRequest, combo: dict[str, Any], k: int) -> ServeRequest:
    split = combo["split"]
    base = _on_slice(base, combo["slice"])
    kw = {"mesh": combo["mesh"], "weight_dtype": combo["weight_dtype"],
          "kv_dtype": combo["kv_dtype"], "max_batch": combo["max_batch"],
          "max_tokens_per_iter": combo["max_tokens_per_iter"]}
    if split is None:
        return base.replace(replicas=k, **kw)
    return base.replace(replicas=1, prefill_replicas=split[0] * k,
                        decode_replicas=split[1] * k, **kw)


def plan_serving(base: ServeRequest, config: ServePlanConfig | None = None, *,
                 run=None) -> ServePlan:
    """Search `config`'s space around `base` (see the module docstring); `run` runs one
    `ServeRequest` (default `sim.run`)."""
    cfg = config or ServePlanConfig()
    _check(base, cfg)
    run = run or run_request
    plan = ServePlan()
    slice_meshes = []
    for where in cfg.replica_slices or (None,):
        try:
            pod = resolve_pod(_on_slice(base, where))
        except TpusimError as exc:
            raise TpusimError(f"{{replica_slices}} entry {where!r}: {exc.template}",
                              "replica_slices",
                              *exc.params) from None
        name = pod.topology.name if where is None else where
        for mesh in cfg.meshes or _default_meshes(pod.topology.num_chips):
            slice_meshes.append((where, name, mesh))
    combos = list(itertools.product(
        slice_meshes, cfg.weight_dtypes or (base.weight_dtype,), cfg.kv_dtypes or (base.kv_dtype,),
        cfg.max_batches or (base.max_batch,),
        cfg.max_tokens_per_iter or (base.max_tokens_per_iter,), cfg.splits))
    # Progress by combination (on a terminal; the runs' own bars nest inside it, silent).
    for (where, name, mesh), wd, kvd, mb, mt, split in tracked(combos, "serving plan",
                                                                unit="candidate"):
        combo = {"slice": where, "mesh": mesh, "weight_dtype": wd, "kv_dtype": kvd, "max_batch": mb,
                 "max_tokens_per_iter": mt, "split": split}
        unit = 1 if split is None else split[0] + split[1]
        most = cfg.max_replicas // unit
        tried: dict[int, dict[str, Any] | str] = {}

        def attempt(k: int, combo=combo, tried=tried) -> dict[str, Any] | str:
            if k not in tried:
                try:
                    tried[k] = run(_request(base, combo, k)).summary
                except TpusimError as exc:  # does not fit: the same at every count
                    tried[k] = Said(exc)  # its settings kept as placeholders
                else:
                    plan.runs += 1
            return tried[k]

        row = {**combo, "slice": name,
               "split": "colocated" if split is None else f"{split[0]}:{split[1]}",
               "replicas": None, "num_chips": None, "meets_slo": False,
               "tokens_per_s_per_chip": None, "slo_attainment": None, "ttft_p99_s": None,
               "tpot_p99_s": None, "note": ""}
        top = attempt(most) if most >= 1 else "the split needs more than max_replicas"
        if isinstance(top, str):
            row["note"] = top
        elif not _meets(top, cfg.attainment):
            row["note"] = (f"misses the SLO even with {most * unit} replicas "
                           f"({top['slo_attainment']:.1%} within bounds"
                           + (", saturated" if top["saturated"] else "") + ")")
        else:
            lo, hi = 0, most  # hi meets; lo does not (0: nothing)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if _meets(attempt(mid), cfg.attainment):
                    hi = mid
                else:
                    lo = mid
            s = tried[hi]
            row.update(replicas=hi * unit, num_chips=s["num_chips"], meets_slo=True,
                       tokens_per_s_per_chip=s["tokens_per_s_per_chip"],
                       slo_attainment=s["slo_attainment"], ttft_p99_s=s["ttft_s"]["p99"],
                       tpot_p99_s=s["tpot_s"]["p99"])
            if plan.best is None or s["tokens_per_s_per_chip"] > \
                    plan.best["tokens_per_s_per_chip"]:
                plan.best = row
        plan.rows.append(row)
    return plan
