"""Reading small YAML/JSON configuration files into plain mappings, with one-line errors.

Only the CLI and `load_*` helpers call this; building specs from dicts never touches the disk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from topologies.errors import TpusimError


def read_yaml_mapping(path: Path, *, what: str) -> dict[str, Any]:
    """Parse `path` (YAML or JSON) and return its top-level mapping."""
    import yaml

    if not path.is_file():
        raise TpusimError(
            f"{what} file {str(path)!r} does not exist; give a preset name or a path to a YAML file"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TpusimError(
            f"{what} file {str(path)!r} cannot be read as UTF-8 text: {exc}"
        ) from None
    if path.suffix.lower() == ".json":
        import json

        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TpusimError(
                f"{what} file {str(path)!r} is not valid JSON at line {exc.lineno}; fix the syntax"
            ) from None
        if not isinstance(data, dict):
            raise TpusimError(f"{what} file {str(path)!r} must hold a JSON object")
        return data
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise TpusimError(
            f"{what} file {str(path)!r} is not valid YAML{where}; fix the syntax "
            f"(expected `key: value` lines)"
        ) from None
    if not isinstance(data, dict):
        raise TpusimError(
            f"{what} file {str(path)!r} must hold a mapping of `key: value` lines, "
            f"got {type(data).__name__}"
        )
    return data
