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
