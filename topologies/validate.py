"""Input validation shared by every boundary (CLI flags, chip/model YAML, trace files): finite,
in-range numbers of the right type, comma lists without empty items, bounded `repr`s for error
messages, and the size limits that keep a tiny input from asking for an unbounded simulation.

Every check raises `TpusimError` with one line naming what was given, the rule and the fix.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from topologies.errors import TpusimError

E = TypeVar("E", bound=enum.Enum)

# -- size limits (each stated in the error that enforces it) ----------------------------------
# Chosen so that the largest input allowed still simulates in seconds to a few minutes and a few
# GiB at most, while covering every real system: the largest TPU pod is 8960 chips (v5p),
# the largest zoo model has 126 layers (LLaMA-3-405B).
MAX_CHIPS = 1 << 20  # chips in one pod (all slices together)
MAX_SLICES = 1024  # slices joined over DCN
MAX_LAYERS = 4096  # decoder layers of a model
MAX_MODEL_DIM = 1 << 24  # d_model, d_ff, head_dim, vocab_size, heads (16,777,216)
MAX_EXPERTS = 4096
MAX_TRACE_OPS = 250_000  # ops in one compiled or loaded program
MAX_CONFIG_FILE_BYTES = 1 << 20  # chip / model YAML or JSON
MAX_TRACE_FILE_BYTES = 32 << 20  # a trace file (tpusim compile writes ~110 bytes per op)
MAX_NESTING = 32  # nesting depth of YAML/JSON inputs (real files use 2-3)
MAX_INT_DIGITS = 30  # digits of an integer in an input file (counts above 10^30 are typos)
MAX_SWEEP_RUNS = 512  # decode steps one serve-sweep may simulate
MAX_STUDY_POINTS = 100_000  # points of one `tpusim sweep` study (1,000 take ~5 min)
# Plots of one study: each is ~0.2 s to draw and write, so 1,000 entries rendered for minutes;
# 32 is more than a reader looks at (and one plot per metric of a large study).
MAX_STUDY_PLOTS = 32
MAX_WORKERS = 256  # worker processes of a sweep or plan (each holds ~150-250 MiB)
MAX_PLAN_COMBINATIONS = 10_000  # axis sizes x settings one `tpusim plan` may consider
MAX_BYTES = 1 << 50  # a collective buffer (1 PiB)
MAX_TOKENS = 1 << 24  # sequence / context / prompt length (16M tokens)
MAX_BATCH = 1 << 24  # sequences in a batch
MAX_CHUNKS = 4096  # pipelining chunks of a collective, prefill chunks, microbatches
MAX_PATH_CHARS = 4096
MAX_NAME_CHARS = 255  # one path component (the usual file-system limit)


def short_repr(value: Any, limit: int = 60) -> str:
    """`repr(value)` cut to `limit` characters, never expanding a huge or deeply nested value."""
    out: list[str] = []
    budget = [limit + 1]

    def emit(s: str) -> bool:
        out.append(s[: budget[0]])
        budget[0] -= len(s)
        return budget[0] > 0

    def walk(v: Any, depth: int) -> bool:
        if depth > 4:
            return emit("...")
        if isinstance(v, dict):
            if not emit("{"):
                return False
            for i, (k, x) in enumerate(v.items()):
                if (i and not emit(", ")) or not walk(k, depth + 1) or not emit(": ") \
                        or not walk(x, depth + 1):
                    return False
            return emit("}")
        if isinstance(v, (list, tuple)):
            o, c = ("[", "]") if isinstance(v, list) else ("(", ")")
            if not emit(o):
                return False
            for i, x in enumerate(v):
                if (i and not emit(", ")) or not walk(x, depth + 1):
                    return False
            return emit(c)
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10**limit:
            return emit(f"<integer of {len(str(abs(v))) if abs(v) < 10**4000 else 'over 4000'}"
                        f" digits>")
        if isinstance(v, str) and len(v) > limit:
            return emit(repr(v[: limit]))
        return emit(repr(v))

    walk(value, 0)
    text = "".join(out)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# Numbers in flags and input files are read in ASCII only. Python's int() and float() also
# read full-width and other Unicode digits ("１") and underscores ("0_5" is 5.0, "2_2" is 22):
# a paste or a typo, never what a flag means, so they are refused instead of guessed.
_INT_TEXT = re.compile(r"[+-]?[0-9]+")
_FLOAT_TEXT = re.compile(
    r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[+-]?(?:inf|infinity|nan)", re.I)


def ascii_int(text: Any, max_digits: int = MAX_INT_DIGITS) -> int:
    """`int(text)` for a whole number in ASCII digits (an optional sign, surrounding spaces),
    at most `max_digits` digits; ValueError otherwise (the caller words the error)."""
    t = str(text).strip()
    if not _looks_int(t, max_digits):
        raise ValueError(f"not a whole number in ASCII digits: {short_repr(text)}")
    return int(t)


def ascii_float(text: Any) -> float:
    """`float(text)` for a number in ASCII (digits, one point, an exponent; inf and nan are
    read too, for the caller's finiteness check to name); ValueError otherwise."""
    t = str(text).strip()
    if not _FLOAT_TEXT.fullmatch(t):
        raise ValueError(f"not a number in ASCII: {short_repr(text)}")
    return float(t)


def number(value: Any, what: str, *, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False, integer: bool = False, fix: str = "") -> float | int:
    """`value` as a finite number (an int if `integer`) in [lo, hi] (or (lo, hi] if `lo_open`).

    Accepts ints and floats (and number-looking strings, as PyYAML reads `1.6e12`); refuses
    bools, NaN, infinities, overflowing values and anything else, naming `what` and the range.
    """
    rng = range_text(lo, hi, lo_open=lo_open, integer=integer)
    tail = f"; {fix}" if fix else ""
    v = value
    if isinstance(v, str):
        try:
            v = ascii_float(v) if not _looks_int(v) else int(v.strip())
        except (ValueError, OverflowError):
            pass
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TpusimError(f"{what} = {short_repr(value)} is not a number; give {rng}{tail}")
    if isinstance(v, int) and hi is not None and v > hi:
        raise TpusimError(f"{what} = {short_repr(value)} is too large; give {rng}{tail}")
    try:
        f = float(v)
    except OverflowError:
        raise TpusimError(f"{what} = {short_repr(value)} is too large; give {rng}{tail}") \
            from None
    if not math.isfinite(f):
        raise TpusimError(f"{what} = {short_repr(value)} is not finite; give {rng}{tail}")
    if integer and not f.is_integer():
        raise TpusimError(f"{what} = {short_repr(value)} is not a whole number; give {rng}{tail}")
    if (lo is not None and (f < lo or (lo_open and f <= lo))) or (hi is not None and f > hi):
        raise TpusimError(f"{what} = {short_repr(value)} is out of range; give {rng}{tail}")
    if integer:
        return int(v)
    return f


def _looks_int(s: str, max_digits: int = MAX_INT_DIGITS) -> bool:
    """A whole number in ASCII digits with at most one sign (`_INT_TEXT`), at most `max_digits`
    long: Python's int() also takes full-width and other Unicode digits ("１")."""
    t = s.strip()
    return bool(_INT_TEXT.fullmatch(t)) and len(t.lstrip("+-")) <= max_digits


def bound_text(x: float) -> str:
    """A range bound as every message prints it: an int with thousands separators (16,777,216),
    a float by `%g` without the exponent's sign and padding (1e6, 1e21, 1e-6, 0.5), not %g's
    1e+06."""
    if isinstance(x, int) and not isinstance(x, bool):
        return f"{x:,}"
    mantissa, e, exponent = f"{x:g}".partition("e")
    return f"{mantissa}e{int(exponent)}" if e else mantissa


def interval_text(lo: float, hi: float, lo_open: bool = False) -> str:
    """`[lo, hi]` or `(lo, hi]` with `bound_text`'s bounds: `(0, 1e6]`, `[1, 1,024]`."""
    return f"{'(' if lo_open else '['}{bound_text(lo)}, {bound_text(hi)}]"


def range_text(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
               integer: bool = False) -> str:
    """What an error asks for, `a finite number in (0, 1e6]` / `a whole number >= 1`: the one
    formatter of every number range in every message (`number`, the flag types,
    `topologies.scenario.NumberRange`, trace fields, perturbation factors)."""
    kind = "a whole number" if integer else "a finite number"
    if lo is not None and hi is not None:
        return f"{kind} in {interval_text(lo, hi, lo_open)}"
    if lo is not None:
        return f"{kind} {'>' if lo_open else '>='} {bound_text(lo)}"
    if hi is not None:
        return f"{kind} <= {bound_text(hi)}"
    return kind


@dataclass(frozen=True, slots=True, kw_only=True)
class NumberRange:
    """The finite range a number setting must lie in, and how its errors state it."""

    low: float
    high: float
    low_open: bool = False  # (low, high] rather than [low, high]

    @property
    def interval(self) -> str:
        """The range as `(0, 1e6]` or `[0, 100]` (what the command line's help shows)."""
        return interval_text(self.low, self.high, self.low_open)

    @property
    def text(self) -> str:
        return range_text(self.low, self.high, lo_open=self.low_open)

    def holds(self, value: object) -> bool:
        """True for an int or float (not a bool) that is finite and inside the range."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        try:
            if not math.isfinite(value):
                return False
        except OverflowError:  # an int past float's range (10**400): outside every range
            return False
        above = value > self.low if self.low_open else value >= self.low
        return above and value <= self.high


# The number settings a scenario file shares with the run settings (`sim/runs/requests/base.py`)
# and the MoE router (`workloads/moe.py`): one range each, stated the same way everywhere.
CHIP_VARIATION_RANGE = NumberRange(low=0, high=1)
EXPERT_SKEW_RANGE = NumberRange(low=0, high=100)
CAPACITY_FACTOR_RANGE = NumberRange(low=0, high=1e6, low_open=True)


class FlagError(TpusimError):
    """A setting's value is invalid; the message names it (the CLI's parser reports it as is,
    the setting spelled as its flag)."""


_PYTHON_NAME = re.compile(r"[a-z_][a-z0-9_]*")


def subject(name: str) -> tuple[str, tuple[str, ...]]:
    """How a message names the setting `name` (`TpusimError`'s placeholders): a Python
    argument name (`seq_len`) is the placeholder `{seq_len}` and its params `("seq_len",)`;
    any other text (`"the trace"`) is itself, with no params."""
    if _PYTHON_NAME.fullmatch(name):
        return "{" + name + "}", (name,)
    return name, ()


def int_flag(name: str, *, lo: int = 1, hi: int):
    """A converter for the integer setting `name` (a Python argument name, see `subject`) in
    [lo, hi]; a bad value is a `FlagError` naming the setting and stating the limit."""
    what_, params = subject(name)

    def parse(text: str) -> int:
        t = str(text).strip()
        if not _looks_int(t):
            # `isdigit` is true of full-width and other Unicode digits too (`１`): those are
            # not "too large", they are not ASCII.
            digits = re.fullmatch(r"[+-]?\d+", t) is not None  # Unicode digits too
            what = ("too large" if t.isascii() else "not written in ASCII digits") if digits \
                else "not a whole number"
            raise FlagError(f"{what_} {short_repr(text)} is {what}; give "
                            f"{range_text(lo, hi, integer=True)}", *params)
        v = int(t)
        if not lo <= v <= hi:
            raise FlagError(f"{what_} {v} is out of range; give "
                            f"{range_text(lo, hi, integer=True)}", *params)
        return v

    parse.__name__ = "integer"
    return parse


def whole_flag(name: str):
    """A converter for the setting `name` (see `subject`) holding a whole number in ASCII
    digits (`int()` also takes full-width and other Unicode digits, e.g. `１`), at most
    `MAX_INT_DIGITS` long; its range is checked where it is used."""
    what_, params = subject(name)

    def parse(text: str) -> int:
        t = str(text).strip()
        if not _looks_int(t):
            what = "too large" if _INT_TEXT.fullmatch(t) else "not a whole number"
            raise FlagError(f"{what_} {short_repr(text)} is {what}; give a whole number in "
                            f"ASCII digits, e.g. 4", *params)
        return int(t)

    parse.__name__ = "integer"
    return parse


def float_flag(name: str, *, lo: float, hi: float, lo_open: bool = False):
    """A converter for the finite float setting `name` (see `subject`) in [lo, hi] (or
    (lo, hi])."""
    what_, params = subject(name)

    def parse(text: str) -> float:
        rng = range_text(lo, hi, lo_open=lo_open)
        t = str(text).strip()
        try:
            v = ascii_float(t)  # float() also takes "１" and "0_5"
        except ValueError:
            raise FlagError(f"{what_} {short_repr(text)} is not a number; give {rng}",
                            *params) from None
        if not math.isfinite(v):
            raise FlagError(f"{what_} {t[:40]} is not finite; give {rng}", *params)
        if v < lo or (lo_open and v <= lo) or v > hi:
            raise FlagError(f"{what_} {t[:40]} is out of range; give {rng}", *params)
        return v

    parse.__name__ = "number"
    return parse


def nearest_names(name: Any, choices: Iterable[str], n: int = 5) -> list[str]:
    """The `n` names of `choices` most like `name` (difflib's similarity, case ignored), best
    first: those at least 60% alike if any are, else the `n` most alike whatever their score."""
    import difflib

    names = list(dict.fromkeys(str(c) for c in choices))
    lower: dict[str, str] = {}
    for c in names:
        lower.setdefault(c.lower(), c)
    text = str(name).lower()[:200]
    close = difflib.get_close_matches(text, list(lower), n=n, cutoff=0.6) \
        or difflib.get_close_matches(text, list(lower), n=n, cutoff=0.0)
    return [lower[c] for c in close]


def one_of(name: Any, choices: Iterable[str], *, listing: str = "") -> str:
    """What to give instead of the unknown `name`, on one short line: every choice when there
    are at most five ("use one of: a, b, c"), else the five nearest by similarity ("did you mean
    a, b or c?", "the nearest are ...") and how many there are, with `listing` (where the
    whole list is: "`tpusim presets` lists them") after the count."""
    names = list(dict.fromkeys(str(c) for c in choices))
    if len(names) <= 5:
        return f"use one of: {', '.join(names)}"
    import difflib

    near = nearest_names(name, names)
    alike = difflib.SequenceMatcher(None, str(name).lower()[:200], near[0].lower()).ratio() \
        >= 0.6 if near else False
    words = near[0] if len(near) == 1 else f"{', '.join(near[:-1])} or {near[-1]}"
    head = f"did you mean {words}?" if alike else f"the nearest are {', '.join(near)}"
    return f"{head} ({len(names)} in all{'; ' + listing if listing else ''})"


def parse_choice(choices: type[E], text: Any, name: str, what: str) -> E:
    """`choices(text)` for a string enum (`Remat`, `Optimizer`), or a one-line error in one
    wording for all of them, naming the setting `name` (see `subject`):
    `remat 'text' is not a remat policy; use one of: a, b, c`."""
    try:
        return choices(text)
    except ValueError:
        who, params = subject(name)
        raise TpusimError(
            f"{who} {short_repr(text)} is not {what}; "
            f"{one_of(text, [str(c.value) for c in choices])}", *params
        ) from None


def split_list(text: str, name: str, *, sep: str = ",", example: str = "") -> list[str]:
    """`"a,b"` -> ["a", "b"]; an empty item (`a,,b`, a trailing comma) is an error naming the
    setting `name` (see `subject`)."""
    items = [x.strip() for x in str(text).split(sep)]
    if not text.strip() or any(not x for x in items):
        ex = f", e.g. {example}" if example else ""
        who, params = subject(name)
        raise TpusimError(f"{who} {short_repr(text)} has an empty item; separate non-empty "
                          f"items with {sep!r}{ex}", *params)
    return items


def api_call(name: str):
    """Decorate a function of the Python API (`sim.train`, `sim.sweep`, ...): a call that does
    not match its signature (a setting given positionally, a misspelt keyword, a required one
    left out) raises a one-line `TpusimError` naming the call, as every other bad input does,
    instead of Python's own `TypeError`. Only the binding is checked here, so a `TypeError`
    from inside the run is not mistaken for a bad call."""
    import functools
    import inspect

    def wrap(fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any):
            try:
                sig.bind(*args, **kwargs)
            except TypeError as exc:
                raise TpusimError(f"{name}(): {exc}; give the settings as keywords "
                                  f"(see help({name}))") from None
            return fn(*args, **kwargs)

        return call

    return wrap
