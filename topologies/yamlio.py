"""Reading small YAML/JSON configuration files into plain mappings, with one-line errors.

Only the CLI and `load_*` helpers call this; building specs from dicts never touches the disk.
The reader is deliberately narrow, because a config file is untrusted input:

* safe construction only (no `!!python/...` tags: they are errors, nothing is ever executed);
* no aliases (`*name`): a billion-laughs document expands nothing, it is refused;
* nesting at most `MAX_NESTING` deep, integers of at most `MAX_INT_DIGITS` digits, files of at
  most `MAX_CONFIG_FILE_BYTES`, YAML of at most `MAX_YAML_ITEMS` items (no recursion, memory
  blow-up or 17 s parse);
* YAML 1.2 scalars: `1:30` stays the string "1:30" (YAML 1.1 reads it as 90), `2024-01-01`
  stays a string (not a date), `yes`/`no`/`on`/`off` stay strings, `1.6e12` is a float;
* top-level keys must be strings.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from topologies.errors import TpusimError
from topologies.validate import (
    MAX_CONFIG_FILE_BYTES,
    MAX_INT_DIGITS,
    MAX_NESTING,
    short_repr,
)


class RefusedInput(Exception):
    """A document feature the loader refuses (aliases, deep nesting, huge integers)."""


def _int(text: str) -> int:
    digits = text.lstrip("+-")
    if len(digits) > MAX_INT_DIGITS:
        raise RefusedInput(f"an integer of {len(digits)} digits (the limit is {MAX_INT_DIGITS})")
    return int(text, 0) if digits[:2].lower() in ("0x", "0o", "0b") else int(text)


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 core-schema scalars, no aliases and bounded nesting."""

    yaml_implicit_resolvers: dict = {}
    _depth = 0

    def compose_node(self, parent, index):  # type: ignore[override]
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise RefusedInput(
                f"an alias *{event.anchor} at line {event.start_mark.line + 1} (aliases are not "
                f"supported; write the value out)"
            )
        self._depth += 1
        try:
            if self._depth > MAX_NESTING:
                mark = self.peek_event().start_mark
                raise RefusedInput(f"nesting deeper than {MAX_NESTING} levels at line "
                               f"{mark.line + 1}")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_yaml_int(self, node):  # type: ignore[override]
        try:
            return _int(self.construct_scalar(node).replace("_", ""))
        except RefusedInput as exc:
            raise RefusedInput(f"{exc} at line {node.start_mark.line + 1}") from None


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_yaml_int)
# YAML 1.2 core schema (https://yaml.org/spec/1.2.2/#1032-tag-resolution).
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:null", re.compile(r"^(?:~|null|Null|NULL|)$"), ["~", "n", "N", ""])
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
    list("tTfF"))
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"),
    list("-+0123456789"))
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
               r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+.0123456789"))


# PyYAML's pure-Python scanner takes ~40 us per value: a 1 MiB file of 400,000 list items took
# 17 s and 320 MB to be refused. Items are counted first (every value but the first of a line
# follows a comma, so commas plus lines bound them, up to the keys of `{a: 1}` flow mappings):
# at most 20,000, about a second. Real chip, model and scenario files hold tens; a study
# that long is better written as JSON, which has no such limit.
MAX_YAML_ITEMS = 20_000


def parse_yaml(text: str) -> Any:
    """Parse YAML text with the strict loader (raises `RefusedInput` or `yaml.YAMLError`)."""
    items = text.count(",") + text.count("\n")
    if items > MAX_YAML_ITEMS:
        raise RefusedInput(f"about {items:,} items (commas and lines; the limit of a YAML file is "
                       f"{MAX_YAML_ITEMS:,}): give fewer values, or write the file as JSON")
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass


def _json_constant(name: str):
    raise RefusedInput(f"{name} (numbers must be finite)")


def parse_json(text: str) -> Any:
    """Parse JSON text: finite numbers, integers of at most `MAX_INT_DIGITS` digits, nesting at
    most `MAX_NESTING` deep (raises `RefusedInput` or `json.JSONDecodeError`)."""
    depth = max_depth_json(text)
    if depth > MAX_NESTING:
        raise RefusedInput(f"nesting deeper than {MAX_NESTING} levels")
    return json.loads(text, parse_int=_int, parse_constant=_json_constant)


def max_depth_json(text: str) -> int:
    """Bracket nesting depth of JSON text, ignoring brackets inside strings (linear scan)."""
    depth = best = 0
    # Strings are removed first so brackets inside them do not count.
    for m in re.finditer(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', text):
        tok = m.group()
        if tok in "[{":
            depth += 1
            best = max(best, depth)
        elif tok in "]}":
            depth -= 1
    return best


def read_text_bounded(path: Path, *, what: str, limit: int, hint: str) -> str:
    """The UTF-8 text of `path`, refusing a missing, unreadable or larger-than-`limit` file."""
    if not path.is_file():
        raise TpusimError(f"{what} file {str(path)!r} does not exist or is not a file; {hint}")
    try:
        size = path.stat().st_size
        if size > limit:
            raise TpusimError(
                f"{what} file {str(path)!r} is {size:,} bytes, over the limit of {limit:,}; "
                f"give a smaller file"
            )
        with path.open("rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise TpusimError(f"{what} file {str(path)!r} is over the limit of {limit:,} bytes; "
                              f"give a smaller file")
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else \
            type(exc).__name__
        raise TpusimError(
            f"{what} file {str(path)!r} cannot be read as UTF-8 text ({reason}); give a text file"
        ) from None


def read_yaml_mapping(path: Path, *, what: str) -> dict[str, Any]:
    """Parse `path` (YAML or JSON) and return its top-level mapping (string keys)."""
    text = read_text_bounded(
        path, what=what, limit=MAX_CONFIG_FILE_BYTES,
        hint="give a preset name or a path to a YAML file")
    src = f"{what} file {str(path)!r}"
    is_json = path.suffix.lower() == ".json"
    try:
        data = parse_json(text) if is_json else parse_yaml(text)
    except RefusedInput as exc:
        raise TpusimError(f"{src} holds {exc}") from None
    except json.JSONDecodeError as exc:
        raise TpusimError(
            f"{src} is not valid JSON at line {exc.lineno} column {exc.colno} ({exc.msg}); "
            f"fix the syntax"
        ) from None
    except yaml.constructor.ConstructorError as exc:
        tag = getattr(exc, "problem", "") or ""
        if "unhashable" in tag:
            raise TpusimError(
                f"{src} has a key that is a list or mapping; keys must be field names (text)"
            ) from None
        raise TpusimError(
            f"{src} uses a YAML tag that is not plain data ({tag.split(chr(10))[0][:80]}); "
            f"write plain values"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise TpusimError(
            f"{src} is not valid YAML{where}; fix the syntax (expected `key: value` lines)"
        ) from None
    except RecursionError:  # pragma: no cover - nesting is bounded above
        raise TpusimError(f"{src} is nested too deeply") from None
    if not isinstance(data, dict):
        kind = "an empty file" if data is None else type(data).__name__
        raise TpusimError(
            f"{src} must hold a mapping of `key: value` lines, got {kind}"
        )
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise TpusimError(
            f"{src} has the key {short_repr(bad[0])} ({type(bad[0]).__name__}); keys must be "
            f"field names (text)"
        )
    return data
