"""Typed, frozen requests: one class per simulating command, what every front end builds.

A request holds a run's settings under their Python names (`seq_len`, `batch_per_chip`,
`overrides`, ...), already checked and converted (an `int` for `seq_len`, a tuple of texts for
`slow_link`); `sim.run(request)` simulates it and returns a `sim.runs.Run`. The CLI turns argv
into a request, the Python API turns keywords into one, a sweep point and a plan candidate are
requests shipped to workers (they pickle), and `rerun` rebuilds one from a result's `inputs`.

Each field is a setting of the command of the same name with `_` for `-` (`overrides` is the
command line's `--set`); `flags()` is the record of them under those names, in the command's
order, which results carry as `inputs.flags`. The pod is named (`chip`, `slice`, `shape`,
`wraparound`, `slices`) or given as objects (`chip_spec`, `model_spec`, `scenario_spec`: they
replace loading the named preset or file, and are what `rerun` uses so that a result reruns the
same after a preset or file changed).
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
    wrong-typed field is (`_Request._check_types`), never Python's own `TypeError`."""

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
    return frozenset(f.name for f in dataclasses.fields(cls) if f.init)


@dataclass(frozen=True, kw_only=True)
class _Request(metaclass=_Checked):
    """What every request has: the pod, `--set` overrides, and the objects a caller may hand
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
        """The `--set` overrides validated for this command (empty if it takes none)."""
        if self.SET_SCOPE is None:
            return Overrides()
        return parse_overrides(dict(self.overrides), self.SET_SCOPE,
                               command=f"tpusim {self.command}")

    @property
    def overrides_dict(self) -> dict[str, str]:
        return dict(self.overrides)

    def replace(self, **changes: Any) -> _Request:
        """A copy with `changes` (checked like the constructor's arguments); `overrides`
        replaces the overrides as a whole."""
        return dataclasses.replace(self, **changes)

    # -- building from names --------------------------------------------------------------------
    @classmethod
    def from_flags(cls, flags: Mapping[str, Any], *, caller: str | None = None,
                   source: str | None = None, **objects: Any) -> _Request:
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
            near = one_of(sorted(unknown)[0], [flag_name(n) for n in cls.FLAGS],
                          listing=f"`tpusim {cls.COMMAND} --help` lists them")
            raise TpusimError(f"tpusim {cls.COMMAND} has no flag(s) "
                              f"{', '.join(sorted(unknown))[:200]}; {near}")
        missing = [n for n in cls.REQUIRED if kw.get(n) is None and not (
            n == "model" and objects.get("model_spec") is not None)]
        if missing:
            if caller:
                raise TpusimError(f"{caller}() needs {', '.join(missing)}")
            raise TpusimError(f"the following arguments are required: "
                              f"{', '.join('--' + flag_name(n) for n in missing)} (see "
                              f"`tpusim {cls.COMMAND} --help`)")
        try:
            return cls(**kw, **{k: v for k, v in objects.items() if v is not None})
        except FlagError as exc:
            if caller:
                raise
            raise TpusimError(f"{exc.template} (see `tpusim {cls.COMMAND} {{help}}`)",
                              *exc.params, "help") from None


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


_POD = ("chip", "slice", "shape", "wraparound", "slices", "twist")
_PERTURB = ("scenario", "slow_chip", "slow_link", "dead_link", "chip_variation", "seed",
            "expert_skew", "capacity_factor", "failed_chip")
# The spare cubes that replace failed chips and whether the switches swap them: after the
# perturbations on every command but `goodput`, which has its own (its failures' spares).
_SPARES = ("spare_cubes", "no_ocs")


@dataclass(frozen=True, kw_only=True)
class _Perturbed(_Request):
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


@dataclass(frozen=True, kw_only=True)
class _Step(_Perturbed):
    """A simulated step (train, replay, decode, prefill): the perturbations and a power cap in
    watts per chip (`power_cap`; None: uncapped)."""

    power_cap: float | None = None


@dataclass(frozen=True, kw_only=True)
class CollectiveRequest(_Perturbed):
    """One collective (`tpusim collective`): `op` over the pod's `axes` with `bytes` V."""

    COMMAND: ClassVar[str] = "collective"
    FLAGS: ClassVar[tuple[str, ...]] = (*_POD, "overrides", "op", "axes", "bytes", "algorithm",
                                        "src", "dst", "shift", *_PERTURB, *_SPARES, "mode",
                                        "chunks")
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


@dataclass(frozen=True, kw_only=True)
class CompareCollectivesRequest(CollectiveRequest):
    """One collective under every algorithm (`tpusim compare-collectives`)."""

    COMMAND: ClassVar[str] = "compare-collectives"
    SET_SCOPE: ClassVar[tuple[str, ...] | None] = ("chip", "topology")
    FLAGS: ClassVar[tuple[str, ...]] = (*_POD, "overrides", "op", "axes", "bytes", "src", "dst",
                                        "shift", *_PERTURB, *_SPARES, "mode", "chunks")


# Settings recorded in `inputs.flags` only when given (`--remat custom`'s names): a result
# without them reruns with the default.
_RECORDED_WHEN_SET = ("remat_save", "remat_offload")

_TRAINING = ("model", "seq_len", "batch_per_chip", "mesh", "dcn", "axis_map", "remat",
             "remat_save", "remat_offload", "attention", "microbatches", "param_dtype",
             "grad_dtype", "gather_dtype",
             "optimizer_dtype", "optimizer", "pipeline_schedule", "virtual_stages", "no_overlap",
             "no_fusion", "tp_activations", "tp_comm", "dp_allreduce", "dp_grad_split",
             "fsdp_grad", "ep_alltoall", "vocab_tiling", "matmul_dtype",
             "quantize_attention", "quantize_logits", "quant_scales", "quant_gather",
             "no_stochastic_rounding", "fsdp_gather")
# int8 training's settings: recorded in `inputs.flags` only when not their defaults, so bf16
# results read (and rerun) as before.
_QUANT_FLAGS = ("matmul_dtype", "quantize_attention", "quantize_logits", "quant_scales",
                "quant_gather", "no_stochastic_rounding")


@dataclass(frozen=True, kw_only=True)
class TrainRequest(_Step):
    """One training step (`tpusim train`): a model on a mesh of the pod, with its settings."""

    COMMAND: ClassVar[str] = "train"
    FLAGS: ClassVar[tuple[str, ...]] = (*_POD, "overrides", *_TRAINING, "algorithm", *_PERTURB,
                                        *_SPARES, "mode", "power_cap")
    RECORDED_WHEN_SET: ClassVar[tuple[str, ...]] = _QUANT_FLAGS
    REQUIRED: ClassVar[tuple[str, ...]] = ("model", "seq_len", "batch_per_chip", "mesh")

    model: str | None = None
    seq_len: int | None = None
    batch_per_chip: float | None = None
    mesh: str | None = None
    dcn: str | None = None
    axis_map: str | None = None
    remat: str = "full"
    remat_save: str | None = None
    remat_offload: str | None = None
    attention: str = "flash"
    microbatches: int = 1
    param_dtype: str = "bf16"
    grad_dtype: str = "bf16"
    gather_dtype: str | None = None
    optimizer_dtype: str = "fp32"
    optimizer: str = "adam"
    pipeline_schedule: str | None = None
    virtual_stages: int = 1
    no_overlap: bool = False
    no_fusion: bool = False
    tp_activations: str = "sharded"
    tp_comm: str = "blocking"
    dp_allreduce: str = "async"
    dp_grad_split: str = "per-matrix"
    fsdp_grad: str = "reduce-scatter"
    ep_alltoall: str = "sync"
    vocab_tiling: int = 1
    fsdp_gather: str = "async"
    matmul_dtype: str = "bf16"
    quantize_attention: bool = False
    quantize_logits: bool = False
    quant_scales: str = "per-channel"
    quant_gather: str = "int8"
    no_stochastic_rounding: bool = False
    algorithm: str = "auto"


@dataclass(frozen=True, kw_only=True)
class CompileRequest(TrainRequest):
    """A training step compiled into a trace (`tpusim compile`): for the pod's chip, or for
    `chips` chips of no particular generation (its compiler's memory rules off). Only `model.*`
    overrides apply: the chip, topology and algorithm are the replay's."""

    COMMAND: ClassVar[str] = "compile"
    FLAGS: ClassVar[tuple[str, ...]] = (*_POD, "chips", "overrides", *_TRAINING, "expert_skew",
                                        "capacity_factor", "seed")
    SET_SCOPE: ClassVar[tuple[str, ...] | None] = ("model",)

    chips: int | None = None
    expert_skew: float | None = 0.0
    seed: int | None = 0


@dataclass(frozen=True, kw_only=True)
class ReplayRequest(_Step):
    """A trace file or XLA's compiled HLO text replayed on a pod (`tpusim replay`)."""

    COMMAND: ClassVar[str] = "replay"
    FLAGS: ClassVar[tuple[str, ...]] = ("trace", *_POD, "overrides", "no_overlap",
                                        "chakra_compute", "algorithm", *_PERTURB, *_SPARES,
                                        "mode", "power_cap")
    # Recorded in inputs.flags only when set: results written before the flag existed, and
    # replays of other traces, record what they always did (and rerun the same).
    RECORDED_WHEN_SET: ClassVar[tuple[str, ...]] = ("chakra_compute",)
    REQUIRED: ClassVar[tuple[str, ...]] = ("trace",)
    SET_SCOPE: ClassVar[tuple[str, ...] | None] = ("chip", "topology", "collective")

    trace: str | None = None
    no_overlap: bool = False
    algorithm: str = "auto"
    # Chakra input only: how compute nodes are costed (workloads.chakra.convert.ChakraCompute).
    chakra_compute: str = "roofline"
    # The trace file's SHA-256 a result recorded: `rerun` refuses a file that changed since.
    trace_sha256: str | None = field(default=None, repr=False)
    # `tpusim export` replays through this request too; its results say so.
    as_command: str = field(default="replay", repr=False)

    @property
    def command(self) -> str:
        return self.as_command


_INFERENCE = ("model", "batch", "context_len", "mesh", "dcn", "weight_dtype", "kv_dtype",
              "matmul_dtype", "sampling")


@dataclass(frozen=True, kw_only=True)
class _Decoding(_Request):
    """What every decode-step command has: the model, its KV cache and its number formats."""

    model: str | None = None
    context_len: int | None = None
    mesh: str | None = None
    dcn: str | None = None
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    matmul_dtype: str = "bf16"
    sampling: str = "top-k"


@dataclass(frozen=True, kw_only=True)
class DecodeRequest(_Step, _Decoding):
    """One decode step with a KV cache (`tpusim decode`)."""

    COMMAND: ClassVar[str] = "decode"
    FLAGS: ClassVar[tuple[str, ...]] = (*_POD, "overrides", *_INFERENCE, "algorithm", *_PERTURB,
                                        *_SPARES, "mode", "power_cap")
    REQUIRED: ClassVar[tuple[str, ...]] = ("model", "batch", "context_len", "mesh")

    batch: int | None = None
    algorithm: str = "auto"


@dataclass(frozen=True, kw_only=True)
class PrefillRequest(DecodeRequest):
    """The prefill of a batch of prompts (`tpusim prefill`)."""

    COMMAND: ClassVar[str] = "prefill"
    FLAGS: ClassVar[tuple[str, ...]] = (*_POD, "overrides", *_INFERENCE, "prompt_len",
                                        "prefill_chunk", "algorithm", *_PERTURB, *_SPARES,
                                        "mode", "power_cap")
    REQUIRED: ClassVar[tuple[str, ...]] = ("model", "batch", "prompt_len", "mesh")

    prompt_len: int | None = None
    prefill_chunk: int | None = None


_DEFAULT_BATCHES = "1,2,4,8,16,32,64,128,256"


@dataclass(frozen=True, kw_only=True)
class ServeSweepRequest(_Decoding):
    """Decode latency against throughput over batch sizes (`tpusim serve-sweep`); `mesh` may
    list several meshes separated by `;`, the dtypes several separated by `,`."""

    COMMAND: ClassVar[str] = "serve-sweep"
    FLAGS: ClassVar[tuple[str, ...]] = (*_POD, "overrides", "model", "context_len", "mesh", "dcn",
                                        "weight_dtype", "kv_dtype", "matmul_dtype", "sampling",
                                        "expert_skew", "capacity_factor", "seed", "batches")
    REQUIRED: ClassVar[tuple[str, ...]] = ("model", "context_len", "mesh")

    expert_skew: float = 0.0
    capacity_factor: float | None = None
    seed: int = 0
    batches: str = _DEFAULT_BATCHES


def _positive_number(name: str, fix: str) -> Callable[[Any], float]:
    """A finite number > 0 in ASCII for the setting `name` (the error quotes what was given;
    `fix` may name it as `{name}`)."""

    def conv(text: Any) -> float:
        try:
            v = ascii_float(text)
        except ValueError:
            raise FlagError(f"{{{name}}} {short_repr(text)} is not a number; {fix}",
                            name) from None
        if not math.isfinite(v) or v <= 0:
            raise FlagError(f"{{{name}}} {short_repr(text)} must be a finite number > 0; {fix}",
                            name)
        return v

    conv.__name__ = "number"
    return conv


# The most requests a serving run simulates (sim/serving/workload.py says why).
MAX_SERVE_REQUESTS = 10_000_000
_SERVE = ("arrival", "rate", "cv", "trace", "requests", "duration", "prompt_tokens",
          "output_tokens", "replicas", "router", "scheduler", "max_batch", "max_tokens_per_iter",
          "prefill_chunk", "kv_block_tokens", "preemption", "prefix_caching", "prefill_replicas",
          "decode_replicas", "prefill_mesh", "decode_mesh", "prefill_slice", "decode_slice",
          "kv_transfer", "slo", "exact_costs")


@dataclass(frozen=True, kw_only=True)
class ServeRequest(_Perturbed, _Decoding):
    """Requests served by replicas over time (`tpusim serve`): the workload (arrivals and
    lengths), the deployment (replicas of the pod and mesh, or prefill and decode pools) and
    each replica's scheduler; `seed` seeds the workload's draws as well as the perturbations."""

    COMMAND: ClassVar[str] = "serve"
    FLAGS: ClassVar[tuple[str, ...]] = (*_POD, "overrides", "model", "mesh", "dcn",
                                        "weight_dtype", "kv_dtype", "matmul_dtype", "sampling",
                                        *_SERVE, "algorithm", *_PERTURB, *_SPARES, "mode")
    REQUIRED: ClassVar[tuple[str, ...]] = ("model", "mesh")
    OWN_CONVERTERS: ClassVar[dict[str, Callable[[Any], Any]]] = {
        "rate": _positive_number("rate", "give requests per second, e.g. {rate} 10"),
        "cv": _positive_number("cv", "give the gaps' coefficient of variation, e.g. {cv} 2 "
                                       "(1 is Poisson)"),
        "duration": _positive_number("duration", "give seconds of arrivals, e.g. "
                                                   "{duration} 600"),
        "requests": int_flag("requests", hi=MAX_SERVE_REQUESTS),
        "replicas": int_flag("replicas", hi=MAX_CHIPS),
        "prefill_replicas": int_flag("prefill_replicas", lo=0, hi=MAX_CHIPS),
        "decode_replicas": int_flag("decode_replicas", lo=0, hi=MAX_CHIPS),
        "max_batch": int_flag("max_batch", hi=MAX_BATCH),
        "max_tokens_per_iter": int_flag("max_tokens_per_iter", hi=MAX_TOKENS),
        "kv_block_tokens": int_flag("kv_block_tokens", hi=MAX_TOKENS),
    }

    arrival: str = "poisson"
    rate: float | None = None
    cv: float | None = None
    trace: str | None = None
    requests: int | None = None
    duration: float | None = None
    prompt_tokens: str | None = None
    output_tokens: str | None = None
    replicas: int = 1
    router: str = "round-robin"
    scheduler: str = "continuous"
    max_batch: int = 256
    max_tokens_per_iter: int | None = None
    prefill_chunk: int | None = None
    prefill_replicas: int | None = None
    decode_replicas: int | None = None
    prefill_mesh: str | None = None
    decode_mesh: str | None = None
    prefill_slice: str | None = None
    decode_slice: str | None = None
    kv_block_tokens: int = 16
    slo: str | None = None
    exact_costs: bool = False
    algorithm: str = "auto"
    preemption: str = field(default="recompute", metadata={"quiet": True})
    prefix_caching: bool = field(default=False, metadata={"quiet": True})
    kv_transfer: str = field(default="dcn", metadata={"quiet": True})


def _bounded_number(name: str, *, lo: float, hi: float, lo_open: bool, hi_open: bool = False,
                    fix: str) -> Callable[[Any], float]:
    """A finite number in [lo, hi] (open ends where said), in ASCII, for the setting `name`;
    the error names the value, the rule and `fix` (which may name it as `{name}`)."""
    who = f"{{{name}}}"

    def conv(text: Any) -> float:
        try:
            v = ascii_float(text)
        except ValueError:
            raise FlagError(f"{who} {short_repr(text)} is not a number; {fix}", name) from None
        if not math.isfinite(v):
            raise FlagError(f"{who} {short_repr(text)} is not finite; {fix}", name)
        if v < lo or (lo_open and v <= lo):
            rule = f"{'>' if lo_open else '>='} {lo:g}"
        elif v > hi or (hi_open and v >= hi):
            rule = f"{'<' if hi_open else '<='} {hi:g}"
        else:
            return v
        raise FlagError(f"{who} {short_repr(text)} breaks the rule: it must be {rule}; {fix}",
                        name)

    conv.__name__ = "number"
    return conv


# The longest job `goodput` simulates: a century of wall clock or of steps.
MAX_GOODPUT_HOURS = 876_600.0
MAX_GOODPUT_STEPS = 10**12
_GOODPUT = ("step_time", "steps", "hours", "mtbf_hours", "chip_mtbf_hours", "host_mtbf_hours",
            "host_availability", "failure_trace", "repair_hours", "chips_per_host",
            "spare_cubes", "no_ocs", "checkpoint_interval", "checkpoint_cost", "restart_cost",
            "swap_cost", "storage_bytes_per_s", "seeds", "engine")
_MTBF_FIX = "give hours between failures, e.g. {{{name}}} {eg}"


@dataclass(frozen=True, kw_only=True)
class GoodputRequest(TrainRequest):
    """A training job's goodput under failures (`tpusim goodput`): the job (a step time, or
    the `train` settings whose step `sim.run` simulates; steps or wall-clock hours), the
    failures (an MTBF for the slice, per chip and per host, or a trace file), repairs, spare
    cubes and the optical switches, checkpoints and restarts, and the seeds. `seed` seeds the
    failure draws as well as the perturbations."""

    COMMAND: ClassVar[str] = "goodput"
    FLAGS: ClassVar[tuple[str, ...]] = (*_POD, "overrides", *_GOODPUT, *_TRAINING, "algorithm",
                                        *_PERTURB, "mode", "power_cap")
    REQUIRED: ClassVar[tuple[str, ...]] = ()
    OWN_CONVERTERS: ClassVar[dict[str, Callable[[Any], Any]]] = {
        "step_time": _bounded_number(
            "step_time", lo=0.0, hi=1e7, lo_open=True,
            fix="give the seconds one training step takes, e.g. {step_time} 12.5 (or the train "
                "flags, to simulate it)"),
        "steps": int_flag("steps", hi=MAX_GOODPUT_STEPS),
        "hours": _bounded_number(
            "hours", lo=0.0, hi=MAX_GOODPUT_HOURS, lo_open=True,
            fix="give the job's wall-clock hours, e.g. {hours} 720 (a month)"),
        **{name: _bounded_number(name, lo=0.0, hi=1e12, lo_open=True,
                                 fix=_MTBF_FIX.format(name=name, eg=eg))
           for name, eg in (("mtbf_hours", "12"), ("chip_mtbf_hours", "5e6"),
                            ("host_mtbf_hours", "5e5"))},
        "host_availability": _bounded_number(
            "host_availability", lo=0.0, hi=1.0, lo_open=True, hi_open=True,
            fix="give the share of time a host is up, e.g. {host_availability} 0.995"),
        "repair_hours": _bounded_number("repair_hours", lo=0.0, hi=1e6, lo_open=False,
            fix="give the hours a failed chip or host takes to come back, e.g. "
                "{repair_hours} 4"),
        "chips_per_host": int_flag("chips_per_host", hi=64),
        "spare_cubes": int_flag("spare_cubes", lo=0, hi=MAX_CHIPS),
        **{name: _bounded_number(name, lo=0.0, hi=1e9, lo_open=False,
                                 fix=f"give seconds >= 0, e.g. {{{name}}} {eg}")
           for name, eg in (("checkpoint_cost", "60"), ("restart_cost", "600"),
                            ("swap_cost", "30"))},
        "checkpoint_interval": _bounded_number("checkpoint_interval", lo=0.0, hi=1e12, lo_open=True,
            fix="give seconds of training between checkpoints, e.g. {checkpoint_interval} "
                "1800, or leave it out to search for the best"),
        "storage_bytes_per_s": _bounded_number("storage_bytes_per_s", lo=0.0, hi=1e15, lo_open=True,
            fix="give the checkpoint storage's bytes per second for the whole slice, e.g. "
                "{storage_bytes_per_s} 2e10"),
        "seeds": int_flag("seeds", hi=1000),
    }
    # The train flags the step model reads: none of them applies with --step-time.
    STEP_MODEL: ClassVar[tuple[str, ...]] = ("overrides", *_TRAINING, "algorithm",
                                             *(p for p in _PERTURB if p != "seed"), "mode",
                                             "power_cap")

    step_time: float | None = None
    steps: int | None = None
    hours: float | None = None
    mtbf_hours: float | None = None
    chip_mtbf_hours: float | None = None
    host_mtbf_hours: float | None = None
    host_availability: float | None = None
    failure_trace: str | None = None
    repair_hours: float | None = None
    chips_per_host: int | None = None
    spare_cubes: int = 0
    no_ocs: bool = False
    checkpoint_interval: float | None = None
    checkpoint_cost: float | None = None
    restart_cost: float | None = None
    swap_cost: float = 0.0
    storage_bytes_per_s: float | None = None
    seeds: int | None = None
    engine: str = "event-skip"


@dataclass(frozen=True, kw_only=True)
class ImportHloRequest(_Request):
    """XLA's compiled HLO text read for a pod (`tpusim import-hlo`): its inventory and trace."""

    COMMAND: ClassVar[str] = "import-hlo"
    FLAGS: ClassVar[tuple[str, ...]] = ("program", *_POD)
    REQUIRED: ClassVar[tuple[str, ...]] = ("program",)
    SET_SCOPE: ClassVar[tuple[str, ...] | None] = None

    program: str | None = None


# The most candidates `plan --exhaustive` simulates unless `max_simulations` says more.
EXHAUSTIVE_MAX_SIMULATIONS = 100
_WHOLE = ("seq_len", "global_batch", "top", "workers", "max_simulations", "max_tensor",
          "max_data", "max_sequence", "max_pipeline", "max_expert")


@dataclass(frozen=True, kw_only=True)
class PlanRequest(_Request):
    """A search of the ways to run one training step (`tpusim plan`): the pod, the model and
    the batch, and the search space (comma lists, as the command line gives them). `workers`
    and `dask` say where candidates run (`dask`: "local", an address or a
    `distributed.Client`)."""

    COMMAND: ClassVar[str] = "plan"
    FLAGS: ClassVar[tuple[str, ...]] = (*_POD, "overrides", "model", "seq_len", "global_batch",
                                        "top", "workers", "dask", "exhaustive", "max_simulations",
                                        "objective", "axes", "max_tensor", "max_data",
                                        "max_sequence", "max_pipeline", "max_expert",
                                        "default_placement",
                                        "remat", "microbatches", "param_dtype", "grad_dtype",
                                        "optimizer_dtype", "optimizer", "gather_dtype",
                                        "shapes", "wiring")
    REQUIRED: ClassVar[tuple[str, ...]] = ("model", "seq_len", "global_batch")
    SET_SCOPE: ClassVar[tuple[str, ...] | None] = ("chip", "topology", "model")
    OWN_CONVERTERS: ClassVar[dict[str, Callable[[Any], Any]]] = {
        **{name: whole_flag(name) for name in _WHOLE},
        "microbatches": str}  # a comma list of counts here

    model: str | None = None
    seq_len: int | None = None
    global_batch: int | None = None
    top: int = 5
    workers: int = 0
    dask: Any = None
    exhaustive: bool = False
    max_simulations: int | None = None
    axes: str = "data,fsdp,pipeline,expert,sequence,tensor"
    max_tensor: int = 8
    max_data: int = 4
    max_sequence: int = 2
    max_pipeline: int = 4
    max_expert: int = 64
    default_placement: bool = False
    remat: str = "full,minimal,none"
    microbatches: str = "1,2,4"
    param_dtype: str = "bf16"
    grad_dtype: str = "bf16"
    optimizer_dtype: str = "fp32"
    optimizer: str = "adam"
    gather_dtype: str | None = None
    objective: str = "time"
    shapes: str | None = field(default=None, metadata={"quiet": True})
    wiring: str = field(default="auto", metadata={"quiet": True})


# Every request class that `sim.run` runs, by its command.
REQUESTS: dict[str, type[_Request]] = {
    cls.COMMAND: cls for cls in (CollectiveRequest, CompareCollectivesRequest, TrainRequest,
                                 ReplayRequest, DecodeRequest, PrefillRequest, ServeSweepRequest,
                                 ServeRequest, GoodputRequest)
}
Request = _Request
