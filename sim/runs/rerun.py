"""A recorded result run again: the request its `inputs` describe, rebuilt and simulated.

The recorded chip and model specs are used, not the files or presets they came from, so a result
reruns the same even after a chip YAML or a preset changed; `set` overrides are undone on the
recorded specs and applied again, so `inputs` comes out identical too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sim.chips import chip_from_dict
from sim.runs import REQUESTS, Request, Run, run
from topologies.errors import TpusimError
from topologies.scenario import scenario_from_dict
from topologies.validate import MAX_TRACE_FILE_BYTES, short_repr
from topologies.yamlio import RefusedInput, parse_json, read_text_bounded
from workloads.zoo import model_from_dict

RERUNNABLE = ("collective", "compare-collectives", "train", "replay", "decode", "prefill",
              "serve-sweep", "serve", "goodput")


def _base_specs(inputs: dict[str, Any], source: str):
    """The chip and model before `set`: the recorded specs with each override's base value."""
    ov = inputs.get("overrides") or {}
    if not isinstance(ov, dict) or not all(isinstance(v, dict) and "base" in v
                                           for v in ov.values()):
        raise TpusimError(f"{source}: inputs.overrides must map each key to "
                          f"{{given, base, value}}; the file is not a tpusim result")
    for key in ("chip", "model", "perturbations", "trace"):
        if inputs.get(key) is not None and not isinstance(inputs[key], dict):
            raise TpusimError(f"{source}: inputs.{key} is {short_repr(inputs[key])}, not an "
                              f"object of fields; the file was edited: restore it or rerun the "
                              f"command")
    chip = model = None
    if inputs.get("chip") is not None:
        data = dict(inputs["chip"])
        for key, o in ov.items():
            if not key.startswith("model."):
                data[key] = o["base"]
        chip = _checked(chip_from_dict, data, f"{source}: inputs.chip")
    if inputs.get("model") is not None:
        data = dict(inputs["model"])
        for key, o in ov.items():
            if key.startswith("model."):
                data[key.removeprefix("model.")] = o["base"]
        model = _checked(model_from_dict, data, f"{source}: inputs.model")
    return chip, model


def _checked(build, data: dict[str, Any], source: str):
    """`build(data)`, with every error naming where in the file the bad spec is."""
    try:
        return build(data, source=source)
    except TpusimError as exc:
        # Built on the template, so the settings it names keep their placeholders.
        raise TpusimError(exc.template if str(exc).startswith(source)
                          else f"{source}: {exc.template}", *exc.params) from None


def request_from_result(data: Any, *, source: str = "result") -> Request:
    """The request a recorded result's `inputs` describe (with its recorded specs)."""
    if not isinstance(data, dict) or not isinstance(data.get("inputs"), dict):
        raise TpusimError(
            f"{source} has no \"inputs\" object; give a {{json}} result or a summary.json "
            f"written by tpusim (after this version), which records its inputs", "json"
        )
    inputs = data["inputs"]
    command, flags = inputs.get("command"), inputs.get("flags")
    if command not in RERUNNABLE:
        raise TpusimError(
            f"{source}: inputs.command {command!r} cannot be rerun; results of "
            f"{', '.join(RERUNNABLE)} can"
        )
    if not isinstance(flags, dict):
        raise TpusimError(f"{source}: inputs.flags must be an object of the command's flags")
    chip, model = _base_specs(inputs, source)
    objects: dict[str, Any] = {"chip_spec": chip, "model_spec": model}
    if inputs.get("perturbations") is not None:
        objects["scenario_spec"] = scenario_from_dict(
            inputs["perturbations"], source=f"{source}: inputs.perturbations")
    if command == "replay":
        # A replay reruns the file at the recorded path only if it is the file that ran: its
        # SHA-256 must be recorded (a null or edited-out `trace` used to skip the check and
        # replay whatever the path holds now).
        digest = (inputs.get("trace") or {}).get("sha256")
        if not isinstance(digest, str) or len(digest) != 64 \
                or any(c not in "0123456789abcdef" for c in digest):
            raise TpusimError(
                f"{source}: inputs.trace.sha256 is {short_repr(digest)}, not the SHA-256 of "
                f"the trace file that ran, so a rerun cannot check it replays the same file; "
                f"the file was edited: restore it, or run `tpusim replay` on the trace again")
        objects["trace_sha256"] = digest
    cls = REQUESTS[command]
    return cls.from_flags(flags, source=source, **objects)


def rerun(data: Any, *, source: str = "result") -> Run:
    """The `Run` that a recorded result's `inputs` describe, simulated again."""
    return run(request_from_result(data, source=source))


def read_result(path: Path) -> tuple[Any, str]:
    """(the parsed JSON, its text) of a result file, read with the config-file rules (one-line
    errors naming the file and the fix)."""
    hint = "give a file written by {json} or the summary.json of an {out} directory"
    if path.is_dir():
        raise TpusimError(f"result file {str(path)!r} is a directory; give "
                          f"{str(path / 'summary.json')!r} (what {{out}} writes) or a {{json}} "
                          f"file", "out", "json")
    if not path.exists():
        raise TpusimError(f"result file {str(path)!r} does not exist; {hint}", "json", "out")
    # A result is at most a few MB (the per-collective table of a step); the trace-file limit
    # bounds what is read, and parse_json bounds nesting and integers.
    try:
        text = read_text_bounded(path, what="result", limit=MAX_TRACE_FILE_BYTES, hint=hint)
    except TpusimError as exc:  # the hint's settings are placeholders of the error too
        raise TpusimError(exc.template, *exc.params, "json", "out") from None
    try:
        data = parse_json(text)
    except RefusedInput as exc:
        raise TpusimError(f"result file {str(path)!r} holds {exc}; {hint}", "json",
                          "out") from None
    except json.JSONDecodeError as exc:
        raise TpusimError(
            f"result file {str(path)!r} is not JSON ({exc.msg} at line {exc.lineno}); give a "
            f"file written by {{json}} or an {{out}} directory's summary.json", "json", "out"
        ) from None
    return data, text
