"""User-facing error type shared by every tpusim package.

A `TpusimError` is bad input, not a bug: the CLI prints its message on one line and exits 2.
Messages say what was given, which rule it broke, and what to change.
"""

from __future__ import annotations


class TpusimError(ValueError):
    """Bad user input (unknown name, impossible shape, malformed file)."""
