"""ASTRA-sim's communicator-group file (its comm-group configuration, `chakra_comm_group`
here): a JSON object mapping a group id to the ranks (NPU ids) in it, e.g.
`{"1": [0, 1, 2, 3], "2": [4, 5, 6, 7]}`. A collective whose `pg_name` is that id runs over
those ranks (docs/reference/chakra.md §6: the file is one of the two places a `pg_name` is
looked up, a `process_group:init` METADATA_NODE the other).

The file's groups take precedence over a METADATA_NODE's of the same id (it is what the user
gave for this replay; `convert` counts each such group in the approximations). Ids are decimal
integer strings, as ASTRA-sim parses them; each group is a non-empty list of distinct ranks
(checked against the set's ranks when it is converted). The file is read with the bounds every
tpusim input has (its size, JSON nesting and integer digits), so a hostile file is one line.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from topologies.errors import TpusimError
from topologies.yamlio import parse_json, read_text_bounded

MAX_COMM_GROUP_BYTES = 16 << 20
MAX_GROUP_RANKS = 65_536
_ID = re.compile(r"(0|[1-9][0-9]{0,17})")
EXAMPLE = '{"1": [0, 1], "2": [2, 3]}'


def read_comm_groups(path: str) -> tuple[dict[str, tuple[int, ...]], str]:
    """({group id: its ranks, sorted}, the file's SHA-256) of a communicator-group file."""
    p = Path(path)
    where = f"comm-group file {str(p)!r} ({{chakra_comm_group}})"
    try:
        text = read_text_bounded(p, what="comm-group", limit=MAX_COMM_GROUP_BYTES,
                                 hint=f"give ASTRA-sim's communicator-group JSON ({EXAMPLE}) "
                                      f"as {{chakra_comm_group}}")
    except TpusimError as exc:  # the hint names the setting: a placeholder of the error too
        raise TpusimError(exc.template, *exc.params, "chakra_comm_group") from None
    try:
        doc = parse_json(text)
    except Exception as exc:  # noqa: BLE001 -- parse_json's refusals (nesting, digits) and
        # json's ValueError: any of them is a file that is not the JSON this reads
        raise TpusimError(f"{where} is not JSON tpusim reads ({str(exc)[:80]}); give an object "
                          f"of group id to ranks, e.g. {EXAMPLE}", "chakra_comm_group") from None
    if not isinstance(doc, dict) or not doc:
        raise TpusimError(f"{where} must be a non-empty JSON object of group id to ranks, e.g. "
                          f"{EXAMPLE}", "chakra_comm_group")
    out: dict[str, tuple[int, ...]] = {}
    for key, ranks in doc.items():
        name = f"{where}: group {key[:20]!r}"
        if not _ID.fullmatch(key):
            raise TpusimError(f"{name}: a group id is a decimal integer (the pg_name a "
                              f"collective names); rename the group", "chakra_comm_group")
        if not isinstance(ranks, list) or not ranks or len(ranks) > MAX_GROUP_RANKS or not all(
                isinstance(r, int) and not isinstance(r, bool) and 0 <= r < MAX_GROUP_RANKS
                for r in ranks):
            raise TpusimError(f"{name} must be a non-empty list of ranks (whole numbers in "
                              f"0..{MAX_GROUP_RANKS - 1}); list the group's ranks",
                              "chakra_comm_group")
        if len(set(ranks)) != len(ranks):
            raise TpusimError(f"{name} lists a rank twice; list each rank once",
                              "chakra_comm_group")
        out[key] = tuple(sorted(ranks))
    return out, hashlib.sha256(text.encode("utf-8")).hexdigest()


def check_ranks(groups: dict[str, tuple[int, ...]], num_ranks: int, source: str,
                path: str | None = None) -> None:
    """Every group's ranks are ranks of the set (0..num_ranks - 1)."""
    name = "comm-group file" + ("" if path is None else f" {str(path)!r}")
    for key, ranks in groups.items():
        if ranks[-1] >= num_ranks:
            raise TpusimError(
                f"{name} ({{chakra_comm_group}}): group {key[:20]!r} lists rank "
                f"{ranks[-1]}, but chakra trace {source!r} runs ranks 0..{num_ranks - 1}; give "
                f"the communicator groups of this trace", "chakra_comm_group")
