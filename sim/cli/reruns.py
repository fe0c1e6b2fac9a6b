"""`tpusim rerun RESULT.json`: run a recorded result again from its `inputs` and print the same
JSON, byte for byte (`--check` compares it with the file).

The recorded chip and model specs are used, not the files or presets they came from, so a result
reruns the same even after a chip YAML or a preset changed; `--set` overrides are undone on the
recorded specs and applied again, so `inputs` comes out identical too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from sim.cli import common as cli
from topologies.errors import TpusimError

RUNNERS = ("collective", "compare-collectives", "train", "replay", "decode", "prefill",
           "serve-sweep")


def _runner(command: str):
    from sim.cli import collectives, inference, training

    return {
        "collective": collectives.run_collective,
        "compare-collectives": collectives.run_compare,
        "train": training.run_train,
        "replay": training.run_replay,
        "decode": inference.run_decode,
        "prefill": inference.run_prefill,
        "serve-sweep": inference.run_serve_sweep,
    }[command]


def _base_specs(inputs: dict[str, Any], source: str):
    """The chip and model before `--set`: the recorded specs with each override's base value."""
    from sim.hardware import chip_from_dict
    from workloads.models import model_from_dict

    ov = inputs.get("overrides") or {}
    if not isinstance(ov, dict) or not all(isinstance(v, dict) and "base" in v
                                           for v in ov.values()):
        raise TpusimError(f"{source}: inputs.overrides must map each key to "
                          f"{{given, base, value}}; the file is not a tpusim result")
    for key in ("chip", "model", "perturbations", "trace"):
        if inputs.get(key) is not None and not isinstance(inputs[key], dict):
            from topologies.validate import short_repr

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
        raise TpusimError(str(exc) if str(exc).startswith(source) else f"{source}: {exc}") \
            from None


def rerun(data: Any, *, source: str = "result"):
    """The `Run` that a recorded result's `inputs` describe, simulated again."""
    from sim.cli import build_parser, prepare

    if not isinstance(data, dict) or not isinstance(data.get("inputs"), dict):
        raise TpusimError(
            f"{source} has no \"inputs\" object; give a --json result or a summary.json "
            f"written by tpusim (after this version), which records its inputs"
        )
    inputs = data["inputs"]
    command, flags = inputs.get("command"), inputs.get("flags")
    if command not in RUNNERS:
        raise TpusimError(
            f"{source}: inputs.command {command!r} cannot be rerun; results of "
            f"{', '.join(RUNNERS)} can"
        )
    if not isinstance(flags, dict):
        raise TpusimError(f"{source}: inputs.flags must be an object of the command's flags")
    chip, model = _base_specs(inputs, source)
    sub = build_parser().get_default("commands")[command]
    argv = cli.argv_from_flags(command, flags, cli.flag_specs(sub))
    args = prepare(argv, chip_spec=chip, model_spec=model)
    if inputs.get("perturbations") is not None:
        from topologies.scenario import scenario_from_dict

        args.scenario_spec = scenario_from_dict(inputs["perturbations"],
                                                source=f"{source}: inputs.perturbations")
    if command == "replay":
        args.trace_sha256 = (inputs.get("trace") or {}).get("sha256")
    return _runner(command)(args)


def read_result(path: Path) -> tuple[Any, str]:
    """(the parsed JSON, its text) of a result file, read with the config-file rules (one-line
    errors naming the file and the fix)."""
    from topologies.validate import MAX_TRACE_FILE_BYTES
    from topologies.yamlio import _Refused, parse_json, read_text_bounded

    hint = "give a file written by --json or the summary.json of an --out directory"
    if path.is_dir():
        raise TpusimError(f"result file {str(path)!r} is a directory; give "
                          f"{str(path / 'summary.json')!r} (what --out writes) or a --json file")
    if not path.exists():
        raise TpusimError(f"result file {str(path)!r} does not exist; {hint}")
    # A result is at most a few MB (the per-collective table of a step); the trace-file limit
    # bounds what is read, and parse_json bounds nesting and integers.
    text = read_text_bounded(path, what="result", limit=MAX_TRACE_FILE_BYTES, hint=hint)
    try:
        data = parse_json(text)
    except _Refused as exc:
        raise TpusimError(f"result file {str(path)!r} holds {exc}; {hint}") from None
    except json.JSONDecodeError as exc:
        raise TpusimError(
            f"result file {str(path)!r} is not JSON ({exc.msg} at line {exc.lineno}); give a "
            f"file written by --json or an --out directory's summary.json"
        ) from None
    return data, text


def cmd_rerun(args: argparse.Namespace) -> int:
    path = Path(args.result)
    data, text = read_result(path)
    run = rerun(data, source=f"result file {str(path)!r}")
    out = json.dumps(run.to_dict(), indent=2, sort_keys=False) + "\n"
    sys.stdout.write(out)
    if args.check and out != text:
        old, new = data, run.to_dict()
        keys = [k for k in dict.fromkeys([*old, *new]) if old.get(k) != new.get(k)]
        sys.stderr.write(f"tpusim: rerun differs from {path} in: {', '.join(keys) or 'format'}\n")
        return 1
    return 0


def register(sub) -> None:
    p = sub.add_parser("rerun", help="run a recorded result again from its inputs")
    p.add_argument("result", help="a --json result, or an --out directory's summary.json")
    p.add_argument("--check", action="store_true",
                   help="exit 1 (naming the fields) if the new result is not byte-identical")
    p.set_defaults(func=cmd_rerun)
