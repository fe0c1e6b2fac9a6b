"""User-facing error type shared by every tpusim package.

A `TpusimError` is bad input, not a bug: the CLI prints its message on one line and exits 2.
Messages say what was given, which rule it broke, and what to change.

An error names the settings it is about structurally, never by a front end's spelling: its
message is a template in which each setting it names is a `{name}` placeholder for the Python
argument (`seq_len`, `dead_link`, `set`), and the names are listed after the message:

    raise TpusimError(f"{{seq_len}} {short_repr(text)} is out of range; give ...", "seq_len")

`str(exc)` writes each placeholder as the Python name (`seq_len 0 is out of range; ...`), as a
Python caller gave it; a front end renders the same error in its own spelling with
`exc.render(spell)` (the CLI: the flag of that name, from its parser). Only the
listed names are placeholders, so any other brace in the message (a dict, a user's text) is
text. An error that adds to another keeps its placeholders by building on its `template`:

    raise TpusimError(f"{exc.template} (see ...)", *exc.params) from None
"""

from __future__ import annotations

from collections.abc import Callable


def python_name(name: str) -> str:
    """The spelling of a setting in `str(exc)`: the Python argument's name as is."""
    return name


class TpusimError(ValueError):
    """Bad user input (unknown name, impossible shape, malformed file).

    `TpusimError(message, *params)`: `message` is the template, `params` the Python argument
    names whose `{name}` placeholders it holds (none: plain text). The error pickles with
    them (it travels back from a worker process whole)."""

    def __init__(self, message: str = "", *params: str) -> None:
        super().__init__(message, *params)

    @property
    def template(self) -> str:
        """The message with its `{name}` placeholders (what a wrapping error builds on)."""
        return str(self.args[0]) if self.args else ""

    @property
    def params(self) -> tuple[str, ...]:
        """The Python argument names the message names, in order."""
        return tuple(str(p) for p in self.args[1:])

    def render(self, spell: Callable[[str], str] = python_name) -> str:
        """The message with each named setting written as `spell(name)` (`str(exc)`: the
        Python name; the CLI: the flag)."""
        text = self.template
        for name in dict.fromkeys(self.params):
            text = text.replace("{" + name + "}", spell(name))
        return text

    def __str__(self) -> str:
        return self.render(python_name)


class Said(str):
    """A `TpusimError`'s message kept as data in a result (a refused candidate's `reason`).

    Its text is `str(exc)`, each setting by its Python name, as a Python caller reads it and as
    JSON writes it; a front end writes it in its own spelling with `render(spell)`, as it does
    the error itself (`render_said` over a whole result). It pickles with its placeholders."""

    template: str
    params: tuple[str, ...]

    def __new__(cls, exc: TpusimError) -> Said:
        said = super().__new__(cls, str(exc))
        said.template, said.params = exc.template, exc.params
        return said

    def render(self, spell: Callable[[str], str] = python_name) -> str:
        return TpusimError(self.template, *self.params).render(spell)

    def __reduce__(self):
        return _said, (self.template, self.params)


def _said(template: str, params: tuple[str, ...]) -> Said:
    return Said(TpusimError(template, *params))


def render_said(obj, spell: Callable[[str], str]):
    """`obj` (JSON-like: dicts, lists, tuples, scalars) with every `Said` in it written as
    `spell` spells settings; everything else as it is."""
    if isinstance(obj, Said):
        return obj.render(spell)
    if isinstance(obj, dict):
        return {k: render_said(v, spell) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(render_said(v, spell) for v in obj)
    return obj
