"""The shared part of every request: the converters of the run settings (text or a number in,
the typed value out), the checks a Python caller's values meet, and `RequestBase`, the frozen base
class that normalises them, records them (`flags()`) and builds a request from settings keyed by
flag or Python name (`from_flags`); `PerturbedRequest` and `StepRequest` add the perturbations and
the power cap the simulating commands share. The request of each command is in this package's other
modules (`sim.runs.requests` exports them all).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from sim.hardware import ChipSpec
from sim.overrides import Overrides, parse_overrides
from topologies.errors import TpusimError
from topologies.validate import (
    CAPACITY_FACTOR_RANGE,
    CHIP_VARIATION_RANGE,
    EXPERT_SKEW_RANGE,
    MAX_BATCH,
    MAX_CHIPS,
    MAX_CHUNKS,
    MAX_SLICES,
    MAX_TOKENS,
    FlagError,
    ascii_float,
    ascii_int,
    float_flag,
    int_flag,
    one_of,
    short_repr,
    whole_flag,
)
from workloads.models import TransformerSpec

if TYPE_CHECKING:  # a scenario is only carried here; validating one needs numpy
    from topologies.scenario import Scenario

# Numpy's generators take seeds below 2^63 (as `Scenario` checks for a scenario file).
SEED_RANGE = "a whole number in [0, 2^63)"

# The ranges `Scenario` and `MoeConfig` check (and say in their errors).
_FLOAT_RANGES = {"chip_variation": CHIP_VARIATION_RANGE.text,
                 "expert_skew": EXPERT_SKEW_RANGE.text,
                 "capacity_factor": CAPACITY_FACTOR_RANGE.text}


def scenario_number(name: str) -> Callable[[Any], float]:
    """A number whose range the `Scenario` / `MoeConfig` checks (with the same key in a scenario
    file): read in ASCII and finite here, so that the error quotes what was given (`1e400`, not
    the `inf` it reads as)."""
    rng = _FLOAT_RANGES[name]

    def conv(text: Any) -> float:
        try:
            v = ascii_float(text)
        except ValueError:
            raise FlagError(f"{{{name}}} {short_repr(text)} is not a number; give {rng}",
                            name) from None
        if not math.isfinite(v):
            raise FlagError(f"{{{name}}} {short_repr(text)} is not finite; give {rng}", name)
        return v

    conv.__name__ = "number"  # as `float_flag`'s (the fuzz generators find number flags by it)
    return conv


def seed(text: Any) -> int:
    """A seed: a whole number in ASCII digits below 2^63."""
    try:
        v = ascii_int(text)
    except ValueError:
        raise FlagError(f"{{seed}} {short_repr(text)} is not a whole number in ASCII digits; "
                        f"give {SEED_RANGE}", "seed") from None
    if not 0 <= v < 2**63:
        raise FlagError(f"{{seed}} {short_repr(v)} is out of range; give {SEED_RANGE}", "seed")
    return v


seed.__name__ = "integer"  # as `int_flag`'s

# Every converted setting: its converter (text or a number in, the typed value out). A setting
# not listed is text (or a switch or a list), checked where it is used.
CONVERTERS: dict[str, Callable[[Any], Any]] = {
    "slices": int_flag("slices", lo=1, hi=MAX_SLICES),
    "seq_len": int_flag("seq_len", hi=MAX_TOKENS),
    "batch_per_chip": float_flag("batch_per_chip", lo=0.0, hi=MAX_BATCH, lo_open=True),
    "microbatches": int_flag("microbatches", hi=MAX_CHUNKS),
    "virtual_stages": whole_flag("virtual_stages"),
    "vocab_tiling": int_flag("vocab_tiling", hi=MAX_CHUNKS),
    "shift": int_flag("shift", lo=-MAX_CHIPS, hi=MAX_CHIPS),
    "chunks": int_flag("chunks", hi=MAX_CHUNKS),
    "batch": int_flag("batch", hi=MAX_BATCH),
    "context_len": int_flag("context_len", hi=MAX_TOKENS),
    "prompt_len": int_flag("prompt_len", hi=MAX_TOKENS),
    "prefill_chunk": int_flag("prefill_chunk", hi=MAX_TOKENS),
    "chip_variation": scenario_number("chip_variation"),
    "expert_skew": scenario_number("expert_skew"),
    "capacity_factor": scenario_number("capacity_factor"),
    "seed": seed,
    "chips": int_flag("chips", hi=MAX_CHIPS),
    "power_cap": float_flag("power_cap", lo=0.0, hi=1e5, lo_open=True),
    "spare_cubes": int_flag("spare_cubes", lo=0, hi=10_000),
}

# Settings that are lists (each given once per item) and switches (true or false).
_LISTS = frozenset({"slow_chip", "slow_link", "dead_link", "failed_chip"})
_SWITCHES = frozenset({"no_overlap", "no_fusion", "exhaustive", "default_placement",
                       "exact_costs", "quantize_attention", "quantize_logits",
                       "no_stochastic_rounding", "twist", "no_ocs", "prefix_caching"})
# The objects that stand in for a named chip, model or scenario file; never in `flags()`.
_OBJECTS = ("chip_spec", "model_spec", "scenario_spec", "trace_sha256")

# What a setting takes in a Python call, by kind (for wrong-type errors).
_WANT = {"switch": "True or False",
         "list": "a list of values such as ['0,0:x+:0.5'] (one per flag given)",
         "overrides": "a dict of keys to numbers or text such as {'ici_link_bytes_per_s': 'x2'}",
         "": "one number or text, as its flag takes on the command line (e.g. 8 or 'full')"}


# The objects a request carries instead of a name, by their class's name (a scenario is only
# imported where it is validated).
_SPEC_TYPES = {"chip_spec": "ChipSpec", "model_spec": "TransformerSpec",
               "scenario_spec": "Scenario"}


# Settings written as text with a grammar of their own (a mesh, axis names, a shape, a mode),
# never a number: a float or int given for one is refused before any parser meets it.
_TEXTS = {"mesh": "text such as 'fsdp=16,tensor=4'", "dcn": "text such as 'data=2'",
          "prefill_mesh": "text such as 'tensor=8'", "decode_mesh": "text such as 'tensor=8'",
          "axis_map": "text such as 'tensor=x,fsdp=y'", "axes": "text such as 'x,y'",
          "shape": "text such as '4x4' or '4x4x8'", "wraparound": "text such as 'auto' or 'x,y'",
          "remat": "text such as 'full'", "op": "text such as 'all-gather'",
          "algorithm": "text such as 'auto'", "mode": "text such as 'auto'"}

# Settings that name a preset or a file: text (a path for a file), never a number.
_NAMES = {"chip": "a chip preset name or a chip YAML path (or a ChipSpec)",
          "model": "a zoo model name or a model YAML path (or a TransformerSpec)",
          "slice": "a slice name such as 'v5p-128'", "trace": "a trace file path",
          "scenario": "a scenario YAML path", "trace_sha256": "a SHA-256 in hex"}


def _scalar(v: Any) -> bool:
    """Text or a real number (numpy's included), not a bool."""
    return isinstance(v, str) or (isinstance(v, numbers.Real) and not isinstance(v, bool))


def flag_name(name: str) -> str:
    """A setting's name on the command line (without dashes)."""
    return "set" if name == "overrides" else name.replace("_", "-")


def setting_name(flag: str) -> str:
    """A command-line flag's setting name (`set` is `overrides`)."""
    return "overrides" if flag == "set" else flag.replace("-", "_")


def setting_kind(name: str) -> str:
    """`switch` (true or false), `list` (one value per item) or `value`."""
    return "switch" if name in _SWITCHES else "list" if name in _LISTS else "value"


def mesh_text(caller: str, mesh: Mapping) -> str:
    """`{axis: size}` as mesh text; an axis that is not a plain name (`"fsdp=2,tensor"` would
    smuggle a second axis into the text) or a size that is not a whole number (an int, or text
    of digits alone: `"2,tensor=4"` would, too) is an error naming the entry."""
    for axis, size in mesh.items():
        if not (isinstance(axis, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", axis)) or \
                isinstance(size, bool) or not isinstance(size, (int, str)) or \
                isinstance(size, str) and not re.fullmatch(r"[0-9]+", size.strip()):
            raise TpusimError(
                f"{caller}(mesh=...) entry {short_repr(axis)}: {short_repr(size)} is not an "
                f"axis name and a whole size; give e.g. {{'fsdp': 16, 'tensor': 4}}")
    return ",".join(f"{axis}={size}" for axis, size in mesh.items())


class _Checked(type):
    """The requests' metaclass: a constructor call that does not match the fields (a setting
    given positionally, a misspelt one) is a one-line `TpusimError` naming the request, as a
    wrong-typed field is (`RequestBase._check_types`), never Python's own `TypeError`."""

    def __call__(cls, *args: Any, **kwargs: Any):
        if args or kwargs.keys() - _field_names(cls):
            name = cls.__name__
            if args:
                raise TpusimError(f"{name}() takes its settings as keywords, got "
                                  f"{len(args)} positional argument(s) "
                                  f"{short_repr(args, 60)}; give e.g. {name}(chip='v5e', ...)")
            bad = sorted(str(k) for k in kwargs.keys() - _field_names(cls))
            raise TpusimError(f"{name}() has no field(s) {', '.join(bad)[:200]}; "
                              f"{one_of(bad[0], sorted(_field_names(cls)))}")
        return super().__call__(**kwargs)


@functools.cache
def _field_names(cls: type) -> frozenset[str]:
    return frozenset(name for name, _ in _defaults(cls))


@functools.cache
def _compared(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.compare)


@functools.cache
def _shown(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.repr)


@functools.cache
def _defaults(cls: type) -> tuple[tuple[str, Any], ...]:
    return tuple((f.name, f.default) for f in dataclasses.fields(cls) if f.init)


def request_dataclass(cls: type) -> type:
    """A request class: a frozen keyword-only dataclass whose constructor, `==`, hash and repr
    are RequestBase's, one generic method each, as dataclasses would generate them (every
    setting from its keyword or its default, then `__post_init__`; fields compared and hashed
    as one tuple; `Name(field=value, ...)` of the fields shown). Generated per class they were
    about 70 functions of up to 70 fields that `exec` compiled at import, 20-30 ms of every
    command's start-up (`benchmarks/bench_startup.py`). Every field has a plain default (the
    constructor has no `default_factory`)."""
    cls = dataclass(frozen=True, kw_only=True, eq=False, repr=False, init=False)(cls)
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{f.name} needs a plain default (request_dataclass)")
    return cls


@request_dataclass
class RequestBase(metaclass=_Checked):
    """What every request has: the pod, `set` overrides, and the objects a caller may hand
    over instead of names."""

    COMMAND: ClassVar[str] = ""
    # The settings in the command's own order (its `--help` order): `flags()` records them so.
    FLAGS: ClassVar[tuple[str, ...]] = ()
    REQUIRED: ClassVar[tuple[str, ...]] = ()
    # The `--set` key groups the command takes (sim/overrides.py); None: it takes no --set.
    SET_SCOPE: ClassVar[tuple[str, ...] | None] = ("chip", "topology", "collective", "model")
    # Converters of this command's own that replace the shared `CONVERTERS` of the same name.
    OWN_CONVERTERS: ClassVar[dict[str, Callable[[Any], Any]]] = {}

    chip: str | None = None
    slice: str | None = None
    shape: str | None = None
    wraparound: str = "auto"
    slices: int = 1
    twist: bool = field(default=False, metadata={"quiet": True})
    overrides: tuple[tuple[str, str], ...] = ()
    chip_spec: ChipSpec | None = field(default=None, repr=False)
    model_spec: TransformerSpec | None = field(default=None, repr=False)
    scenario_spec: Scenario | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen: normalise once
        if isinstance(self.chip, ChipSpec):
            set_("chip_spec", self.chip)
            set_("chip", self.chip.name)
        if isinstance(getattr(self, "model", None), TransformerSpec):
            set_("model_spec", self.model)
            set_("model", self.model.name)
        if isinstance(getattr(self, "mesh", None), Mapping):
            set_("mesh", mesh_text(type(self).__name__, self.mesh))
        ov = self.overrides
        if isinstance(ov, Mapping):
            ov = tuple((str(k).strip(), str(v).strip()) for k, v in ov.items())
        elif ov is None:
            ov = ()
        else:
            try:
                ov = tuple((str(k), str(v)) for k, v in ov)
            except (TypeError, ValueError):
                raise self._wrong("overrides", ov, _WANT["overrides"]) from None
        set_("overrides", ov)
        self._check_types()
        compute = getattr(self, "chakra_compute", None)
        if compute is not None and compute not in ("roofline", "recorded"):
            raise TpusimError(f"chakra_compute {short_repr(compute)} is not a way to cost "
                              f"Chakra compute nodes; use roofline or recorded")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in _LISTS:
                set_(f.name, (v,) if isinstance(v, str) else tuple(v or ()))
            elif isinstance(v, Path):
                set_(f.name, str(v))
            elif v is not None and (conv := self.OWN_CONVERTERS.get(f.name)
                                    or CONVERTERS.get(f.name)) is not None:
                set_(f.name, conv(str(v).strip() if isinstance(v, str) else str(v)))

    def __init__(self, **settings: Any) -> None:
        # The metaclass has refused positional and unknown settings (`_Checked`).
        for name, default in _defaults(type(self)):
            object.__setattr__(self, name, settings.get(name, default))
        self.__post_init__()

    def _values(self) -> tuple:
        return tuple(getattr(self, name) for name in _compared(type(self)))

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._values() == other._values()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in _shown(type(self)))
        return f"{type(self).__qualname__}({shown})"

    def _wrong(self, name: str, value: Any, want: str) -> TpusimError:
        cls = type(self).__name__
        return TpusimError(f"{cls}({name}={short_repr(value)}): {name} takes {want}")

    def _check_types(self) -> None:
        """Every field holds a value of a type its setting takes (a Python caller may pass
        anything): a one-line `TpusimError` naming the field and what it takes, before any
        converter or `sim.run` meets a value it cannot use. A None given for a setting that
        has a default is that default."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            name = f.name
            if v is None:
                if "None" not in str(f.type) and f.default is not dataclasses.MISSING:
                    object.__setattr__(self, name, f.default)
                continue
            if name in _SWITCHES:
                ok, want = isinstance(v, bool), _WANT["switch"]
            elif name in _LISTS:
                ok = isinstance(v, (list, tuple, str)) and (isinstance(v, str) or all(
                    _scalar(x) for x in v))
                want = _WANT["list"]
            elif name == "overrides" or name == "dask":
                continue  # checked where they are converted / used
            elif name in _SPEC_TYPES:
                ok = type(v).__name__ == _SPEC_TYPES[name]
                want = f"a {_SPEC_TYPES[name]}"
            elif name in _NAMES:
                ok, want = isinstance(v, (str, Path)), _NAMES[name]
            elif name in _TEXTS and "str" in str(f.type):
                ok, want = isinstance(v, str), _TEXTS[name]
            else:
                ok, want = _scalar(v) or isinstance(v, Path), _WANT[""]
            if not ok:
                raise self._wrong(name, v, want)

    # -- records ------------------------------------------------------------------------------
    def flags(self) -> dict[str, Any]:
        """The settings under their command-line names, in the command's order (`set` as
        {key: value text}, lists as lists): what results record as `inputs.flags`."""
        out: dict[str, Any] = {}
        # Settings added after results were first recorded (their field's `quiet` metadata):
        # recorded only off their default, so that results without them read as before.
        quiet = {f.name: f.default for f in dataclasses.fields(self)
                 if f.name in getattr(self, "RECORDED_WHEN_SET", ()) or f.metadata.get("quiet")}
        for name in self.FLAGS:
            v = getattr(self, name)
            if name in quiet and v == quiet[name]:
                continue
            if name == "overrides":
                v = dict(v)
            elif name in _LISTS:
                v = list(v)
            elif name in _RECORDED_WHEN_SET and v is None:
                continue  # results of runs without it record what they always did
            out[flag_name(name)] = v
        return out

    @property
    def command(self) -> str:
        return self.COMMAND

    def parsed_overrides(self) -> Overrides:
        """The `set` overrides validated for this command (empty if it takes none)."""
        if self.SET_SCOPE is None:
            return Overrides()
        return parse_overrides(dict(self.overrides), self.SET_SCOPE,
                               command=f"tpusim {self.command}",
                               listing=f"sim.overrides.allowed_keys({type(self).__name__}"
                                       f".SET_SCOPE)")

    @property
    def overrides_dict(self) -> dict[str, str]:
        return dict(self.overrides)

    def replace(self, **changes: Any) -> RequestBase:
        """A copy with `changes` (checked like the constructor's arguments); `overrides`
        replaces the overrides as a whole."""
        return dataclasses.replace(self, **changes)

    # -- building from names --------------------------------------------------------------------
    @classmethod
    def from_flags(cls, flags: Mapping[str, Any], *, caller: str | None = None,
                   source: str | None = None, **objects: Any) -> RequestBase:
        """A request from settings keyed by flag name (`seq-len`) or Python name (`seq_len`):
        the Python API's keywords, a study point, a result's `inputs.flags`. `caller` names the
        Python function they were given to (its errors name it); `source` the file they were
        read from."""
        known = set(cls.FLAGS)
        kw: dict[str, Any] = {}
        unknown = []
        for key, value in flags.items():
            name = setting_name(str(key))
            if name not in known:
                unknown.append(str(key))
                continue
            _check_kind(cls.COMMAND, name, value, caller, source)
            if value is not None:
                kw[name] = value
        if unknown:
            if caller:
                near = one_of(sorted(unknown)[0],
                              [flag_name(n).replace('-', '_') for n in cls.FLAGS],
                              listing=f"help({caller}) lists them")
                raise TpusimError(f"{caller}() got unknown keyword(s) "
                                  f"{', '.join(sorted(unknown))[:200]}; {near}")
            listing = f"help({cls.__name__})"  # a placeholder: the CLI writes its --help
            near = one_of(sorted(unknown)[0], [flag_name(n) for n in cls.FLAGS],
                          listing=f"`{{{listing}}}` lists them")
            raise TpusimError(f"tpusim {cls.COMMAND} has no flag(s) "
                              f"{', '.join(sorted(unknown))[:200]}; {near}", listing)
        missing = [n for n in cls.REQUIRED if kw.get(n) is None and not (
            n == "model" and objects.get("model_spec") is not None)]
        if missing:
            if caller:
                raise TpusimError(f"{caller}() needs {', '.join(missing)}")
            names = ["set" if n == "overrides" else n for n in missing]
            raise TpusimError(f"the following arguments are required: "
                              f"{', '.join('{' + n + '}' for n in names)} (see "
                              f"`{{help({cls.__name__})}}`)", *names, f"help({cls.__name__})")
        try:
            return cls(**kw, **{k: v for k, v in objects.items() if v is not None})
        except FlagError as exc:
            if caller:
                raise
            raise TpusimError(f"{exc.template} (see `{{help({cls.__name__})}}`)",
                              *exc.params, f"help({cls.__name__})") from None


def _check_kind(command: str, name: str, value: Any, caller: str | None,
                source: str | None) -> None:
    """A setting's value has the type its kind takes (a result file edited by hand, or a
    Python call, may hold anything)."""
    scalar = (str, int, float)
    if name in _SWITCHES:
        ok, kind, want = isinstance(value, bool) or value is None, "switch", "true or false"
    elif name in _LISTS:
        ok = value is None or (isinstance(value, (list, tuple)) and all(
            isinstance(v, scalar) and not isinstance(v, bool) for v in value))
        kind, want = "list", "a list of values"
    elif name == "overrides":
        ok = value is None or isinstance(value, Mapping) and all(
            isinstance(v, scalar) and not isinstance(v, bool) for v in value.values())
        kind, want = "overrides", "a list of values (an object KEY: VALUE for set)"
    else:
        ok = value is None or (isinstance(value, (*scalar, Path)) and not isinstance(value, bool))
        kind, want = "", "one number or text"
    if ok:
        return
    if caller is not None:
        key = "set" if name == "overrides" and caller != "sim.plan" else name
        raise TpusimError(f"{caller}({key}={short_repr(value)}): {key} takes {_WANT[kind]}")
    raise TpusimError(
        f"inputs.flags.{short_repr(flag_name(name))} of tpusim {command} is {short_repr(value)}; "
        f"it must be {want} (the result file was edited); restore it or rerun the command"
    )


# Settings recorded in `inputs.flags` only when given (`--remat custom`'s names): a result
# without them reruns with the default.
_RECORDED_WHEN_SET = ("remat_save", "remat_offload")


POD_FIELDS = ("chip", "slice", "shape", "wraparound", "slices", "twist")
PERTURB_FIELDS = ("scenario", "slow_chip", "slow_link", "dead_link", "chip_variation", "seed",
            "expert_skew", "capacity_factor", "failed_chip")
# The spare cubes that replace failed chips and whether the switches swap them: after the
# perturbations on every command but `goodput`, which has its own (its failures' spares).
SPARE_FIELDS = ("spare_cubes", "no_ocs")


@request_dataclass
class PerturbedRequest(RequestBase):
    """The perturbations: slow chips and links, dead links, chip variation, the MoE router."""

    scenario: str | None = None
    slow_chip: tuple[str, ...] = ()
    slow_link: tuple[str, ...] = ()
    dead_link: tuple[str, ...] = ()
    chip_variation: float | None = None
    seed: int | None = None
    expert_skew: float | None = None
    capacity_factor: float | None = None
    failed_chip: tuple[str, ...] = field(default=(), metadata={"quiet": True})
    spare_cubes: int | None = field(default=None, metadata={"quiet": True})
    no_ocs: bool = field(default=False, metadata={"quiet": True})
    mode: str = "auto"


@request_dataclass
class StepRequest(PerturbedRequest):
    """A simulated step (train, replay, decode, prefill): the perturbations and a power cap in
    watts per chip (`power_cap`; None: uncapped)."""

    power_cap: float | None = None


