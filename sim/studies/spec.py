"""The study file: a base `tpusim` command, the flags it varies (`grid`: every combination;
`zip`: rows taken together), the metrics to check and the plots to draw, validated into a
`StudySpec` with one-line errors naming the key, the rule and the fix. A study's points are
its grid's combinations (last key fastest) times its zipped rows.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sim.runs import REQUESTS
from sim.runs.requests import flag_name, setting_kind
from topologies.errors import TpusimError
from topologies.validate import MAX_STUDY_PLOTS, MAX_STUDY_POINTS, one_of, short_repr
from topologies.yamlio import read_yaml_mapping

STUDY_KEYS = ("command", "base", "grid", "zip", "metrics", "plot")
PLOT_KEYS = ("x", "y", "hue")
# Commands whose `--json` prints one result object (the others write tables or several results).
STUDY_COMMANDS = ("train", "collective", "decode", "prefill", "serve", "goodput")
# Flags a study may not set: the sweep itself decides how each point prints and writes.
_OUTPUT_FLAGS = ("json", "out", "perfetto", "plots", "trace-chips", "quiet", "help", "set")
# A key `set.FIELD` is `--set FIELD=VALUE` (a what-if override of the chip spec).
SET_PREFIX = "set."


@dataclass(frozen=True, slots=True, kw_only=True)
class StudySpec:
    """A validated study: the base command's flags and the varied ones, in file order."""

    command: str
    base: tuple[tuple[str, Any], ...]
    grid: tuple[tuple[str, tuple[Any, ...]], ...]
    zip: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    metrics: tuple[str, ...] = ()
    plots: tuple[tuple[tuple[str, str], ...], ...] = ()

    @property
    def varied(self) -> tuple[str, ...]:
        return tuple(k for k, _ in self.grid) + tuple(k for k, _ in self.zip)

    def to_dict(self) -> dict[str, Any]:
        """The study as a plain mapping (what `study.json` records and `load_study` reads)."""
        d: dict[str, Any] = {"command": self.command, "base": dict(self.base),
                             "grid": {k: list(v) for k, v in self.grid}}
        if self.zip:
            d["zip"] = {k: list(v) for k, v in self.zip}
        if self.metrics:
            d["metrics"] = list(self.metrics)
        if self.plots:
            plots = [dict(p) for p in self.plots]
            d["plot"] = plots[0] if len(plots) == 1 else plots
        return d

    def points(self) -> list[dict[str, Any]]:
        """Every combination of the grid (last key fastest) times the zipped rows (fastest)."""
        grid_lists = [v for _, v in self.grid]
        zip_rows = list(zip(*(v for _, v in self.zip), strict=True)) if self.zip else [()]
        gkeys = [k for k, _ in self.grid]
        zkeys = [k for k, _ in self.zip]
        out = []
        for combo in itertools.product(*grid_lists, zip_rows):
            p = dict(zip(gkeys, combo[:-1], strict=True))
            p.update(zip(zkeys, combo[-1], strict=True))
            out.append(p)
        return out


# -- the schema ------------------------------------------------------------------------------
def _flag_actions(command: str) -> dict[str, str]:
    """Flag name without dashes -> its kind (`switch`, `list` or `value`), for the command's own
    settings (its request's) and `set`."""
    cls = REQUESTS[command]
    return {flag_name(n): setting_kind(n) for n in cls.FLAGS}


def _norm_key(key: Any, where: str) -> str:
    if not isinstance(key, str) or not key.strip():
        raise TpusimError(f"study {where} key {short_repr(key)} is not a flag name; write e.g. "
                          f"seq-len")
    key = key.strip()
    if key.startswith(SET_PREFIX):
        return key
    return key.lstrip("-").replace("_", "-")


def _check_key(key: str, where: str, command: str, actions: dict[str, Any]) -> None:
    if key.startswith(SET_PREFIX):
        field = key[len(SET_PREFIX):]
        if not field:
            raise TpusimError(f"study {where} key {short_repr(key)} names no field; write e.g. "
                              f"set.ici_link_bytes_per_s")
        if "set" not in actions:
            raise TpusimError(
                f"study {where} key {short_repr(key)} needs `tpusim {command} {{set}}`, which "
                f"this version "
                f"of tpusim does not have; vary a flag of the command instead", "set"
            )
        return
    if key == "set":
        raise TpusimError(
            f"study {where} key 'set' takes no list: give each override as its own key "
            f"set.FIELD (e.g. set.ici_link_bytes_per_s: x2, set.model.num_layers: 2)")
    if key in _OUTPUT_FLAGS:
        raise TpusimError(
            f"study {where} key {short_repr(key)} is an output flag; a sweep prints and writes "
            f"its own "
            f"results (use {{out}} on `tpusim sweep`)", "out"
        )
    if key not in actions:
        allowed = sorted(k for k in actions if k not in _OUTPUT_FLAGS)
        listing = f"help({REQUESTS[command].__name__})"  # the CLI writes its --help
        raise TpusimError(
            f"study {where} key {short_repr(key)} is not a flag of `tpusim {command}`; "
            f"{one_of(key, allowed, listing=f'`{{{listing}}}` lists them')} "
            f"(or set.FIELD for {{set}})", listing, "set"
        )


def _values(key: str, v: Any, where: str) -> tuple[Any, ...]:
    if not isinstance(v, list):
        raise TpusimError(
            f"study {where}.{key} must be a list of values, got {short_repr(v)}; write "
            f"[{short_repr(v)}] for one"
        )
    if not v:
        raise TpusimError(f"study {where}.{key} is an empty list; give at least one value")
    for x in v:
        _check_value(key, x, where)
    return tuple(v)


def _check_bools(key: str, values: Iterable[Any], where: str, actions: dict[str, Any]) -> None:
    is_switch = actions.get(key) == "switch"
    for v in values:
        if isinstance(v, bool) and not is_switch:
            raise TpusimError(
                f"study {where}.{key} value {short_repr(v)}: --{key} takes a value, not "
                f"true/false (YAML "
                f"reads yes/no/on/off as true/false; quote it, e.g. 'no')"
            )
        if is_switch and not isinstance(v, bool):
            raise TpusimError(
                f"study {where}.{key} value {short_repr(v)}: --{key} is a switch; give true or "
                f"false"
            )


def _check_value(key: str, x: Any, where: str) -> None:
    if isinstance(x, (dict, list)) or x is None:
        raise TpusimError(
            f"study {where}.{key} value {short_repr(x)} must be a number, a string or "
            f"true/false"
        )
    if isinstance(x, float) and not math.isfinite(x):
        # YAML reads .nan, .inf and 1e400 as floats that no flag accepts (and that JSON
        # cannot record in study.json).
        raise TpusimError(
            f"study {where}.{key} value {x!r} is not a finite number; give a finite value "
            f"(quote it, e.g. '1e400', only if the flag takes text)"
        )


def load_study(source: str | os.PathLike | Mapping[str, Any]) -> StudySpec:
    """A study file (YAML/JSON) or mapping -> validated `StudySpec` (one-line errors)."""
    if isinstance(source, Mapping):
        data = dict(source)
    else:
        data = read_yaml_mapping(Path(source), what="study")
    unknown = [k for k in data if k not in STUDY_KEYS]
    if unknown:
        raise TpusimError(
            f"study key {short_repr(unknown[0])} is unknown; {one_of(unknown[0], STUDY_KEYS)}"
        )
    command = data.get("command")
    if command not in STUDY_COMMANDS:
        raise TpusimError(
            f"study command {short_repr(command)} cannot be swept; "
            f"{one_of(command, STUDY_COMMANDS)}"
        )
    actions = _flag_actions(command)
    seen: dict[str, str] = {}

    def mapping(name: str, required: bool) -> dict:
        m = data.get(name)
        if m is None:
            if required:
                raise TpusimError(f"study has no {name!r}; add {name}: {{flag: value, ...}}")
            return {}
        if not isinstance(m, dict):
            raise TpusimError(
                f"study {name!r} must be a mapping of flag: value, got {short_repr(m)}"
            )
        out = {}
        for k, v in m.items():
            key = _norm_key(k, name)
            _check_key(key, name, command, actions)
            # A varied key may also sit in base (the example does): the varied values
            # replace the base value. Grid and zip must not both vary it.
            if key in seen and seen[key] != "base":
                raise TpusimError(
                    f"study key {short_repr(key)} appears in both {seen[key]} and {name}; give "
                    f"it once"
                )
            seen[key] = name
            out[key] = v
        return out

    base = mapping("base", True)
    grid = {k: _values(k, v, "grid") for k, v in mapping("grid", False).items()}
    zipped = {k: _values(k, v, "zip") for k, v in mapping("zip", False).items()}
    for where, m in (("base", base), ("grid", grid), ("zip", zipped)):
        for k, vs in m.items():
            _check_bools(k, vs if isinstance(vs, (list, tuple)) else [vs], where, actions)
    for k, v in base.items():
        if isinstance(v, list):
            if actions.get(k) != "list":
                raise TpusimError(
                    f"study base.{k} is a list, but --{k} takes one value; move it to grid "
                    f"to vary it"
                )
            for x in v:
                _check_value(k, x, "base")
        else:
            _check_value(k, v, "base")
    if "grid" in data and not data["grid"] and not data.get("zip"):
        raise TpusimError("study grid is empty; list at least one flag with the values it takes")
    if not grid and not zipped:
        raise TpusimError("study varies nothing; add grid: {flag: [values, ...]} (or zip)")
    lengths = {len(v) for v in zipped.values()}
    if len(lengths) > 1:
        desc = ", ".join(f"{k} has {len(v)}" for k, v in zipped.items())
        raise TpusimError(f"study zip lists must have the same length ({desc}); even them out")
    total = math.prod(len(v) for v in grid.values()) * (lengths.pop() if lengths else 1)
    if total > MAX_STUDY_POINTS:
        sizes = " x ".join([str(len(v)) for v in grid.values()]
                           + ([f"{len(next(iter(zipped.values())))} zip rows"] if zipped else []))
        raise TpusimError(
            f"study has {total:,} points ({sizes}), over the limit of {MAX_STUDY_POINTS:,} "
            f"points one sweep may run; vary fewer values or split it into several studies"
        )
    metrics = data.get("metrics", [])
    if not isinstance(metrics, list) or not all(isinstance(m, str) and m for m in metrics):
        raise TpusimError(
            f"study metrics must be a list of result names such as [step_time_s, mfu], "
            f"got {short_repr(metrics)}"
        )
    varied = set(grid) | set(zipped)
    plots = _plots(data.get("plot"), varied)
    return StudySpec(
        command=command, base=tuple(base.items()),
        grid=tuple(grid.items()), zip=tuple(zipped.items()),
        metrics=tuple(metrics), plots=plots,
    )


def _plots(p: Any, varied: set[str]) -> tuple[tuple[tuple[str, str], ...], ...]:
    if p is None:
        return ()
    items = p if isinstance(p, list) else [p]
    if len(items) > MAX_STUDY_PLOTS:
        raise TpusimError(f"study plot lists {len(items):,} plots, over the limit of "
                          f"{MAX_STUDY_PLOTS}; keep the ones you will read (or split the study)")
    out = []
    for item in items:
        if not isinstance(item, dict):
            raise TpusimError(f"study plot must be {{x: KEY, y: METRIC, hue: KEY}}, got "
                              f"{short_repr(item)}")
        bad = [k for k in item if k not in PLOT_KEYS]
        if bad:
            raise TpusimError(
                f"study plot key {short_repr(bad[0])} is unknown; the keys are "
                f"{', '.join(PLOT_KEYS)}"
            )
        if "x" not in item or "y" not in item:
            raise TpusimError("study plot needs x (a varied key) and y (a result name)")
        norm = {}
        for k in PLOT_KEYS:
            if k not in item:
                continue
            v = item[k]
            if not isinstance(v, str) or not v:
                raise TpusimError(f"study plot {k} must be a name, got {short_repr(v)}")
            if k != "y":
                v = _norm_key(v, "plot")
                if v not in varied:
                    raise TpusimError(
                        f"study plot {k} {short_repr(v)} is not a key the study varies; use one "
                        f"of: "
                        f"{', '.join(sorted(varied))}"
                    )
            norm[k] = v
        out.append(tuple(norm.items()))
    return tuple(out)


__all__ = ["PLOT_KEYS", "SET_PREFIX", "STUDY_COMMANDS", "STUDY_KEYS", "StudySpec", "load_study"]
