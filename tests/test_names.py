"""Unknown names suggest the nearest valid ones (at most five, by similarity) on one short line,
wherever a name is looked up: chips, models, slices, `--set` keys, collective algorithms, ops,
remat policies, mesh axes, commands and argparse choices, chip / model / scenario / study keys
(issue 30: `--set ici_link_bytes=x2` printed a 1,016-character line of every key)."""

from __future__ import annotations

import pytest

from sim.cli import main
from topologies.validate import nearest_names, one_of

COLL = ["collective", "--chip", "v5e", "--shape", "4x4", "--op", "all-gather", "--axes", "x",
        "--bytes", "1MiB"]
TRAIN = ["train", "--chip", "v5e", "--shape", "2x2", "--model", "llama3-8b", "--seq-len", "128",
         "--batch-per-chip", "1", "--mesh", "fsdp=4"]


def test_one_of_lists_five_or_fewer_choices_whole():
    assert one_of("q", ["a", "b", "c"]) == "use one of: a, b, c"
    assert one_of("q", list("abcde")) == "use one of: a, b, c, d, e"


def test_one_of_suggests_the_nearest_five_of_a_long_list_and_counts_them():
    names = [f"name_{i}" for i in range(40)] + ["hbm_bytes_per_s"]
    assert one_of("hbm_bytes_per", names, listing="X lists them") == \
        "did you mean hbm_bytes_per_s? (41 in all; X lists them)"
    far = one_of("zzzz", names)
    assert far.startswith("the nearest are ") and far.endswith("(41 in all)")
    assert len(far.split(" are ", 1)[1].split("(")[0].split(",")) == 5


def test_nearest_names_ignore_case_and_keep_the_choices_spelling():
    assert nearest_names("V5E", ["v5e", "v5p", "v4"], n=1) == ["v5e"]
    assert nearest_names("TENSOR", ["tensor", "fsdp"], n=1) == ["tensor"]


CASES = {
    "chip": ([*COLL[:2], "v5z", *COLL[3:]], "unknown chip 'v5z'; did you mean v5p or v5e?"),
    "model": ([*TRAIN[:6], "llama3-8c", *TRAIN[7:]], "did you mean llama3-8b"),
    "slice": (["collective", "--slice", "v5q-16", *COLL[5:]], "did you mean v5p-16"),
    "set key": ([*COLL, "--set", "ici_link_bytes=x2"],
                "--set ici_link_bytes is not a key tpusim knows; did you mean "
                "ici_link_bytes_per_s"),
    "model set key": ([*TRAIN, "--set", "model.num_layer=2"], "did you mean model.num_layers"),
    "algorithm": ([*COLL, "--algorithm", "rign"],
                  "unknown collective algorithm 'rign'; did you mean ring?"),
    "op": ([*COLL[:6], "all-gathr", *COLL[7:]], "unknown --op 'all-gathr'; did you mean "
                                                 "all-gather"),
    "remat": ([*TRAIN, "--remat", "ful"], "--remat 'ful' is not a remat policy; did you mean "
                                          "full?"),
    "mesh axis": ([*TRAIN[:-1], "fsdq=4"], "mesh axis 'fsdq' is unknown; did you mean fsdp"),
    "command": (["trian"], "unknown command 'trian'; did you mean train?"),
    "choice": ([*COLL, "--mode", "fulll"], "unknown --mode 'fulll'; use one of: auto, "
                                           "symmetric, full, per-chip"),
    "chip key": (["collective", "--chip", "{tmp}/c.yaml", *COLL[3:]],
                 "unknown key(s) hbm_byte; did you mean hbm_bytes"),
    "model key": ([*TRAIN[:6], "{tmp}/m.yaml", *TRAIN[7:]],
                  "unknown key(s) num_layer; did you mean num_layers"),
    "scenario key": ([*TRAIN, "--scenario", "{tmp}/s.yaml"],
                     "unknown key(s) slow_chips; did you mean slow_chip"),
    "study key": (["sweep", "{tmp}/study.yaml", "--out", "{tmp}/o"],
                  "key 'byts' is not a flag of `tpusim collective`; did you mean bytes"),
}
FILES = {"c.yaml": "base: v5e\nhbm_byte: 1\n", "m.yaml": "base: llama3-8b\nnum_layer: 2\n",
         "s.yaml": "slow_chips: ['0,0:0.5']\n",
         "study.yaml": "command: collective\nbase: {chip: v5e, shape: 2x2, op: all-gather, "
                       "axes: x}\ngrid: {byts: [1MiB]}\n"}


@pytest.mark.parametrize("case", CASES)
def test_every_unknown_name_is_one_short_line_with_at_most_five_suggestions(case, tmp_path,
                                                                           capsys):
    argv, expected = CASES[case]
    for name, text in FILES.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    rc = main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("tpusim: error: "), err
    assert expected in err, err
    assert len(err) < 300, err
    # At most five names suggested: the list after "did you mean" / "the nearest are".
    for lead in ("did you mean ", "the nearest are ", "use one of: "):
        if lead in err:
            names = err.split(lead, 1)[1].split("?")[0].split(" (")[0]
            assert len(names.replace(" or ", ", ").split(", ")) <= 5, names
