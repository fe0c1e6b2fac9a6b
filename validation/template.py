"""The documents the validation pipelines write are templates: prose in
validation/templates/NAME.md with `{{name}}` placeholders, each filled with a table or a number
the pipeline computes. Every placeholder must get a value and every value a placeholder, so a
renamed or forgotten one is an error, not a silent gap."""

from __future__ import annotations

import re
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parent / "templates"
PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


def splice(doc: str, begin: str, end: str, text: str) -> str:
    """`doc` with the text from `begin` to `end` (markers included) replaced by `text`, or `text`
    appended after a blank line when the markers are absent: how every pipeline rewrites its
    generated section of a document and leaves the rest as it is."""
    if begin in doc:
        start, stop = doc.index(begin), doc.index(end) + len(end)
        return doc[:start] + text + doc[stop:]
    return doc.rstrip("\n") + "\n\n" + text + "\n"


def render(name: str, values: dict[str, str]) -> str:
    """templates/NAME with its placeholders replaced by `values` (the file's last newline is
    not part of the text)."""
    text = (TEMPLATES / name).read_text(encoding="utf-8")
    text = text[:-1] if text.endswith("\n") else text
    wanted = set(PLACEHOLDER.findall(text))
    if wanted != set(values):
        missing, unused = sorted(wanted - set(values)), sorted(set(values) - wanted)
        raise ValueError(f"template {name}: no value for {missing}, no placeholder for {unused}")
    return PLACEHOLDER.sub(lambda m: values[m.group(1)], text)
