"""Generated fuzz cases for the `tpusim` CLI, one generator per input surface (flags, chip YAML,
model YAML, trace files, output paths), driven by a `random.Random` so that the hypothesis
tests (`st.randoms()`) and `validation/fuzz_cli.py` (a seeded `Random`) share them.

Each case knows whether its input is surely invalid (`expect: "error"`: it must be refused with
one line, exit 2) or merely odd (`expect: "any"`: exit 0 with finite outputs, or a clean error).
"""

from __future__ import annotations

import json
import random
from typing import Any

from fuzz_harness import COLLECTIVE, DECODE, PLAN, POD, PREFILL, SWEEP, TINY_MODEL, TRAIN

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
    "plan": {"--global-batch": "int", "--seq-len": "int", "--top": "int", "--workers": "workers",
             "--max-tensor": "int", "--max-data": "int", "--max-pipeline": "int",
             "--max-sequence": "int", "--max-expert": "int", "--axes": "plan_list",
             "--remat": "plan_list", "--microbatches": "plan_list", "--param-dtype": "plan_list",
             "--optimizer-dtype": "plan_list", "--dask": "dask", "--out": "dir"},
}
# Flags added since the first fuzz pass, fuzzed on `train` (harden2).
FLAGS["train"].update({"--fsdp-gather": "text", "--capacity-factor": "float",
                       "--expert-skew": "float", "--set": "set", "--dp-allreduce": "text",
                       "--tp-comm": "text", "--axis-map": "axis_map", "--gather-dtype": "text"})
FLAGS["collective"].update({"--set": "set", "--mode": "cmode"})
# The newest surfaces (harden3): vocab tiling, sampling, all-to-all overlap, wraparound on the
# step commands, MoE capacity on decode, plan --exhaustive.
FLAGS["train"].update({"--vocab-tiling": "int", "--ep-alltoall": "ep", "--wraparound": "wrap"})
FLAGS["decode"].update({"--sampling": "sampling", "--wraparound": "wrap",
                        "--capacity-factor": "float"})
FLAGS["prefill"].update({"--sampling": "sampling"})
FLAGS["plan"].update({"--exhaustive": "switch", "--wraparound": "wrap"})
FLAGS["plan"].update({"--max-simulations": "int"})
FLAGS["train"].update({"--fsdp-grad": "text", "--dp-grad-split": "text"})
BASES = {"collective": COLLECTIVE, "train": TRAIN, "decode": DECODE, "prefill": PREFILL,
         "serve-sweep": SWEEP, "plan": PLAN,
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
    if kind == "workers":
        v = rng.choice(["1", "1", "2", "0", "-1", "257", "100000", "nan", "1e9", ""])
        return v, v not in ("1", "2", "0")
    if kind == "plan_list":
        v = rng.choice(["1,2", "full,none", "bf16", "fsdp,data", "", ",", "a,,b", "1,,2",
                        "x" * 300, "offload,qkv-offload", "0", "-1", "fp8,int8"])
        return v, v in ("", ",", "a,,b", "1,,2", "x" * 300)
    if kind == "dask":
        v = rng.choice(["tcp://127.0.0.1:1", "bogus", "", "x" * 3000, "http://h:1",
                        "tcp://[::1", "tcp://127.0.0.1:99999"])
        return v, True
    if kind == "set":
        return _set_value(rng)
    if kind == "switch":
        return "", False
    if kind in ("sampling", "ep", "wrap"):
        good, bad = {
            "sampling": (["top-k", "greedy"], ["", "beam", "TOP-K", "topk", "x" * 300, "1",
                                               "top-k,greedy"]),
            "ep": (["sync", "async"], ["", "bogus", "SYNC", "blocking", "sync,async"]),
            # The base pods are 2x2: two axes.
            "wrap": (["auto", "none", "all", "x", "y", "xy", "x,y", "X"],
                     ["z", "x,,y", "", ",", "x,x", "q", "auto,x", "x," * 3000]),
        }[kind]
        v = rng.choice(good + bad)
        return v, v in bad
    if kind == "axis_map":
        v = rng.choice(["fsdp=x+y", "fsdp=y+x", "fsdp=x:2+y:2", "fsdp=x", "fsdp=x,fsdp=y", "=x",
                        "fsdp=x:0", "fsdp=x:" + "9" * 40, "fsdp=q", "fsdp=x++y", "fsdp=z",
                        "tensor=x", "fsdp=x:" + "9" * 5000, ",", "fsdp=x,,"])
        return v, v not in ("fsdp=x+y", "fsdp=y+x", "fsdp=x:2+y:2", ",", "fsdp=x,,")
    if kind == "cmode":
        v = rng.choice(["auto", "full", "per-chip", "orbit", "", "AUTO"])
        return v, v not in ("auto", "full", "per-chip")
    return rng.choice(ODD_TEXT + ["auto", "ring", "full", "none", "all", "flash", "bf16",
                                  "int8", "", "x" * 300, "qkv-offload", "qkvo-offload",
                                  "mixed-async", "mixed-blocking", "windowed", "blocking",
                                  "async", "collective-matmul"]), False


# --set keys (chip, topology, collective and model fields) and values for them.
SET_KEYS = ["ici_link_bytes_per_s", "hbm_bytes", "hbm_bytes_per_s", "mxu_flops_per_s",
            "ici_hop_latency_s", "op_overhead_s", "mxu_efficiency", "ici_links_per_chip",
            "tensorcores_per_chip", "mxu_dim", "name", "max_pod_shape", "generation_rule",
            "topology.wraparound", "collective.algorithm", "model.num_layers", "model.d_model",
            "model.num_heads", "model.num_kv_heads", "model.d_ff", "model.mlp",
            "model.vocab_size", "model.num_experts", "model.experts_per_token",
            "model.tied_embeddings", "model.head_dim", "model.first_dense_layers", "nonsense",
            "model.nonsense", ""]
SET_BAD = ["x0", "x-1", "xnan", "xinf", "x1e400", "-1", "nan", "inf", "1e400", "", "xx2", "2x",
           "1_000", "x", "0x10", "9" * 400, "x" + "9" * 400]
SET_ODD = ["x2", "x0.5", "1", "0", "1e9", "16GB", "16GiB", "x1e-30", "x1e30", "true", "ring",
           "none", "swiglu", "3", "1.5", "x1.0000001", "v5e-x", "4x4"]


def _set_value(rng: random.Random) -> tuple[str, bool]:
    key = rng.choice(SET_KEYS)
    if rng.random() < 0.4:
        v = rng.choice(SET_BAD)
        # A text field takes any text; "" and unknown keys are surely invalid.
        bad = key in ("", "nonsense", "model.nonsense") or not (
            key in ("name", "model.name") and v not in ("",))
        return f"{key}={v}", bad
    v = rng.choice(SET_ODD)
    return f"{key}={v}", key in ("", "nonsense", "model.nonsense")


def gen_flags(rng: random.Random, i: int) -> dict[str, Any]:
    cmd = rng.choice(sorted(BASES))
    argv = list(BASES[cmd])
    bad_flags: dict[str, bool] = {}
    for _ in range(rng.randint(1, 3)):
        flag = rng.choice(sorted(FLAGS[cmd]))
        value, bad = _value(rng, FLAGS[cmd][flag])
        if FLAGS[cmd][flag] == "switch":
            argv.append(flag)  # a flag without a value (given twice is the same)
        elif flag in argv and flag != "--slow-link":
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


# Edits found by hand in hard10 (OP: the first collective op): an axis named twice (was an
# internal error), a send without a peer (was `tpusim collective`'s message), meta numbers and
# memory events of 1e308 (summed to infinity: an internal error writing --json).
TRACE_HAND = [("ops/OP/mesh_axes", '["fsdp", "fsdp"]'), ("ops/OP/collective", '"send"'),
              ("meta/memory_events", '[[0, "other", 1e308], [1, "other", 1e308]]'),
              ("meta/static_hbm_bytes", "1e308"), ("meta/static_breakdown",
                                                   '{"params": 1e308, "grads": 0, "optimizer": 0}'),
              ("meta/static_composition", '{"params": 1e308, "optimizer": 1e308}')]


def _first_collective(doc: dict[str, Any]) -> int:
    kind = doc["columns"].index("kind")
    return next(i for i, row in enumerate(doc["ops"]) if row[kind] == "collective")


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
        if rng.random() < 0.15:  # hard10: the edits found by hand, each a one-line error
            path, raw = rng.choice(TRACE_HAND)
            path = path.replace("OP", str(_first_collective(doc)))
            sets.append([path, raw])
            continue
        sets.append([path, rng.choice(TRACE_RAW)])
    extra = rng.choice([[], ["--json"], ["--out", "{tmp}/o"], ["--perfetto", "{tmp}/p.pftrace"],
                        ["--plots", "{tmp}/pl"]])
    return {"id": f"gen-trace-{i}", "files": {"s.trace": {"trace": {"set": sets}}},
            "argv": ["replay", "{tmp}/s.trace", *POD, *extra], "expect": "any"}


# -- study files (`tpusim sweep`) ---------------------------------------------------------------
STUDY_GOOD = {"bytes": ["1MiB", "64KiB", 1048576, "2MiB"], "chunks": [1, 2, 4],
              "algorithm": ["auto", "ring", "direct"], "wraparound": ["auto", "none"],
              "set.ici_link_bytes_per_s": ["x2", "x0.5", 4.5e10]}
STUDY_ODD = [-1, 0, "abc", "", "x" * 300, 1e9, True, False, "1,,2", 10**40]
STUDY_BAD = [None, [1], {"a": 1}, float("nan"), float("inf"), [], "NOLIST"]


STUDY_BAD_NAMES = [("chip", "v9z"), ("chip", 5), ("chip", ""), ("op", "all-reduse"), ("op", 5),
                   ("algorithm", "rign"), ("shape", ""), ("axes", "5"), ("axes", "x,w"),
                   ("slice", "v5p-7")]


def _study_list(rng: random.Random, key: str) -> tuple[Any, bool]:
    """(values for a grid/zip key, surely invalid)."""
    r = rng.random()
    if r < 0.15:
        v = rng.choice(STUDY_BAD)
        if v == "NOLIST":
            return rng.choice(STUDY_GOOD.get(key, ["1MiB"])), True
        return ([] if v == [] else [v]), True
    vals = [rng.choice(STUDY_GOOD.get(key, ["1MiB"])) for _ in range(rng.randint(1, 3))]
    if r < 0.35:
        vals.append(rng.choice(STUDY_ODD))
    return vals, False


def gen_study(rng: random.Random, i: int) -> dict[str, Any]:
    """A collective study (4x4 v5e, one to six points) with one to three varied keys, odd or
    invalid values, metrics and plots, and sometimes --resume over a corrupt results file."""
    invalid = False
    base: dict[str, Any] = {"chip": "v5e", "shape": "4x4", "op": "all-gather", "axes": "x"}
    keys = rng.sample(sorted(STUDY_GOOD), rng.randint(1, 2))
    grid = {}
    for k in keys:
        grid[k], bad = _study_list(rng, k)
        invalid |= bad
    doc: dict[str, Any] = {"command": "collective", "base": base, "grid": grid}
    r = rng.random()
    if r < 0.15:
        doc["zip"] = {"chunks": [1, 2], "algorithm": rng.choice([["auto", "ring"], ["auto"]])}
        invalid |= len(doc["zip"]["algorithm"]) != 2 or "chunks" in grid or "algorithm" in grid
    elif r < 0.25:
        doc[rng.choice(["bogus", "Grid", "points"])] = 1
        invalid = True
    elif r < 0.3:
        base[rng.choice(["out", "json", "perfetto", "nonsense"])] = "x"
        invalid = True
    elif r < 0.38:  # hard10: a name no point can take is a study error, not a row per point
        key, value = rng.choice(STUDY_BAD_NAMES)
        base[key] = value
        invalid = True
    if rng.random() < 0.3:
        doc["metrics"] = rng.choice([["time_s"], ["nope"], "time_s", [], [["x"]], ["latency_s"]])
        invalid |= doc["metrics"] in (["nope"], "time_s", [["x"]])
    if rng.random() < 0.3:
        x = rng.choice([keys[0], "nope"])
        y = rng.choice(["time_s", "nonsense", "algorithm"])
        doc["plot"] = rng.choice([{"x": x, "y": y}, [{"x": x, "y": y}], {"x": x}, 7])
        invalid |= x == "nope" or y == "nonsense" or not isinstance(doc["plot"], (dict, list)) \
            or "y" not in (doc["plot"] if isinstance(doc["plot"], dict) else doc["plot"][0])
    text = json.dumps(doc)
    name = "s.json"
    if rng.random() < 0.5:
        import yaml

        try:
            text, name = yaml.safe_dump(doc), "s.yaml"
        except yaml.YAMLError:  # pragma: no cover
            pass
        if rng.random() < 0.15:  # fuzz8: anchors and aliases, up to a billion-laughs bomb
            text = rng.choice([
                "x: &x [1MiB, 2MiB]\nbase_bytes: *x\n",
                "".join(f"l{k}: &l{k} [{', '.join([f'*l{k - 1}'] * 9) if k else 'lol'}]\n"
                        for k in range(10)),
                "grid: &g {bytes: [1MiB]}\nzip: *g\n",
                "base: &b\n  chip: v5e\nother: {<<: *b}\n",
            ]) + text
            invalid = True
    files: dict[str, Any] = {name: text}
    extra = []
    r = rng.random()
    if r < 0.1:
        extra = ["--resume"]
        files["o/results.parquet"] = rng.choice(["", "PAR1garbage", "x" * 100])
        invalid = True
    elif r < 0.15:
        files["o/results.parquet"] = "junk"
        invalid = True
    elif r < 0.25:
        w, bad = _value(rng, "workers")
        extra = ["--workers", w]
        invalid |= bad
    elif r < 0.3:
        extra = ["--dask", _value(rng, "dask")[0]]
        invalid = True
    argv = ["sweep", "{tmp}/" + name, "--out", "{tmp}/o"]
    if "--workers" not in extra:
        argv += ["--workers", "1"]
    return {"id": f"gen-study-{i}", "argv": argv + extra, "files": files,
            "expect": "error" if invalid else "any"}


# -- result files (`tpusim rerun`) -------------------------------------------------------------
RESULT_PATHS = ["inputs/command", "inputs/flags/bytes", "inputs/flags/axes", "inputs/flags/op",
                "inputs/flags/shape", "inputs/flags/chunks", "inputs/flags/slow_link",
                "inputs/chip/hbm_bytes", "inputs/chip/name", "inputs/chip/ici_link_bytes_per_s",
                "inputs/chip/max_pod_shape", "inputs/overrides", "inputs/flags", "inputs/chip",
                "inputs", "inputs/perturbations", "inputs/flags/nonsense", "time_s",
                "inputs/tpusim_version", "inputs/flags/set"]
RESULT_RAW = ["NaN", "-1", "1e999", "9" * 400, "null", "true", "\"x\"", "{}", "[]", "[[1]]",
              "{\"a\": [1]}", "0", "\"train\"", "\"rerun\"", "\"1e400\"", "\"\"",
              "\"all-gather\"", "\"4x4x4x4\"", "{\"hbm_bytes\": {\"given\": \"x2\"}}"]


# The fields of a step's result on a sliding-window model (harden3).
STEP_RESULT_PATHS = ["inputs/model/attention_window", "inputs/model/global_layer_period",
                     "inputs/model/post_norms", "inputs/model/qk_norm",
                     "inputs/model/num_layers", "inputs/flags/vocab-tiling",
                     "inputs/flags/sampling", "inputs/flags/ep-alltoall",
                     "inputs/flags/capacity-factor", "inputs/flags/axis-map",
                     "inputs/flags/wraparound", "inputs/perturbations/capacity_factor",
                     "inputs/flags/mesh", "inputs/training/vocab_tiling",
                     "inputs/decode/sampling", "inputs/mesh/placement"]
STEP_RESULT_RAW = ["0", "1", "2", "3", "16", "4096", "\"greedy\"", "\"top-k\"",
                   "\"async\"", "\"fsdp=x+y\"", "\"fsdp=x+x\"", "\"z\"", "\"x\"",
                   "1.25", "1e-300"]


def gen_result(rng: random.Random, i: int) -> dict[str, Any]:
    """`tpusim rerun` on a collective's --json result with one to three fields replaced, or
    (since harden3) a train or decode step's on a sliding-window model."""
    base = rng.choice(["collective", "collective", "train", "decode"])
    paths = RESULT_PATHS if base == "collective" else RESULT_PATHS[12:] + STEP_RESULT_PATHS
    raws = RESULT_RAW + ([] if base == "collective" else STEP_RESULT_RAW)
    sets = [[rng.choice(paths), rng.choice(raws)] for _ in range(rng.randint(1, 3))]
    return {"id": f"gen-result-{i}", "files": {"r.json": {"result": {"base": base,
                                                                      "set": sets}}},
            "argv": ["rerun", "{tmp}/r.json"] + (["--check"] if rng.random() < 0.3 else []),
            "expect": "any"}


# -- HLO text (`tpusim import-hlo`) ------------------------------------------------------------
HLO_TOKENS = ["0", "-1", "9" * 40, "1e400", "nan", "[]", "[-1]", "[999999999,999999999]", "}",
              "{", "(", ")", "%", "=", ",", "ROOT", "f32", "bf16[", "\x00", "é"]


def gen_hlo(rng: random.Random, i: int) -> dict[str, Any]:
    """import-hlo on a real compiled module (tests/fixtures/hlo) with one to four mutations:
    a line deleted, duplicated or cut, a number or shape replaced, a token inserted."""
    import re

    from fuzz_harness import base_hlo

    lines = base_hlo().split("\n")
    for _ in range(rng.randint(1, 4)):
        if not lines:  # an earlier cut or deletion left nothing (an empty file)
            break
        n = rng.randrange(len(lines))
        r = rng.random()
        if r < 0.2:
            del lines[n]
        elif r < 0.3:
            lines.insert(n, lines[n])
        elif r < 0.4:
            lines[n] = lines[n][: rng.randrange(len(lines[n]) + 1)]
        elif r < 0.75:
            nums = list(re.finditer(r"\d+", lines[n]))
            if nums:
                m = rng.choice(nums)
                lines[n] = lines[n][: m.start()] + rng.choice(HLO_TOKENS[:8]) + lines[n][m.end():]
        elif r < 0.9:
            k = rng.randrange(len(lines[n]) + 1)
            lines[n] = lines[n][:k] + rng.choice(HLO_TOKENS) + lines[n][k:]
        else:
            lines = lines[: n + 1]  # truncated file
    extra = rng.choice([[], ["--json"], ["-o", "{tmp}/t.trace"], ["--json", "-o", "{tmp}/t.trace"]])
    return {"id": f"gen-hlo-{i}", "files": {"p.txt": "\n".join(lines)},
            "argv": ["import-hlo", "{tmp}/p.txt", "--chip", "v5e", "--shape", "4x4", *extra],
            "expect": "any"}


# -- orbit mode: collectives on odd placements ---------------------------------------------------
def gen_orbit(rng: random.Random, i: int) -> dict[str, Any]:
    """A collective where groups interleave or lines do not wrap (orbit, full or per-chip mode),
    with Perfetto and --out outputs."""
    shape = rng.choice(["8x4", "4x4", "16x8", "4x4x4", "8x2", "2x2x2", "16x4"])
    ndim = shape.count("x") + 1
    axes = rng.choice(["x", "y", "x,y", "y,x", "x,y,z", "z", "x,dcn"][: 4 if ndim == 2 else 7])
    argv = ["collective", "--chip", rng.choice(["v5e", "v5p", "v4"]), "--shape", shape,
            "--wraparound", rng.choice(["none", "all", "auto", "x", "y"]),
            "--op", rng.choice(["all-gather", "reduce-scatter", "all-reduce", "all-to-all",
                                "collective-permute"]),
            "--axes", axes, "--bytes", rng.choice(["64KiB", "1MiB", "3MiB", "96KiB"]),
            "--algorithm", rng.choice(["auto", "auto", "ring", "direct", "multi-axis",
                                       "hierarchical", "line", "halving-doubling"])]
    if "dcn" in axes:
        argv += ["--slices", "2"]
    if rng.random() < 0.3:
        argv += ["--mode", rng.choice(["full", "per-chip"])]
    if rng.random() < 0.2:
        argv += ["--slow-link", rng.choice(["0,0:x+:0.5", "1,0:y-:0.25", "0,0,0:z+:0.5"])]
    argv += rng.choice([["--perfetto", "{tmp}/c.pftrace"], ["--json"], ["--out", "{tmp}/o"],
                        ["--perfetto", "{tmp}/c.json", "--json"]])
    if "--json" not in argv and rng.random() < 0.5:
        argv.append("--json")
    return {"id": f"gen-orbit-{i}", "argv": argv, "expect": "any"}


# -- sliding-window / Gemma model keys -----------------------------------------------------------
WINDOW_GOOD = ["1", "16", "64", "127", "128", "129", "4096", "16777216", "null"]
WINDOW_BAD = [".nan", ".inf", "-1", "0", "1.5", "'16'", "true", "[16]", "{a: 1}", "16777217",
              "9" * 40, "!!python/object/apply:os.system ['true']", "*nope", "1e-320"]
PERIOD_ODD = ["0", "0", "2", "2", "3", "6", "1", "5000"]  # valid or not depending on the rest
# (A quoted number is a number: model YAML takes text forms as `--set` does.)
PERIOD_BAD = ["-1", ".nan", "1.5", "true", "[2]", "4097"]
NORM_BAD = ["1", "0", "yes", "'true'", "null", "[true]", ".nan"]
SET_WINDOW = ["16", "x2", "x0.5", "null", "none", "0", "-1", "nan", "1.5", "", "abc",
              "9" * 40, "x1e300", "16777217"]


def gen_gemma(rng: random.Random, i: int) -> dict[str, Any]:
    """A model with sliding-window attention, a local/global pattern, post-norms and QK-norm
    (odd or invalid values), run by train, decode or prefill, with `--set model.*` on the
    same keys, odd sequence lengths, --vocab-tiling and --sampling."""
    invalid = False
    lines = [ln for ln in TINY_MODEL.splitlines() if not ln.startswith("num_layers")]
    lines.append(f"num_layers: {rng.choice([2, 4, 6])}")
    def pick(good: list[str], bad: list[str]) -> str:
        nonlocal invalid
        v = rng.choice(bad) if rng.random() < 0.2 else rng.choice(good)
        invalid |= v in bad
        return v

    if rng.random() < 0.8:
        lines.append(f"attention_window: {pick(WINDOW_GOOD, WINDOW_BAD)}")
    if rng.random() < 0.6:
        lines.append(f"global_layer_period: {pick(PERIOD_ODD, PERIOD_BAD)}")
    for key in ("post_norms", "qk_norm"):
        if rng.random() < 0.4:
            lines.append(f"{key}: {pick(['true', 'false'], NORM_BAD)}")
    if rng.random() < 0.1:
        lines.append("parallel_block: true")  # with post_norms: refused; alone: fine
    cmd = rng.choice(["train", "train", "decode", "prefill"])
    base = {"train": TRAIN, "decode": DECODE, "prefill": PREFILL}[cmd]
    argv = [a.replace("tiny.yaml", "g.yaml") for a in base]
    length = {"train": "--seq-len", "decode": "--context-len", "prefill": "--prompt-len"}[cmd]
    argv[argv.index(length) + 1] = rng.choice(["128", "1", "7", "4096", "100"])
    set_bad: dict[str, bool] = {}
    for _ in range(rng.choice([0, 0, 1, 2])):
        key = rng.choice(["attention_window", "global_layer_period", "post_norms", "qk_norm"])
        v = rng.choice(SET_WINDOW if key == "attention_window" else
                       ["0", "2", "1", "x2", "-1", "nan", "true", "false", "", "yes"])
        # A later --set of the same key replaces the earlier one.
        set_bad[key] = v in ("-1", "nan", "", "abc", "9" * 40, "1.5", "16777217", "yes") or (
            key in ("post_norms", "qk_norm") and v not in ("true", "false")) or (
            key == "attention_window" and v == "0")
        argv += ["--set", f"model.{key}={v}"]
    invalid |= any(set_bad.values())
    if cmd == "train" and rng.random() < 0.3:
        argv += ["--vocab-tiling", rng.choice(["1", "2", "3", "128", "4096"])]
    if cmd != "train" and rng.random() < 0.3:
        argv += ["--sampling", rng.choice(["top-k", "greedy"])]
    if cmd == "prefill" and rng.random() < 0.3:
        argv += ["--prefill-chunk", rng.choice(["1", "7", "16", "1000"])]
    return {"id": f"gen-gemma-{i}", "files": {"g.yaml": "\n".join(lines) + "\n"},
            "argv": argv + ["--json"], "expect": "error" if invalid else "any"}


# -- TPU all-reduce-scatter fusions (`import-hlo`) ------------------------------------------------
SCATTER_HEAD = "%all-reduce-scatter (input: bf16[8192,256]) -> bf16[2048,256] {"
# The fusion's all-reduce (its groups are written out on the same line) and its ROOT slice.
SCATTER_GROUPS = "replica_groups={{0,1,2,3},{4,5,6,7},{8,9,10,11},{12,13,14,15}}"
SCATTER_AR = ("%all-reduce.49 = bf16[8192,256]{1,0:T(8,128)(2,1)} all-reduce(%input), "
              "channel_id=162, " + SCATTER_GROUPS)
SCATTER_ROOT = ("ROOT %dynamic-slice.557 = bf16[2048,256]{1,0:T(8,128)(2,1)S(1)} "
                "dynamic-slice(%all-reduce.49, %multiply.310, %constant.2139), "
                "dynamic_slice_sizes={2048,256}")


def _groups(text: str) -> list[str]:
    return [SCATTER_AR, SCATTER_AR.replace(SCATTER_GROUPS, text)]


SCATTER_EDITS = [
    _groups("replica_groups={}"),
    _groups("replica_groups={" + ",".join(f"{{{d}}}" for d in range(16)) + "}"),
    _groups("replica_groups={{0,1,2},{3,4,5,6,7},{8,9,10,11},{12,13,14,15}}"),
    _groups("replica_groups={{0,1,2,3},{0,5,6,7},{8,9,10,11},{12,13,14,15}}"),
    _groups("replica_groups={{0,1,2,99}}"),
    _groups("replica_groups={{0,1,2," + "9" * 40 + "}}"),
    _groups("replica_groups={{0,1,2,3}}"),
    _groups("replica_groups=[4,4]<=[16]"),
    _groups("replica_groups=[4,4]<=[4,4]T(1,0)"),
    _groups("replica_groups=[4,5]<=[16]"),
    _groups("replica_groups=[999999999,999999999]<=[16]"),
    _groups("replica_groups={{" + ",".join(map(str, range(16))) + "}}"),
    [SCATTER_AR, SCATTER_AR.replace(", " + SCATTER_GROUPS, "")],
    [SCATTER_AR, SCATTER_AR.replace("bf16[8192,256]", "bf16[0,256]")],
    [SCATTER_AR, SCATTER_AR.replace("bf16[8192,256]", "bf16[" + "9" * 40 + ",256]")],
    [SCATTER_AR, SCATTER_AR.replace("all-reduce(%input)", "all-gather(%input)")],
    [SCATTER_AR, SCATTER_AR.replace("all-reduce(%input)", "all-reduce()")],
    [SCATTER_AR, SCATTER_AR.replace("all-reduce(%input)", "all-reduce(%all-reduce.49)")],
    [SCATTER_AR, SCATTER_AR.replace("bf16[8192,256]{1,0:T(8,128)(2,1)}", "bf16[]")],
    [SCATTER_AR, SCATTER_AR.replace("channel_id=162", "channel_id=" + "9" * 40)],
    [SCATTER_ROOT, SCATTER_ROOT.replace("[2048,256]", "[8192,256]").replace("{2048,256}",
                                                                             "{8192,256}")],
    [SCATTER_ROOT, SCATTER_ROOT.replace("[2048,256]", "[4096,256]")],
    [SCATTER_ROOT, SCATTER_ROOT.replace("[2048,256]", "[0,256]")],
    [SCATTER_ROOT, SCATTER_ROOT.replace("[2048,256]", "[999999999999,999999999]")],
    [SCATTER_ROOT, SCATTER_ROOT.replace("%all-reduce.49,", "%input,")],
    [SCATTER_ROOT, SCATTER_ROOT.replace("%all-reduce.49,", "%nope.1,")],
    [SCATTER_ROOT, SCATTER_ROOT.replace("dynamic_slice_sizes={2048,256}",
                                        "dynamic_slice_sizes={1,1}")],
    [SCATTER_ROOT, SCATTER_ROOT.replace("bf16[2048,256]", "(bf16[2048,256], f32[])")],
    [SCATTER_HEAD, SCATTER_HEAD[:-2]],
]


def gen_hlo_scatter(rng: random.Random, i: int) -> dict[str, Any]:
    """import-hlo (or replay) of a compiled fsdp x tensor step whose all-reduce-scatter fusion
    has one to three edits: its groups (empty, singletons, unequal, repeated, out of range,
    iota forms), the slice it keeps (all, half, none, huge, of another value, a tuple) and the
    all-reduce itself."""
    from fuzz_harness import HLO_SCATTER_FIXTURE

    edits = rng.sample(SCATTER_EDITS, rng.randint(1, 3))
    # At most one edit of each line (the all-reduce, the slice, the header).
    kept, seen = [], set()
    for old, new in edits:
        if old not in seen:
            kept.append([old, new])
            seen.add(old)
    cmd = rng.choice(["import-hlo", "import-hlo", "replay"])
    extra = rng.choice([[], ["--json"], ["-o", "{tmp}/t.trace"]]) if cmd == "import-hlo" \
        else ["--json"]
    return {"id": f"gen-hlo-scatter-{i}",
            "files": {"p.txt": {"hlo": {"fixture": HLO_SCATTER_FIXTURE, "replace": kept}}},
            "argv": [cmd, "{tmp}/p.txt", "--chip", "v5e", "--shape", "4x4", *extra],
            "expect": "any"}


# -- results.parquet of an interrupted study (`sweep --resume`) -----------------------------------
RESUME_VALUES = [None, 0, -1, 1, 1.5, float("inf"), float("-inf"), float("nan"), "", "x",
                 "x" * 5000, True, [1.0], {"a": 1}, 10**18, "64KiB", "4MiB", "boom"]
RESUME_COLUMNS = ["time_s", "error", "bytes", "command_line", "point", "chip", "shape",
                  "latency_s", "inputs.flags.bytes", "wall_time_s", "zzz", "result.bytes"]


# Entries of the record of a column's kind (`sim.studies.results.COLUMNS_ATTR`): valid ones for
# another kind, and malformed ones (None deletes the column's entry).
RECORD_ENTRIES = [None, ["num", True], ["text", True], ["bool", False], ["none", False],
                  ["num"], ["num", 1], ["float", True], [1, True], "num", {"num": True},
                  ["num", True, 0], [["num"], True]]


def gen_resume(rng: random.Random, i: int) -> dict[str, Any]:
    """`sweep --resume` over an edited results.parquet of a three-point study: cells set to odd
    or invalid values, columns dropped, rows cut or repeated (up to 30,000 rows); since fuzz8
    the record of its columns' kinds hand-edited, and the file cut short or a byte changed."""
    from fuzz_harness import STUDY

    edits: list[list[Any]] = []
    for _ in range(rng.randint(0, 3)):
        r = rng.random()
        if r < 0.6:
            edits.append(["set", rng.choice(RESUME_COLUMNS), rng.choice([None, 0, 1, 2, 5]),
                          rng.choice(RESUME_VALUES)])
        elif r < 0.75:
            edits.append(["drop", rng.choice(RESUME_COLUMNS)])
        elif r < 0.85:
            edits.append(["keep", rng.randint(0, 3)])
        elif r < 0.95:
            edits.append(["repeat", rng.choice([2, 3, 10000])])
        else:
            edits.append(["narrow", ["command_line", *rng.sample(RESUME_COLUMNS, 2)]])
    # fuzz8: the record of the columns' kinds hand-edited, and the file's bytes cut or changed.
    r = rng.random()
    if r < 0.2:
        edits.append(["record", rng.choice(RESUME_COLUMNS), rng.choice(RECORD_ENTRIES)])
    elif r < 0.3:
        edits.append(["record", rng.choice([None, 1, "x", [], {}, ["num", True], {"a": 1}])])
    elif r < 0.4:
        edits.append(["truncate", rng.choice([0.0, 0.001, 0.3, 0.5, 0.9, 0.999])])
    elif r < 0.5:
        edits.append(["flip", rng.random(), rng.randrange(256)])
    return {"id": f"gen-resume-{i}",
            "files": {"s.yaml": STUDY, "o/results.parquet": {"results": {"edit": edits}}},
            "argv": ["sweep", "{tmp}/s.yaml", "--out", "{tmp}/o", "--resume", "--workers", "1"],
            "expect": "any"}


# -- the eighth session's surfaces (fuzz8) --------------------------------------------------------
# Choice flags with their valid values and values that are surely invalid.
CHOICES = {
    "--optimizer": (["adam", "sgd"], ["", "ADAM", "adamw", "adam,sgd", "x" * 5000, "sgd "]),
    "--remat": (["none", "minimal", "full", "offload", "qkv-offload", "qkvo-offload"],
                ["", "FULL", "qkv_offload", "full,none", "offload-qkv", "x" * 5000]),
    "--fsdp-grad": (["reduce-scatter", "all-reduce", "auto"],
                    ["", "allreduce", "rs", "AUTO", "auto,all-reduce", "x" * 300]),
    "--fsdp-gather": (["async", "blocking", "windowed", "mixed-async", "mixed-blocking"],
                      ["", "mixed", "mixed-", "MIXED-ASYNC", "mixed-async,windowed", "x" * 300]),
    "--param-dtype": (["bf16", "fp32", "f32", "int8", "fp8", "BF16"], ["", "float", "bf17"]),
    "--grad-dtype": (["bf16", "fp32"], ["", "float", "fp64"]),
    "--optimizer-dtype": (["bf16", "fp32"], ["", "fp64", "x" * 300]),
    "--gather-dtype": (["bf16", "fp32", "fp8"], ["", "half", "bf16,fp32"]),
    "--pipeline-schedule": (["gpipe", "1f1b", "interleaved"], ["", "1F1B", "zb", "x" * 300]),
    "--tp-activations": (["sharded", "replicated"], ["", "SHARDED", "both"]),
    "--tp-comm": (["blocking", "collective-matmul"], ["", "async", "x" * 300]),
    "--dp-allreduce": (["async", "blocking"], ["", "sync"]),
    "--mode": (["auto", "per-chip"], ["", "full", "orbit", "AUTO"]),
    "--chip-variation": (["0", "0.01", "0.5", "1", "1e-9"],
                         ["nan", "inf", "-inf", "1e400", "-1", "2", "１", "0_1", "", "abc"]),
    "--seed": (["0", "1", "42", str(2**63 - 1)],
               ["-1", str(2**63), "-inf", "１", "1_0", "1.5", "", "9" * 40]),
    "--slow-chip": (["0,0:0.5", "1,1:2", "0,1:1e-6"],
                    ["0,0:0", "0,0:nan", "9,9:0.5", "０,0:0.5", "0,0:0_5", "0,0", "0,0:-1"]),
    "--slow-link": (["0,0:x+:0.5", "1,0:y-"], ["0,0:q+", "0,0:x+:0_5", "0,0:x+:inf", "0,0"]),
    "--dead-link": (["0,0:x+", "1,1:y-"], ["0,0:q+", "0,0", "9,9:x+", "0,0:x+:0.5"]),
    "--virtual-stages": (["1", "2"], ["0", "-1", "nan", "１", "9" * 40, "1.5"]),
    "--dp-grad-split": (["per-matrix", "per-layer"],
                        ["", "per_matrix", "PER-LAYER", "matrix", "per-matrix,per-layer"]),
}
# The train flags added in the last two sessions and the older ones no generator fuzzed.
TRAIN8 = ["--optimizer", "--remat", "--fsdp-grad", "--fsdp-gather", "--param-dtype",
          "--grad-dtype", "--optimizer-dtype", "--gather-dtype", "--pipeline-schedule",
          "--tp-activations", "--tp-comm", "--dp-allreduce", "--mode", "--chip-variation",
          "--seed", "--slow-chip", "--slow-link", "--dead-link", "--virtual-stages",
          "--dp-grad-split"]
TRAIN8_MESHES = ["fsdp=4", "fsdp=4", "data=2,fsdp=2", "tensor=2,fsdp=2", "pipeline=2,fsdp=2",
                 "pipeline=2,data=2"]
PLAN8 = {"--optimizer": "choice", "--grad-dtype": "plan_list", "--gather-dtype": "choice",
         "--param-dtype": "plan_list", "--remat": "plan_list", "--default-placement": "switch",
         "--exhaustive": "switch", "--max-simulations": "maxsim"}


def gen_train8(rng: random.Random, i: int) -> dict[str, Any]:
    """`train` with one to four of the flags added in the last two sessions (`--fsdp-grad`
    with its `auto`, the `mixed-*` gathers, `--optimizer`, every `--remat` form, the dtypes) and
    the older ones no generator fuzzed (pipeline schedules, perturbations, `--mode`), on a mesh
    with FSDP, data, tensor or pipeline axes, sometimes over two slices (`--dp-grad-split`);
    valid values may still be refused together."""
    argv = list(TRAIN)
    argv[argv.index("--mesh") + 1] = rng.choice(TRAIN8_MESHES)
    if rng.random() < 0.25:  # two slices: data over DCN (what --dp-grad-split splits)
        argv += ["--slices", "2", "--dcn", "data=2"]
    bad: dict[str, bool] = {}
    for flag in rng.sample(TRAIN8, rng.randint(1, 4)):
        good, wrong = CHOICES[flag]
        v = rng.choice(wrong) if rng.random() < 0.3 else rng.choice(good)
        argv += [flag, v]  # a dashed value (-inf, -1) is the flag's value too
        bad[flag] = v in wrong
    for sw in ("--no-overlap", "--no-fusion"):
        if rng.random() < 0.15:
            argv.append(sw)
    if rng.random() < 0.5:
        argv.append("--json")
    return {"id": f"gen-train8-{i}", "argv": argv,
            "expect": "error" if any(bad.values()) else "any"}


def gen_plan8(rng: random.Random, i: int) -> dict[str, Any]:
    """`plan` on the tiny model with its newer flags: `--optimizer`, `--grad-dtype`,
    `--gather-dtype`, `--default-placement`, and `--exhaustive` with `--max-simulations` (which
    is refused without it, and refuses a search larger than it before anything runs)."""
    argv = list(PLAN)
    bad = False
    for flag in rng.sample(sorted(PLAN8), rng.randint(1, 3)):
        kind = PLAN8[flag]
        if kind == "switch":
            argv.append(flag)
            continue
        if kind == "choice":
            good, wrong = CHOICES[flag]
            v = rng.choice(wrong) if rng.random() < 0.3 else rng.choice(good)
            bad |= v in wrong
        elif kind == "maxsim":
            v = rng.choice(["1", "2", "4", "100", "0", "-1", "nan", "１", "9" * 40, "1e3"])
            bad |= v in ("0", "-1", "nan", "１", "9" * 40, "1e3")
        else:
            v, b = _value(rng, "plan_list")
            bad |= b
        if flag in argv:
            argv[argv.index(flag) + 1] = v
        else:
            argv += [flag, v]
    if "--max-simulations" in argv and "--exhaustive" not in argv:
        bad = True  # it limits --exhaustive only
    return {"id": f"gen-plan8-{i}", "argv": argv + ["--json"],
            "expect": "error" if bad else "any"}


# Values that no numeric flag of any command takes.
NUMERIC_BAD = ["nan", "NaN", "inf", "-inf", "Infinity", "-nan", "1e400", "-1e400", "9" * 400,
               "-" + "9" * 400, "１", "1_0", "", " ", "0x10", "abc", "1e", "--"]


def _numeric_flags() -> dict[str, list[str]]:
    """{command: its number flags}, read off the parser (by their `type=`'s name)."""
    if not _NUMERIC:
        from sim.cli import build_parser

        sub = build_parser()._subparsers._group_actions[0].choices
        for cmd in NUMERIC_BASES:
            flags = [a.option_strings[-1] for a in sub[cmd]._actions if a.option_strings
                     and (getattr(a.type, "__name__", "") in ("integer", "number", "conv")
                          or a.option_strings[-1] in ("--bytes", "--workers"))]
            _NUMERIC[cmd] = sorted(flags)
    return _NUMERIC


_NUMERIC: dict[str, list[str]] = {}
NUMERIC_BASES = {
    "collective": COLLECTIVE, "compare-collectives": ["compare-collectives", *COLLECTIVE[1:]],
    "train": TRAIN, "decode": DECODE, "prefill": PREFILL, "serve-sweep": SWEEP, "plan": PLAN,
    "compile": ["compile", "--chips", "4", "--model", "{tmp}/tiny.yaml", "--seq-len", "128",
                "--batch-per-chip", "1", "--mesh", "fsdp=4", "-o", "{tmp}/t.trace"],
    "replay": ["replay", "{tmp}/s.trace", *POD],
    "import-hlo": ["import-hlo", "{tmp}/p.txt", "--chip", "v5e", "--shape", "4x4"],
}


def gen_numeric(rng: random.Random, i: int) -> dict[str, Any]:
    """A number flag of any command (found on the parser: every integer, number and float
    flag, `--bytes`, `--workers`) given NaN, an infinity, 1e400, 400 digits, a full-width or
    underscored digit, or no number at all: always refused, in one line."""
    cmd = rng.choice(sorted(NUMERIC_BASES))
    flag = rng.choice(_numeric_flags()[cmd])
    v = rng.choice(NUMERIC_BAD)
    argv = list(NUMERIC_BASES[cmd])
    if flag in argv:
        argv[argv.index(flag) + 1] = v
    else:
        argv += [flag, v]
    files = {"s.trace": {"trace": {"set": []}}, "p.txt": {"hlo": {"replace": []}}}
    return {"id": f"gen-numeric-{i}", "argv": argv, "files": files, "expect": "error"}


SCENARIO_VALUES = {
    "slow_chip": (["['0,0:0.5']", "[{chip: '1,1', factor: 0.5}]", "[]"],
                  ["['0,0:nan']", "['９,0:0.5']", "'0,0:0.5'", "[1]", "[{chip: '0,0'}]",
                   "[{chip: '0,0', factor: .inf}]", "['0,0:0_5']"]),
    "slow_link": (["['0,0:x+:0.5']", "[{chip: '0,0', link: y-, factor: 0.25}]"],
                  ["['0,0:q+']", "[{chip: '0,0', link: x+, factor: 0}]", "{a: 1}"]),
    "dead_link": (["['0,0:x+']", "[]"], ["['0,0']", "[[1, 2]]", "'x'"]),
    "chip_variation": (["0", "0.02", "1"], [".nan", ".inf", "-1", "2", "'0.1'", "true",
                                           "[0.1]", "1.0e400"]),
    "seed": (["0", "7", str(2**63 - 1)], ["-1", str(2**63), "1.5", "'3'", "true", "9" * 40]),
    "expert_skew": (["0"], [".nan", "-1", "101", "'1'"]),
    "capacity_factor": (["null"], ["0", "-1", ".inf", "1.0e7"]),
}


def gen_scenario(rng: random.Random, i: int) -> dict[str, Any]:
    """`--scenario FILE` (train on the tiny dense model, or replay): one to three keys with
    valid or invalid values, unknown keys, anchors and aliases, tags, a non-mapping document,
    and flags that add to the file or override it."""
    lines, bad = [], False
    for key in rng.sample(sorted(SCENARIO_VALUES), rng.randint(1, 3)):
        good, wrong = SCENARIO_VALUES[key]
        v = rng.choice(wrong) if rng.random() < 0.35 else rng.choice(good)
        bad |= v in wrong
        if key in ("expert_skew", "capacity_factor") and v not in ("0", "null"):
            bad = True  # on a dense model any router setting is refused
        lines.append(f"{key}: {v}")
    r = rng.random()
    if r < 0.08:
        lines.append("slow_chips: []")
        bad = True
    elif r < 0.14:
        lines = ["x: &x ['0,0:0.5']", "slow_chip: *x"]
        bad = True
    elif r < 0.18:
        lines = ["!!python/object/apply:os.system ['true']"]
        bad = True
    elif r < 0.22:
        lines = [rng.choice(["- 1", "7", "'text'", "[" * 40 + "1" + "]" * 40])]
        bad = True
    argv = list(TRAIN) if rng.random() < 0.7 else ["replay", "{tmp}/s.trace", *POD]
    argv += ["--scenario", "{tmp}/sc.yaml"]
    if rng.random() < 0.3:
        good, wrong = CHOICES["--seed"]
        v = rng.choice(good + wrong)
        argv += [f"--seed={v}"]
        bad |= v in wrong
    files = {"sc.yaml": "\n".join(lines) + "\n", "s.trace": {"trace": {"set": []}}}
    return {"id": f"gen-scenario-{i}", "argv": argv + ["--json"], "files": files,
            "expect": "error" if bad else "any"}


def gen_hlo_hostile(rng: random.Random, i: int) -> dict[str, Any]:
    """import-hlo on a hostile file: the real module cut at a random byte, bytes flipped to
    NUL or non-UTF-8, a 200,000-deep nest of brackets, a 10 MB line, a billion-element shape,
    200,000 empty computations, or a binary file."""
    from fuzz_harness import base_hlo

    text = base_hlo()
    r = rng.random()
    files: dict[str, Any]
    if r < 0.35:
        files = {"p.txt": text[: rng.randrange(len(text))]}
    elif r < 0.5:
        data = bytearray(text.encode("utf-8"))
        for _ in range(rng.randint(1, 20)):
            data[rng.randrange(len(data))] = rng.choice(b"\x00\xff\xc3{}()\n")
        files = {"p.txt": {"latin1": data.decode("latin-1")}}
    elif r < 0.6:
        depth = rng.choice([1000, 200_000])
        files = {"p.txt": {"parts": [["HloModule m\nENTRY %e () -> f32[] {\n  ROOT %r = ", 1],
                                     ["(", depth], [")", depth], ["\n}\n", 1]]}}
    elif r < 0.7:
        files = {"p.txt": {"parts": [["HloModule m\nENTRY %e () -> f32[] {\n  %x = f32[] ", 1],
                                     ["a", 10_000_000], ["\n}\n", 1]]}}
    elif r < 0.8:
        dims = rng.choice(["1000000000,1000000000", "9" * 40, "-5", "0,0,0,0,0,0,0,0,0,0"])
        files = {"p.txt": text.replace("f32[", f"f32[{dims},", 1)}
    elif r < 0.9:
        files = {"p.txt": {"parts": [["HloModule m\n", 1], ["%c () -> () {\n}\n", 200_000]]}}
    else:
        files = {"p.txt": {"latin1": "\x00\x01\x02\xff" * 4096}}
    extra = rng.choice([[], ["--json"], ["-o", "{tmp}/t.trace"]])
    return {"id": f"gen-hlo-hostile-{i}", "files": files,
            "argv": ["import-hlo", "{tmp}/p.txt", "--chip", "v5e", "--shape", "4x4", *extra],
            "expect": "any"}


# -- output paths and the Python API (hard10) ---------------------------------------------------
# (files, output path, surely invalid): where a step's output goes.
OUTPUT_TARGETS = [
    ({"a.out": {"symlink": "{tmp}/b.out"}, "b.out": {"symlink": "{tmp}/a.out"}}, "{tmp}/a.out",
     True),  # a loop of links (was replaced by a regular file)
    ({"l.out": {"symlink": "{tmp}/sub/real.out"}}, "{tmp}/l.out", False),  # dangling: created
    ({"pipe": {"fifo": True}, "l.out": {"symlink": "{tmp}/pipe"}}, "{tmp}/l.out", False),
    ({"d/x": "x"}, "{tmp}/d", None),  # a directory: a file output refuses it, --out takes it
    ({"f": "old"}, "{tmp}/f", None),  # an existing file: replaced by a file, refused as --out
    ({"f": "x"}, "{tmp}/f/child", True),  # under a file
    ({}, "/proc/tpusim-fuzz-out", True),  # a directory no one can write, root included
    ({}, "/proc/tpusim-fuzz-dir/x", True),
    ({}, "{tmp}/tiny.yaml", True),  # the --model file the step reads (was overwritten)
]


def gen_outputs(rng: random.Random, i: int) -> dict[str, Any]:
    """A step whose --perfetto, --out or --plots (or compile's -o) goes to a symlink loop, a
    dangling link, a link to a FIFO, a directory, an existing file, a path under a file,
    /proc (unwritable even for root) or the model file it reads."""
    files, path, invalid = rng.choice(OUTPUT_TARGETS)
    flag = rng.choice(["--perfetto", "--out", "--plots", "-o"])
    if flag == "-o":
        argv = ["compile", "--chips", "4", "--model", "{tmp}/tiny.yaml", "--seq-len", "128",
                "--batch-per-chip", "1", "--mesh", "fsdp=4", "-o", path]
    else:
        argv = [*TRAIN, flag, path]
    if invalid is None:  # a directory or an existing file: right for one kind of output only
        is_dir = path.endswith("/d")
        invalid = is_dir != (flag in ("--out", "--plots"))
    return {"id": f"gen-outputs-{i}", "argv": argv, "files": dict(files),
            "expect": "error" if invalid else "any"}


# Python values a notebook might pass by mistake, JSON-encoded for the corpus (`api_value`
# decodes the {"$...": ...} forms).
API_ODD = [None, float("nan"), float("inf"), -1, 0, 10**40, 2**63, 1.5, True, [1], {"a": 1}, "",
           " ", "１", "1e400", [None], [[1]], {"$bytes": "x"}, {"$tuple": [1, 2]},
           {"$object": None}, {"$set": []}, {"$complex": [1, 2]}]
API_BASE = {
    "train": {"chip": "v5e", "shape": "2x2", "model": "{tmp}/tiny.yaml", "seq_len": 128,
              "batch_per_chip": 1, "mesh": "fsdp=4"},
    "decode": {"chip": "v5e", "shape": "2x2", "model": "{tmp}/tiny.yaml", "batch": 4,
               "context_len": 128, "mesh": "tensor=4"},
    "collective": {"chip": "v5e", "shape": "4x4", "op": "all-gather", "axes": "x",
                   "bytes": "1MiB"},
    "sweep": {"study": {"command": "collective",
                        "base": {"chip": "v5e", "shape": "2x2", "op": "all-reduce", "axes": "x"},
                        "grid": {"bytes": ["1MiB", "2MiB"]}}},
    "plan": {"chip": "v5e", "shape": "2x2", "model": "{tmp}/tiny.yaml", "seq_len": 128,
             "global_batch": 4, "axes": ["data", "fsdp"], "remat": ["full"],
             "microbatches": [1]},
    "rerun": {"result": "{tmp}/r.json"},
}
API_KEYS = {"train": ["seed", "seq_len", "microbatches", "no_overlap", "slow_link", "set", "mesh",
                      "remat", "chip_variation", "dcn", "axis_map"],
            "decode": ["batch", "kv_dtype", "set", "mesh", "seed"],
            "collective": ["bytes", "axes", "op", "chunks", "slow_link", "set"],
            "sweep": ["study", "workers", "dask", "out", "resume", "quiet"],
            "plan": ["overrides", "out", "dask", "top", "workers", "seq_len"],
            "rerun": ["result"]}
API_MESHES = [{"fsdp=2,tensor": 2}, {"fsdp": 4.0}, {"fsdp": True}, {1: 4}, {"fsdp": "4"},
              {"fsdp": "2,tensor=2"}, {"fsdp": -4}, {}]
API_RESULTS = {"deep": "[" * 100_000 + "]" * 100_000, "nan": '{"inputs": NaN}',
               "digits": '{"inputs": ' + "9" * 5000 + "}", "list": "[1, 2]", "empty": ""}


def gen_api(rng: random.Random, i: int) -> dict[str, Any]:
    """A Python API call (`sim.train`, `sim.decode`, `sim.collective`, `sim.sweep`, `sim.plan`,
    `sim.rerun`) with one or two keywords given an odd Python value: None, NaN, huge ints,
    bytes, tuples, sets, objects, wrong containers; mesh dicts with mesh syntax in a key or a
    size; rerun of files too deep, with NaN or 5,000 digits. Run in-process by the harness
    (`fuzz_harness.run_api`); a wrong type must be one TpusimError line naming the call."""
    fn = rng.choice(sorted(API_BASE))
    kwargs = json.loads(json.dumps(API_BASE[fn]))
    files: dict[str, Any] = {}
    invalid = False
    if fn == "rerun":
        kind = rng.choice(sorted(API_RESULTS) + ["dir", "missing"])
        if kind == "dir":
            files["r.json/x"] = "x"
        elif kind != "missing":
            files["r.json"] = API_RESULTS[kind]
        invalid = True
    else:
        for key in rng.sample(API_KEYS[fn], rng.randint(1, 2)):
            value = rng.choice(API_MESHES) if key == "mesh" and rng.random() < 0.5 \
                else rng.choice(API_ODD)
            if key == "mesh" and isinstance(value, dict) and value and \
                    not any(k.startswith("$") for k in map(str, value)):
                value = {"$dict": [[k, v] for k, v in value.items()]}  # int keys survive JSON
            kwargs[key] = value
            # Surely wrong: a Python type no flag takes (bytes, tuple, set, object, complex).
            invalid |= isinstance(value, dict) and any(
                k in value for k in ("$bytes", "$tuple", "$object", "$set", "$complex")) \
                and key not in ("set", "overrides")
    return {"id": f"gen-api-{i}", "argv": ["api", fn], "api": {"fn": fn, "kwargs": kwargs},
            "files": files, "expect": "error" if invalid else "any"}


GENERATORS = {"flags": gen_flags, "chip_yaml": gen_chip_yaml, "model_yaml": gen_model_yaml,
              "trace": gen_trace, "study": gen_study, "result": gen_result, "hlo": gen_hlo,
              "orbit": gen_orbit, "gemma": gen_gemma, "hlo_scatter": gen_hlo_scatter,
              "resume": gen_resume, "train8": gen_train8, "plan8": gen_plan8,
              "numeric": gen_numeric, "scenario": gen_scenario, "hlo_hostile": gen_hlo_hostile,
              "outputs": gen_outputs, "api": gen_api}


def generate(rng: random.Random, i: int) -> dict[str, Any]:
    """One case from a surface picked at random (`SURFACES`: flags twice as often as each file
    kind)."""
    surface = rng.choice(SURFACES)
    return GENERATORS[surface](rng, i)


# Each generator's share of `generate`'s draws (flags and train8 twice; issue 30's four new
# surfaces twice, as the least fuzzed).
SURFACES = ["flags", "flags", "chip_yaml", "model_yaml", "trace", "study", "result", "hlo",
            "orbit", "gemma", "hlo_scatter", "resume", "train8", "train8", "plan8", "numeric",
            "scenario", "hlo_hostile", "outputs", "api", "hlo_module", "hlo_module",
            "step_study", "step_study", "chakra", "chakra", "serve_trace", "serve_trace",
            "chakra_export"]


# -- issue 30: generated HLO modules, step studies, Chakra sets, serving traces ------------------
HLO_DTYPES = ["bf16", "f32", "s32", "f16", "s8", "u32", "pred", "f8e4m3fn", "c64", "token"]
HLO_DIMS = [1, 2, 4, 16, 128, 256, 1024, 3, 7, 0, 1 << 20, 1 << 31, 10 ** 12]
HLO_GROUPS = ["{{0,1,2,3},{4,5,6,7},{8,9,10,11},{12,13,14,15}}", "[4,4]<=[16]",
              "[4,4]<=[4,4]T(1,0)", "{}", "[2,8]<=[16]", "{{0,1},{2,3}}", "{{0,0,1,2}}",
              "{{0,1,2,99}}", "[16,1]<=[16]", "[1,1000000000]<=[1000000000]", "{{0}}",
              "{{" + ",".join(map(str, range(16))) + "}}", "[3,5]<=[15]", "{{-1,2}}"]
HLO_TRIPS = ["4", "1", "0", "16", "1000000000", "-1", "\"x\"", "4.5", "99999999999999999999"]


def _hlo_shape(rng: random.Random, bad: bool) -> tuple[str, list[int]]:
    dtype = rng.choice(HLO_DTYPES[:5] if not bad else HLO_DTYPES)
    rank = rng.randint(0, 3)
    dims = [rng.choice(HLO_DIMS[:7] if not bad else HLO_DIMS) for _ in range(rank)]
    return f"{dtype}[{','.join(map(str, dims))}]", dims


def gen_hlo_module(rng: random.Random, i: int) -> dict[str, Any]:
    """An HLO module written from scratch (not an edit of a compiled one): a few parameters,
    elementwise ops, dots (contracting dims in or past the rank), reductions, fusions calling
    generated computations, every collective with explicit, iota and empty replica groups (in
    and out of range), permute pairs, while loops with known trip counts from 0 to a billion,
    conditionals, custom calls, async start/done pairs and unknown opcodes; sometimes for
    another device count, with an undefined operand, a name twice, no ROOT or no ENTRY.
    `import-hlo` or `replay` on a v5e 4x4 (16 chips)."""
    bad = rng.random() < 0.35  # odd dtypes and dims
    parts = 16 if rng.random() < 0.85 else rng.choice([1, 4, 8, 15, 17, 0, 10 ** 9])
    invalid = parts != 16
    head = [f"HloModule gen{i}, num_partitions={parts}", "",
            "%add (a: f32[], b: f32[]) -> f32[] {", "  %a = f32[] parameter(0)",
            "  %b = f32[] parameter(1)", "  ROOT %s = f32[] add(%a, %b)", "}", ""]
    comps: list[str] = []
    lines: list[str] = []
    values: list[tuple[str, str]] = []  # (name, shape)
    n_params = rng.randint(1, 3)
    sig = []
    for p in range(n_params):
        shape, _ = _hlo_shape(rng, bad)
        lines.append(f"  %p{p} = {shape} parameter({p})")
        values.append((f"%p{p}", shape))
        sig.append(f"p{p}: {shape}")
    channel = 1
    for k in range(rng.randint(1, 8)):
        name = f"%v{k}"
        src, shape = rng.choice(values)
        r = rng.random()
        if r < 0.2:
            op = rng.choice(["add", "multiply", "maximum", "subtract"])
            other = rng.choice(values)[0]
            lines.append(f"  {name} = {shape} {op}({src}, {other})")
        elif r < 0.3:
            op = rng.choice(["exponential", "negate", "convert", "copy", "tanh", "frobnicate"])
            lines.append(f"  {name} = {shape} {op}({src})")
        elif r < 0.42:
            m, kk, n = (rng.choice(HLO_DIMS[:7]) for _ in range(3))
            cd = rng.choice(["1", "1", "0", "5", "1,1"])
            lines.append(f"  {name}.a = bf16[{m},{kk}] broadcast({src}), dimensions={{}}")
            lines.append(f"  {name}.b = bf16[{kk},{n}] broadcast({src}), dimensions={{}}")
            lines.append(f"  {name} = bf16[{m},{n}] dot({name}.a, {name}.b), "
                         f"lhs_contracting_dims={{{cd}}}, rhs_contracting_dims={{0}}")
            shape = f"bf16[{m},{n}]"
            invalid |= cd == "5"  # past the rank
        elif r < 0.62:
            kind = rng.choice(["all-gather", "all-reduce", "reduce-scatter", "all-to-all",
                               "collective-permute", "all-reduce-start"])
            groups = rng.choice(HLO_GROUPS)
            attrs = f"channel_id={channel}"
            channel += 1
            if kind == "collective-permute":
                pairs = rng.choice(["{{0,1},{1,2},{2,3},{3,0}}", "{{0,1},{0,2}}", "{}",
                                    "{{0,99}}", "{{5,5}}"])
                attrs += f", source_target_pairs={pairs}"
                invalid |= pairs in ("{{0,1},{0,2}}", "{{0,99}}")
            else:
                attrs += f", replica_groups={groups}"
                if kind in ("all-gather", "reduce-scatter", "all-to-all"):
                    attrs += f", dimensions={{{rng.choice(['0', '0', '1', '7'])}}}"
                if kind in ("all-reduce", "reduce-scatter", "all-reduce-start"):
                    attrs += ", to_apply=%add"
                invalid |= groups in ("{{0,0,1,2}}", "{{0,1,2,99}}", "{{-1,2}}",
                                      "[1,1000000000]<=[1000000000]")
            lines.append(f"  {name} = {shape} {kind}({src}), {attrs}")
            if kind == "all-reduce-start" and rng.random() < 0.8:
                values.append((name, shape))
                name = f"%v{k}d"
                lines.append(f"  {name} = {shape} all-reduce-done(%v{k})")
        elif r < 0.72:
            fc = f"%fused.{k}"
            comps += [f"{fc} (q: {shape}) -> {shape} {{", f"  %q = {shape} parameter(0)",
                      f"  ROOT %e = {shape} exponential(%q)", "}", ""]
            lines.append(f"  {name} = {shape} fusion({src}), kind=kLoop, calls={fc}")
        elif r < 0.84:
            trip = rng.choice(HLO_TRIPS)
            cond, body = f"%cond.{k}", f"%body.{k}"
            t = f"(s32[], {shape})"
            comps += [f"{cond} (t: {t}) -> pred[] {{", f"  %t = {t} parameter(0)",
                      "  %i = s32[] get-tuple-element(%t), index=0", "  %n = s32[] constant(4)",
                      "  ROOT %lt = pred[] compare(%i, %n), direction=LT", "}", "",
                      f"{body} (t: {t}) -> {t} {{", f"  %t = {t} parameter(0)",
                      "  %i = s32[] get-tuple-element(%t), index=0",
                      f"  %x = {shape} get-tuple-element(%t), index=1",
                      "  %one = s32[] constant(1)", "  %j = s32[] add(%i, %one)",
                      f"  %y = {shape} " + rng.choice(["exponential(%x)", "copy(%x)"]),
                      f"  ROOT %o = {t} tuple(%j, %y)", "}", ""]
            lines.append(f"  {name}.z = s32[] constant(0)")
            lines.append(f"  {name}.i = {t} tuple({name}.z, {src})")
            lines.append(f"  {name}.w = {t} while({name}.i), condition={cond}, body={body}, "
                         f"backend_config={{\"known_trip_count\":{{\"n\":\"{trip}\"}}}}")
            lines.append(f"  {name} = {shape} get-tuple-element({name}.w), index=1")
        elif r < 0.92:
            target = rng.choice(["Sharding", "tpu_custom_call", "x"])
            lines.append(f"  {name} = {shape} custom-call({src}), "
                         f"custom_call_target=\"{target}\"")
        else:
            lines.append(f"  {name} = {shape} reduce({src}, %p0), dimensions={{0}}, "
                         f"to_apply=%add")
        values.append((name, shape))
    root_name, root_shape = values[-1]
    lines.append(f"  ROOT %root = {root_shape} copy({root_name})")
    entry = [f"ENTRY %main ({', '.join(sig)}) -> {root_shape} {{", *lines, "}"]
    r = rng.random()
    if r < 0.06:
        entry.insert(2, "  %ghost = f32[4] add(%nope, %nope)")  # an undefined operand
        invalid = True
    elif r < 0.1:
        entry.insert(2, entry[1])  # a name twice
        invalid = True
    elif r < 0.13:
        entry = [ln.replace("ROOT ", "") for ln in entry]
    elif r < 0.16:
        entry[0] = entry[0].replace("ENTRY ", "")  # XLA's parser then takes the last one
    text = "\n".join(head + comps + entry) + "\n"
    if rng.random() < 0.2:  # XLA's placement comment line, sometimes wrong
        coords = rng.choice([" ".join(f"{c % 4},{c // 4}" for c in range(16)), "0,0 0,0",
                             " ".join(f"{c},0" for c in range(16)), ""])
        text = f"// tpusim: partition_coords={coords}\n" + text
        invalid |= coords != " ".join(f"{c % 4},{c // 4}" for c in range(16))
    cmd = rng.choice(["import-hlo", "import-hlo", "replay"])
    extra = rng.choice([[], ["--json"], ["-o", "{tmp}/t.trace"]]) if cmd == "import-hlo" \
        else rng.choice([["--json"], ["--perfetto", "{tmp}/p.pftrace"], ["--json"]])
    return {"id": f"gen-hlo-module-{i}", "files": {"m.hlo.txt": text},
            "argv": [cmd, "{tmp}/m.hlo.txt", "--chip", "v5e", "--shape", "4x4", *extra],
            "expect": "error" if invalid else "any"}


# Step studies: train and decode points on the tiny model (2x2 v5e), values odd or invalid.
STEP_STUDY = {
    "train": ({"chip": "v5e", "shape": "2x2", "model": "tiny.yaml", "seq-len": 128,
               "batch-per-chip": 1, "mesh": "fsdp=4"},
              {"mesh": (["fsdp=4", "data=2,fsdp=2", "tensor=4", "fsdp=2,tensor=2"],
                        ["fsdp=3", "fsdp=x", "bogus=4", "", "fsdp=4,fsdp=1"]),
               "remat": (["full", "none", "minimal", "offload"], ["ful", "", "x" * 300]),
               "seq-len": ([64, 128, 256, "128"], [0, -1, "abc", 10 ** 12, 1.5]),
               "batch-per-chip": ([1, 2, 0.5], [0, -1, "x"]),
               "microbatches": ([1, 2], [0, -2]),
               "set.model.num_layers": ([1, 2, 4, "x2"], [0, -1, "x0"]),
               "set.hbm_bytes": (["16GiB", 1e3, "x0.001"], [-1, "lots"]),
               "attention": (["dot", "flash"], ["flsh"]),
               "slow-chip": (["0,0:0.5", "1,1:0.8"], ["9,9:0.5", "0,0:0"])}),
    "decode": ({"chip": "v5e", "shape": "2x2", "model": "tiny.yaml", "batch": 4,
                "context-len": 128, "mesh": "tensor=4"},
               {"batch": ([1, 4, 64], [0, -1, "x"]),
                "context-len": ([16, 128, 4096], [0, "abc"]),
                "kv-dtype": (["bf16", "int8", "fp8"], ["int3", ""]),
                "mesh": (["tensor=4", "tensor=2,data=2"], ["tensor=3"]),
                "sampling": (["greedy", "top-k"], ["beam"])}),
}


# Wrong values that only the pod or the model makes wrong: a failed row, not a study error.
# (An empty mesh is a mesh of size 1 everywhere: one chip, which a 4-chip pod does not fit.)
POD_DEPENDENT = ("fsdp=3", "tensor=3", "9,9:0.5", 10 ** 12)


def gen_step_study(rng: random.Random, i: int) -> dict[str, Any]:
    """A `tpusim sweep` of train or decode points (one to six) on the tiny model: grids and
    zips of meshes, remat, lengths, batches, `set.` keys and perturbations with valid, odd and
    invalid values; metrics of train and decode results (some unknown); plots with a hue, over
    a key not varied, or of a text metric; `--allow-oom`, `--resume` and `--workers`."""
    cmd = rng.choice(["train", "train", "decode"])
    base_tmpl, keys = STEP_STUDY[cmd]
    base = dict(base_tmpl)
    invalid = False
    grid: dict[str, Any] = {}
    for key in rng.sample(sorted(keys), rng.randint(1, 2)):
        good, wrong = keys[key]
        vals = [rng.choice(good) for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.25:
            vals.append(rng.choice(wrong))
            # A value the command can never take is refused before anything runs; what depends
            # on the pod (a mesh that does not fit, a slow chip off the pod) is a failed row.
            invalid |= vals[-1] not in POD_DEPENDENT and (key, vals[-1]) != ("mesh", "")
        grid[key] = list(dict.fromkeys(map(json.dumps, vals)))
        grid[key] = [json.loads(v) for v in grid[key]]
    doc: dict[str, Any] = {"command": cmd, "base": base, "grid": grid}
    metrics = {"train": ["step_time_s", "mfu", "hbm_peak_bytes", "exposed_comm_s"],
               "decode": ["step_time_s", "tokens_per_s", "hbm_peak_bytes"]}[cmd]
    if rng.random() < 0.4:
        doc["metrics"] = rng.sample(metrics, rng.randint(1, 2)) + (
            ["no_such_metric"] if rng.random() < 0.15 else [])
        invalid |= "no_such_metric" in doc["metrics"]
    if rng.random() < 0.4:
        x = next(iter(grid))
        y = rng.choice(metrics + ["fits_in_hbm", "status"])
        plot: dict[str, Any] = {"x": x, "y": y}
        if len(grid) > 1 and rng.random() < 0.5:
            plot["hue"] = list(grid)[1]
        if rng.random() < 0.1:
            plot["x"] = "not-varied"
            invalid = True
        doc["plot"] = plot
    text = json.dumps(doc)  # the model path is relative: the run starts in {tmp}
    files: dict[str, Any] = {"s.json": text}
    argv = ["sweep", "{tmp}/s.json", "--out", "{tmp}/o", "--workers", "1"]
    r = rng.random()
    if r < 0.2:
        argv.append("--allow-oom")
    elif r < 0.3:
        argv.append("--resume")
        files["o/results.parquet"] = rng.choice(["", "PAR1", "x" * 64])
        invalid = True
    return {"id": f"gen-step-study-{i}", "argv": argv, "files": files,
            "expect": "error" if invalid else "any"}


def _chakra_bytes(rng: random.Random, ranks: int, corrupt: bool) -> list[bytes]:
    from workloads.chakra.wire import (
        CommType,
        GlobalMetadata,
        IOInfo,
        Node,
        NodeType,
        bool_list_attr,
        coll_node,
        comp_node,
        encode_file,
        int64_attr,
        p2p_node,
    )

    out = []
    n = rng.randint(1, 6)
    kinds = [rng.choice(["comp", "coll", "coll", "send"]) for _ in range(n)]
    sizes = [rng.choice([0, 1, 4096, 1 << 20, 3, (1 << 40), -1 if corrupt else 8])
             for _ in range(n)]
    comm = [rng.choice(list(CommType)) for _ in range(n)]
    dims = [rng.choice([None, None, [True], [True, False], [False, True], [False, False],
                        [True, True, False, True, False], [], "int" if corrupt else None])
            for _ in range(n)]
    pgs = [rng.choice([None, None, "", "0", "1", "2" if corrupt else "1"]) for _ in range(n)]
    groups = rng.choice(['[{"pg_name": "1", "ranks": []}]', '[{"pg_name": "1", "ranks": [0, 1]}]',
                         '[{"pg_name": "1", "ranks": [0, 9]}]' if corrupt else "[]", None])
    # Ranks running different programs: sends and receives paired between neighbours (a
    # pipeline's shape), and collectives whose sizes differ between ranks.
    paired, skew = rng.random() < 0.4, rng.random() < 0.25
    for r in range(ranks):
        nodes = []
        if groups is not None:
            nodes.append(Node(id=n + 5, name="process_group:init", type=NodeType.METADATA_NODE,
                              inputs=IOInfo(values=f"[[{groups}]]")))
        for k in range(n):
            deps = []
            if k and rng.random() < 0.6:
                deps = [rng.choice([k - 1, 0, k + 1 if corrupt else 0, 99 if corrupt else 0])]
            try:
                if kinds[k] == "comp":
                    nodes.append(comp_node(k, f"op{k}", duration_micros=rng.choice([0, 5, 10 ** 6]),
                                           num_ops=rng.choice([None, 1000, 10 ** 12]),
                                           tensor_size=rng.choice([None, 4096]),
                                           data_deps=deps))
                elif kinds[k] == "coll":
                    extra = {}
                    if dims[k] is not None:  # ASTRA-sim's per-dimension flags, or not a list
                        extra["involved_dim"] = int64_attr(1) if dims[k] == "int" else \
                            bool_list_attr(dims[k])
                    size = sizes[k] * (1 + r % 2) if skew else sizes[k]  # uneven loads
                    nodes.append(coll_node(k, f"c{k}", comm[k], size, data_deps=deps,
                                           pg_name=pgs[k], **extra))
                elif paired:  # even ranks send to the next, odd ones receive from the previous
                    send = r % 2 == 0
                    src, dst = (r, (r + 1) % ranks) if send else ((r - 1) % ranks, r)
                    nodes.append(p2p_node(k, f"p{k}", send=send, src=src, dst=dst,
                                          tag=k if rng.random() < 0.9 else k + 1,
                                          comm_size=max(sizes[k], 0), data_deps=deps))
                else:
                    peer = (r + 1) % ranks if rng.random() < 0.9 else ranks + 3
                    nodes.append(p2p_node(k, f"p{k}", send=r % 2 == 0, src=r, dst=peer,
                                          tag=k, comm_size=max(sizes[k], 0), data_deps=deps))
            except (ValueError, OverflowError, TypeError):
                nodes.append(comp_node(k, f"op{k}"))
        try:
            data = encode_file(GlobalMetadata(version=rng.choice(["0.0.4", "", "9.9"])), nodes)
        except (ValueError, OverflowError, TypeError):
            data = b"\x00"
        if corrupt and rng.random() < 0.5:
            data = bytearray(data)
            at = rng.randrange(len(data)) if data else 0
            if rng.random() < 0.5:
                del data[at:]
            elif data:
                data[at] = rng.randrange(256)
            data = bytes(data)
        out.append(data)
    return out


def gen_chakra(rng: random.Random, i: int) -> dict[str, Any]:
    """A Chakra execution-trace set built with tpusim's own writer: one to six nodes per rank
    (compute with and without durations and FLOP counts, every collective type, sends and
    receives (paired between neighbours or not), sizes from 0 to 1 TiB (the same on every rank
    or not), involved_dim flags, process groups named and defined or
    not), dependencies back, forward, missing or on itself, a rank
    count that fits the 2x2 pod or not, odd versions, files cut short or with a byte changed,
    gzipped or not, given as PREFIX, directory or one file, sometimes with a communicator-group
    file. `import-chakra` or `replay`."""
    import gzip

    corrupt = rng.random() < 0.35
    ranks = rng.choice([4, 4, 4, 1, 2, 3, 8])
    blobs = _chakra_bytes(rng, ranks, corrupt)
    gz = rng.random() < 0.25
    files = {}
    for r, data in enumerate(blobs):
        name = f"c/et.{r}.et" + (".gz" if gz else "")
        files[name] = {"latin1": (gzip.compress(data, mtime=0) if gz else data).decode("latin-1")}
    target = rng.choice(["{tmp}/c/et", "{tmp}/c", "{tmp}/c/et.0.et" + (".gz" if gz else "")])
    if rng.random() < 0.5:
        argv = ["import-chakra", target] + rng.choice([[], ["--json"]])
    else:
        argv = ["replay", target, "--chip", "v5e", "--shape", "2x2",
                "--chakra-compute", rng.choice(["roofline", "recorded"])] + rng.choice(
            [[], ["--json"], ["--perfetto", "{tmp}/p.pftrace"]])
    if rng.random() < 0.2:  # ASTRA-sim's communicator-group file, odd or not
        files["groups.json"] = rng.choice([
            '{"1": [0, 1], "2": [2, 3]}', '{"1": [0, 1], "2": [2, 3]}', '{"1": [0, 1, 2, 3]}',
            '{"0": [0, 1, 2, 3]}', '{"1": [0, 1, 2, 3, 4, 5]}',
            '{"x": [0]}', '{"1": []}', '{"1": [0, 0]}', "[]", "{", '{"1": [true]}',
            '{"1": [0, 1e400]}', '{"' + "9" * 40 + '": [0]}', "[" * 3000])
        argv += ["--chakra-comm-group", "{tmp}/groups.json"]
    return {"id": f"gen-chakra-{i}", "files": files, "argv": argv, "expect": "any"}


_EXPORTS: dict[tuple[bool, bool], tuple[tuple[str, bytes], ...]] = {}


def _tpusim_chakra(every_chip: bool, pipeline: bool = False) -> tuple[tuple[str, bytes], ...]:
    """A small training step's Chakra export on a v5e 2x2: one layer at fsdp=2 x tensor=2, or
    two layers in two pipeline stages (pipeline=2 x fsdp=2, two microbatches: a program per
    stage, sends and receives between them); per chip, or per class; made once per process."""
    key = (every_chip, pipeline)
    if key not in _EXPORTS:
        import sim
        from sim.export.chakra import plan_chakra

        if pipeline:
            run = sim.train(chip="v5e", shape="2x2", model="llama3-8b", seq_len=128,
                            batch_per_chip=1, mesh="pipeline=2,fsdp=2", microbatches=2,
                            set={"model.num_layers": 2})
        else:
            run = sim.train(chip="v5e", shape="2x2", model="llama3-8b", seq_len=128,
                            batch_per_chip=1, mesh="fsdp=2,tensor=2",
                            set={"model.num_layers": 1})
        _EXPORTS[key] = plan_chakra(run.trace, run.result, every_chip=every_chip).files
    return _EXPORTS[key]


def _odd_attr(rng: random.Random):
    from workloads.chakra.wire import Attr, Member

    member = rng.choice(list(Member))
    pick = {Member.STRING: ["", "x", "[", "[1,2]", "{}", "[[]]", "null", "9" * 30, '["a"]',
                            "[0,0,0]", "[[0,1],[1,0]]"],
            Member.BOOL: [True, False], Member.BYTES: [b"", b"\xff"],
            Member.DOUBLE: [0.0, -1.0, 1e300], Member.FLOAT: [0.5, -2.0]}.get(
        member, [0, 1, 3, 4, 7, -1, 1 << 31, (1 << 62)])
    if member in (Member.UINT32, Member.UINT64, Member.FIXED32, Member.FIXED64):
        pick = [v for v in pick if v >= 0]
    if member in (Member.INT32, Member.SINT32, Member.SFIXED32, Member.UINT32, Member.FIXED32):
        pick = [v for v in pick if -(1 << 31) <= v < (1 << 31)] or [0]
    if rng.random() < 0.3:
        return Attr(member, tuple(rng.choice(pick) for _ in range(rng.randint(0, 4))), True)
    return Attr(member, rng.choice(pick))


def _mutated_export(rng: random.Random, files) -> dict[str, bytes]:
    """One to three edits of a tpusim-written set: an attribute of the metadata or of a node
    given another member or value (tpusim_op, tpusim_num_chips, comm_size, pg_name, ...), a
    dependency added (back, forward, to itself or to no node), a node or a rank's file dropped,
    tpusim's metadata taken off (the Chakra fields alone are replayed) or a byte changed."""
    import dataclasses

    from workloads.chakra.wire import decode_metadata, decode_node, encode_file, records

    decoded = {}
    for name, data in files:
        spans = list(records(data))
        decoded[name] = [decode_metadata(data, *spans[0]),
                         [decode_node(data, a, b) for a, b in spans[1:]]]
    names = sorted(decoded)
    raw: dict[str, bytes] = {}
    for _ in range(rng.randint(1, 3)):
        name = rng.choice(names)
        meta, nodes = decoded[name]
        what = rng.choice(["meta", "attr", "attr", "dep", "drop", "plain", "rank", "byte"])
        if what == "meta" and meta.attrs:
            key = rng.choice(sorted(meta.attrs))
            meta.attrs[key] = _odd_attr(rng)
        elif what == "attr" and nodes:
            k = rng.randrange(len(nodes))
            attrs = dict(nodes[k].attrs)
            key = rng.choice(sorted(attrs) + ["comm_size", "pg_name", "comm_dst", "comm_type",
                                              "involved_dim"])
            attrs[key] = _odd_attr(rng)
            nodes[k] = dataclasses.replace(nodes[k], attrs=attrs)
        elif what == "dep" and nodes:
            k = rng.randrange(len(nodes))
            to = rng.choice([nodes[k].id, nodes[-1].id, nodes[0].id, 10 ** 9])
            nodes[k] = dataclasses.replace(nodes[k], data_deps=(*nodes[k].data_deps, to))
        elif what == "drop" and len(nodes) > 1:
            del nodes[rng.randrange(len(nodes))]
        elif what == "plain":
            for other in names:
                decoded[other][0].attrs.pop("tpusim_format", None)
        elif what == "rank" and len(names) > 1:
            names.remove(name)
            del decoded[name]
        elif what == "byte":
            raw[name] = b""
    out = {}
    for name in names:
        meta, nodes = decoded[name]
        try:
            data = encode_file(meta, nodes)
        except (ValueError, OverflowError, TypeError):
            data = b"\x00"
        if name in raw and data:
            data = bytearray(data)
            data[rng.randrange(len(data))] = rng.randrange(256)
            data = bytes(data)
        out[name] = data
    return out


def gen_chakra_export(rng: random.Random, i: int) -> dict[str, Any]:
    """A set tpusim exported (`--chakra DIR`, per chip or per class, one program or a pipeline's
    stages) and then edited (`_mutated_export`), replayed on the 2x2 it came from or
    imported."""
    files = _mutated_export(rng, _tpusim_chakra(rng.random() < 0.6, rng.random() < 0.4))
    case_files = {f"c/{n}": {"latin1": d.decode("latin-1")} for n, d in files.items()}
    if rng.random() < 0.25:
        argv = ["import-chakra", "{tmp}/c"] + rng.choice([[], ["--json"]])
    else:
        argv = ["replay", "{tmp}/c", "--chip", "v5e",
                "--shape", "2x4" if rng.random() < 0.1 else "2x2",
                "--chakra-compute", rng.choice(["roofline", "recorded"])] + rng.choice(
            [[], ["--json"], ["--slow-link", "0,0:x+:0.5"], ["--mode", "per-chip"]])
    return {"id": f"gen-chakra-export-{i}", "files": case_files, "argv": argv, "expect": "any"}


TRACE_CELLS = ["0", "0.5", "1e-3", "-1", "nan", "inf", "", "abc", "1e400", "9" * 40, "1.5",
               "10", "16", "1000000", "0x10", "１", "null"]


def gen_serve_trace(rng: random.Random, i: int) -> dict[str, Any]:
    """`tpusim serve --arrival trace --trace FILE` on the tiny model (2x2 v5e, tensor=4) with
    a generated CSV or JSON-lines trace: zero to a few hundred requests, arrivals out of order or
    negative, lengths 0, huge, fractional, text, NaN; missing or extra columns, a prefix id,
    blank lines, a BOM, quoted fields, and sometimes `--requests`, `--duration` or `--json`."""
    rows = []
    n = rng.choice([0, 1, 3, 8, 40, 300])
    t = 0.0
    invalid = n == 0
    bad_tail = False
    for _ in range(n):
        t += rng.choice([0.0, 0.001, 0.01, 0.1])
        arrival, prompt, output = f"{t:.4f}", str(rng.choice([8, 32, 64, 128])), \
            str(rng.choice([1, 4, 16]))
        if rng.random() < 0.1:
            cell = rng.choice(TRACE_CELLS)
            col = rng.randrange(3)
            arrival, prompt, output = [cell if c == col else v
                                       for c, v in enumerate((arrival, prompt, output))]
        rows.append((arrival, prompt, output))
    kind = rng.choice(["csv", "csv", "jsonl"])
    prefix = rng.random() < 0.2
    if kind == "csv":
        cols = ["arrival_s", "prompt_tokens", "output_tokens"] + (["prefix_id"] if prefix else [])
        r = rng.random()
        if r < 0.1:
            cols = cols[:2]
            invalid = True
        elif r < 0.15:
            cols = cols + ["extra"]
        lines = [",".join(cols)]
        for k, row in enumerate(rows):
            vals = list(row) + ([str(k % 3)] if prefix else [])
            if "extra" in cols:
                vals.append("x")
            lines.append(",".join(vals[: len(cols)]))
        text = "\n".join(lines) + "\n"
        if rng.random() < 0.1:
            text = "\ufeff" + text
        if rng.random() < 0.1:
            text = text.replace("\n", "\n\n")
        name = "t.csv"
    else:
        lines = []
        for k, (a, p, o) in enumerate(rows):
            obj = {"arrival_s": a, "prompt_tokens": p, "output_tokens": o}
            raw = json.dumps(obj)
            for key in ("arrival_s", "prompt_tokens", "output_tokens"):
                v = obj[key]
                if v.replace(".", "", 1).replace("e-", "", 1).isdigit():
                    raw = raw.replace(f'"{key}": "{v}"', f'"{key}": {v}')
            if prefix:
                raw = raw[:-1] + f', "prefix_id": {k % 3}}}'
            lines.append(raw)
        if rng.random() < 0.1:
            lines.append(rng.choice(["[1, 2]", "{", "null", "\"x\""]))
            bad_tail = True  # read only if the run asks for more requests than the rows before
        text = "\n".join(lines) + ("\n" if lines else "")
        name = "t.jsonl"
    argv = ["serve", "--chip", "v5e", "--shape", "2x2", "--model", "{tmp}/tiny.yaml", "--mesh",
            "tensor=4", "--arrival", "trace", "--trace", "{tmp}/" + name]
    limit = None
    if rng.random() < 0.3:
        argv += ["--requests", rng.choice(["1", "2", "100", "0", "-1"])]
        invalid |= argv[-1] in ("0", "-1")
        limit = int(argv[-1])
    # The trace is streamed: with `--requests N` the reader stops after N requests, so a bad
    # last line after at least N rows is never read.
    invalid |= bad_tail and not (limit is not None and 0 < limit <= n)
    if rng.random() < 0.2:
        argv += ["--duration", rng.choice(["0.01", "1", "0", "nan"])]
        invalid |= argv[-1] in ("0", "nan")
    if rng.random() < 0.5:
        argv.append("--json")
    return {"id": f"gen-serve-trace-{i}", "files": {name: text}, "argv": argv,
            "expect": "error" if invalid else "any"}


GENERATORS.update({"hlo_module": gen_hlo_module, "step_study": gen_step_study,
                   "chakra": gen_chakra, "serve_trace": gen_serve_trace,
                   "chakra_export": gen_chakra_export})
