"""Generated fuzz cases for the `tpusim` CLI, one generator per input surface (flags, chip YAML,
model YAML, trace files, output paths), driven by a `random.Random` so that the hypothesis
tests (`st.randoms()`) and `benchmarks/fuzz_cli.py` (a seeded `Random`) share them.

Each case knows whether its input is surely invalid (`expect: "error"`: it must be refused with
one line, exit 2) or merely odd (`expect: "any"`: exit 0 with finite outputs, or a clean error).
"""

from __future__ import annotations

import json
import random
from typing import Any

from fuzz_harness import COLLECTIVE, DECODE, POD, PREFILL, SWEEP, TINY_MODEL, TRAIN

# Values that no numeric flag accepts, and values that are merely odd.
BAD_NUMBERS = ["nan", "inf", "-inf", "-1", "", " ", "abc", "1e400", "9" * 400, "1,,2", "0x10",
               "1Mb", "1Gib", "--", "１", "1e-320"]
ODD_NUMBERS = ["0", "1", "2", "3", "7", "16", "1000", "65536", "1e6", "0.5", "1.5", "1e9"]
BAD_LISTS = ["x,,y", ",", "x,", ",x", "", "x,,", " , "]
ODD_TEXT = ["x", "y", "z", "x,y", "x,y,z", "dcn", "x,dcn", "q", "xx", "x y", "é", "X"]

# Flags of each command with a "kind" used to pick values: int/float/bytes/list/text/path.
FLAGS = {
    "collective": {"--bytes": "bytes", "--axes": "axes", "--chunks": "int", "--slices": "int",
                   "--shift": "shift", "--slow-link": "slow", "--algorithm": "text",
                   "--mode": "text", "--wraparound": "text", "--shape": "shape",
                   "--out": "dir", "--perfetto": "file", "--plots": "dir"},
    "compare-collectives": {"--bytes": "bytes", "--axes": "axes", "--slices": "int",
                            "--chunks": "int", "--perfetto": "file"},
    "train": {"--seq-len": "int", "--batch-per-chip": "float", "--microbatches": "int",
              "--mesh": "mesh", "--dcn": "mesh", "--slices": "int", "--remat": "text",
              "--trace-chips": "chips", "--out": "dir", "--perfetto": "file", "--plots": "dir",
              "--attention": "text", "--axis-map": "text", "--shape": "shape"},
    "decode": {"--batch": "int", "--context-len": "int", "--mesh": "mesh", "--weight-dtype": "text",
               "--kv-dtype": "text", "--out": "dir", "--perfetto": "file", "--dcn": "mesh"},
    "prefill": {"--batch": "int", "--prompt-len": "int", "--prefill-chunk": "int",
                "--mesh": "mesh", "--out": "dir"},
    "serve-sweep": {"--batches": "list", "--context-len": "int", "--mesh": "mesh",
                    "--weight-dtype": "list", "--out": "dir"},
}
BASES = {"collective": COLLECTIVE, "train": TRAIN, "decode": DECODE, "prefill": PREFILL,
         "serve-sweep": SWEEP,
         "compare-collectives": ["compare-collectives", *COLLECTIVE[1:]]}


def _value(rng: random.Random, kind: str) -> tuple[str, bool]:
    """(value, surely_invalid) for a flag of `kind`."""
    if kind == "shift":  # any whole number: negative shifts go the other way round
        v = rng.choice(BAD_NUMBERS + ["-1", "-3", "5", "0"])
        return v, v not in ("-1", "-3", "5", "0")
    if kind in ("int", "float", "bytes"):
        if rng.random() < 0.5:
            v = rng.choice(BAD_NUMBERS)
            # 1e-320 is a (tiny) positive float: odd, not invalid, for --batch-per-chip.
            return v, not (kind == "float" and v == "1e-320")
        v = rng.choice(ODD_NUMBERS + (["1KiB", "64MiB", "3 MB", "1e3B"] if kind == "bytes" else []))
        return v, False
    if kind == "axes":
        if rng.random() < 0.4:
            return rng.choice(BAD_LISTS), True
        return rng.choice(ODD_TEXT), False
    if kind == "list":
        if rng.random() < 0.4:
            return rng.choice(BAD_LISTS + ["1,,2", "0", "-3", "nan", ",".join(["1"] * 600)]), True
        sizes = [str(rng.choice([1, 2, 3, 8, 64, 1000])) for _ in range(rng.randint(1, 4))]
        return ",".join(sizes), False
    if kind == "mesh":
        return rng.choice(["fsdp=4", "tensor=4", "data=2,fsdp=2", "fsdp=0", "fsdp=-1", "fsdp=x",
                           "fsdp=" + "9" * 50, "bogus=4", "fsdp=4,fsdp=1", "", "data=2",
                           "tensor=2,tensor=2", "expert=4", "pipeline=4", "sequence=4"]), False
    if kind == "chips":
        v = rng.choice(["0-999999999", "all", "0", "0-3", "3-1", "x", "0,,1", "", "-1", "1-2-3",
                        "0-" + "9" * 40, "2,0,1"])
        return v, v in ("0-999999999", "3-1", "x", "0,,1", "", "-1", "1-2-3", "0-" + "9" * 40)
    if kind == "shape":
        v = rng.choice(["2x2", "4x4", "1x1", "0x4", "4x", "100000x100000", "2x2x2x2", "16x16",
                        "9" * 30 + "x1", "2×2", "-2x2"])
        return v, v in ("0x4", "4x", "100000x100000", "2x2x2x2", "9" * 30 + "x1", "-2x2")
    if kind == "slow":
        v = rng.choice(["0,0:x+:0.5", "0,0:x+:1e-320", "0,0:x+:nan", "0,0:q+", "9,9:x+",
                        "0,0:x+:2", "0,0", "0,0:x+:1e-7", "0,0:y-:0.25"])
        return v, v not in ("0,0:x+:0.5", "0,0:y-:0.25", "0,0:x+:2")  # > 1 = a faster link
    if kind == "dir":
        v = rng.choice(["{tmp}/o", "", "{tmp}/" + "d" * 300, "{tmp}/tiny.yaml", "{tmp}/o/",
                        "{tmp}//o", "{tmp}/fifo", "{tmp}/sub/dir"])
        return v, v in ("", "{tmp}/" + "d" * 300, "{tmp}/tiny.yaml", "{tmp}/fifo")
    if kind == "file":
        v = rng.choice(["{tmp}/t.pftrace", "{tmp}/t.json", "", "{tmp}/" + "f" * 300,
                        "{tmp}", "{tmp}/fifo", "{tmp}/link", "{tmp}/o"])
        return v, v in ("", "{tmp}/" + "f" * 300, "{tmp}")
    return rng.choice(ODD_TEXT + ["auto", "ring", "full", "none", "all", "flash", "bf16",
                                  "int8", "", "x" * 300]), False


def gen_flags(rng: random.Random, i: int) -> dict[str, Any]:
    cmd = rng.choice(sorted(BASES))
    argv = list(BASES[cmd])
    bad_flags: dict[str, bool] = {}
    for _ in range(rng.randint(1, 3)):
        flag = rng.choice(sorted(FLAGS[cmd]))
        value, bad = _value(rng, FLAGS[cmd][flag])
        if flag in argv and flag != "--slow-link":
            argv[argv.index(flag) + 1] = value
            bad_flags[flag] = bad  # the last value given is the one that counts
        else:
            argv += [flag, value]
            bad_flags[flag] = bad_flags.get(flag, False) or bad
    invalid = any(bad_flags.values())
    if rng.random() < 0.5:
        argv.append("--json")
    files = {"fifo": {"fifo": True}, "link": {"symlink": "{tmp}/link-target"}}
    return {"id": f"gen-flags-{i}", "argv": argv, "files": files,
            "expect": "error" if invalid else "any"}


CHIP_FIELDS = {"mxu_flops_per_s": "rate", "hbm_bytes_per_s": "rate", "ici_link_bytes_per_s": "rate",
               "hbm_bytes": "rate", "ici_hop_latency_s": "lat", "op_overhead_s": "lat0",
               "ici_links_per_chip": "count", "mxu_efficiency": "eff", "name": "name",
               "max_pod_shape": "shape", "generation_rule": "rule"}
MODEL_FIELDS = {"num_layers": "count", "d_model": "dim", "num_heads": "heads",
                "num_kv_heads": "heads", "head_dim": "dim", "d_ff": "dim", "vocab_size": "dim",
                "mlp": "mlp", "name": "name", "tied_embeddings": "bool", "num_experts": "count0"}
BAD_YAML = [".nan", ".inf", "-.inf", "1:30", "9" * 40, "9" * 5000, "[1, 2]", "{a: 1}", "true",
            "null", "''", "-1", "1e-320", "!!python/object/apply:os.system ['true']", "*nope",
            "!!binary aGk=", "\"\\x00\"", "0x", "1_0_0_0e400"]


def _yaml_value(rng: random.Random, kind: str) -> tuple[str, bool]:
    if rng.random() < 0.45:
        v = rng.choice(BAD_YAML)
        if kind == "name":
            # Text is a fine name (YAML 1.2 reads these as strings); numbers, lists, nulls,
            # bytes, empty or unprintable text are not.
            return v, v not in ("1:30", "0x", "1_0_0_0e400")
        if kind == "lat0" and v == "1e-320":
            return v, False  # a tiny op overhead is in range
        if kind == "bool" and v == "true":
            return v, False
        return v, True
    good = {
        "rate": ["1.6e12", "4.5e10", "1e9", "16000000000"],
        "lat": ["1e-6", "2.0e-6", "0.001"], "lat0": ["0", "1e-6"],
        "count": ["1", "2", "4", "6"], "count0": ["0"], "eff": ["0.5", "1.0", "0.9"],
        "name": ["custom", "'2024-01-01'", "2024-01-01", "v5e-x", "'12'"],
        "shape": ["[16, 16]", "[4, 4, 4]", "16x16"], "rule": ["cube", "full-axis"],
        "dim": ["64", "128", "256"], "heads": ["4", "2", "1"],
        "mlp": ["swiglu", "gelu", "relu"], "bool": ["true", "false"],
    }[kind]
    return rng.choice(good), False


def _yaml_doc(rng: random.Random, fields: dict[str, str], head: str) -> tuple[str, bool]:
    lines = [head] if head else []
    invalid = False
    for key in rng.sample(sorted(fields), rng.randint(1, 3)):
        v, bad = _yaml_value(rng, fields[key])
        lines.append(f"{key}: {v}")
        invalid |= bad
    r = rng.random()
    if r < 0.1:
        lines.append("unknown_key: 1")
        invalid = True
    elif r < 0.15:
        lines.append("7: 1")
        invalid = True
    elif r < 0.2:
        lines = ["a: &a [1, 2]", "b: *a"] + lines
        invalid = True
    return "\n".join(lines) + "\n", invalid


def gen_chip_yaml(rng: random.Random, i: int) -> dict[str, Any]:
    text, invalid = _yaml_doc(rng, CHIP_FIELDS, "base: v5e")
    return {"id": f"gen-chip-{i}", "files": {"chip.yaml": text},
            "argv": ["collective", "--chip", "{tmp}/chip.yaml", "--shape", "4x4", "--op",
                     "all-reduce", "--axes", "x", "--bytes", "64KiB", "--json"],
            "expect": "error" if invalid else "any"}


def gen_model_yaml(rng: random.Random, i: int) -> dict[str, Any]:
    base = TINY_MODEL.splitlines()
    text, invalid = _yaml_doc(rng, MODEL_FIELDS, "")
    keys = {ln.split(":")[0] for ln in text.splitlines()}
    doc = "\n".join(ln for ln in base if ln.split(":")[0] not in keys) + "\n" + text
    cmd = rng.choice(["train", "decode"])
    argv = [a.replace("tiny.yaml", "m.yaml") for a in (TRAIN if cmd == "train" else DECODE)]
    return {"id": f"gen-model-{i}", "files": {"m.yaml": doc}, "argv": argv + ["--json"],
            "expect": "error" if invalid else "any"}


TRACE_RAW = ["NaN", "Infinity", "-1", "1e999", "9" * 400, "null", "true", "\"x\"", "{}",
             "[]", "[[1]]", "{\"a\": [1]}", "1e300", "0", "3", "[0]", "\"all-fold\""]


def gen_trace(rng: random.Random, i: int) -> dict[str, Any]:
    from fuzz_harness import base_trace

    doc = json.loads(base_trace())
    n_ops = len(doc["ops"])
    cols = doc["columns"]
    sets = []
    for _ in range(rng.randint(1, 3)):
        r = rng.random()
        if r < 0.7:
            path = f"ops/{rng.randrange(n_ops)}/{rng.choice(cols)}"
        elif r < 0.85:
            path = f"meta/{rng.choice(sorted(doc['meta']))}"
        else:
            path = rng.choice(["mesh/ici/fsdp", "version", "format", "columns", "ops", "mesh"])
        sets.append([path, rng.choice(TRACE_RAW)])
    extra = rng.choice([[], ["--json"], ["--out", "{tmp}/o"], ["--perfetto", "{tmp}/p.pftrace"],
                        ["--plots", "{tmp}/pl"]])
    return {"id": f"gen-trace-{i}", "files": {"s.trace": {"trace": {"set": sets}}},
            "argv": ["replay", "{tmp}/s.trace", *POD, *extra], "expect": "any"}


GENERATORS = {"flags": gen_flags, "chip_yaml": gen_chip_yaml, "model_yaml": gen_model_yaml,
              "trace": gen_trace}


def generate(rng: random.Random, i: int) -> dict[str, Any]:
    """One case from a surface picked at random (flags twice as often as each file kind)."""
    surface = rng.choice(["flags", "flags", "chip_yaml", "model_yaml", "trace"])
    return GENERATORS[surface](rng, i)
