"""How an error names a setting: by its Python argument in the library (`str(exc)`), by its
flag on the command line (the CLI renders the same error with its parser's spelling)."""

from __future__ import annotations

import pickle

import pytest

import sim
from sim.cli import main
from sim.cli.common import Parser, flag_spelling
from sim.runs import TrainRequest
from topologies.errors import TpusimError
from topologies.validate import FlagError, int_flag, split_list

_TRAIN = dict(chip="v5e", shape="2x2", model="llama3-8b", seq_len=128, batch_per_chip=1,
              mesh="fsdp=4")
_TRAIN_ARGV = ["train", "--chip", "v5e", "--shape", "2x2", "--model", "llama3-8b",
               "--batch-per-chip", "1", "--mesh", "fsdp=4"]


def test_an_error_names_its_settings_by_python_name_and_renders_any_spelling():
    exc = TpusimError("{seq_len} 0 is out of range; {dead_link} {x}: see {'a': 1}",
                      "seq_len", "dead_link")
    assert str(exc) == "seq_len 0 is out of range; dead_link {x}: see {'a': 1}"
    assert exc.render(lambda n: f"<{n}>") == \
        "<seq_len> 0 is out of range; <dead_link> {x}: see {'a': 1}"
    assert exc.template.startswith("{seq_len} 0") and exc.params == ("seq_len", "dead_link")
    # A plain message is text, braces and all; an error pickles with its names.
    assert str(TpusimError("bad {seq_len}")) == "bad {seq_len}"
    back = pickle.loads(pickle.dumps(FlagError("{seq_len} 0", "seq_len")))
    assert type(back) is FlagError and back.params == ("seq_len",) and str(back) == "seq_len 0"


def test_a_wrapping_error_keeps_the_names_of_the_one_it_wraps():
    inner = TpusimError("{batch} 0 is out of range", "batch")
    outer = TpusimError(f"point 3: {inner.template} (see {{help}})", *inner.params, "help")
    assert str(outer) == "point 3: batch 0 is out of range (see help)"
    assert outer.render(lambda n: "--" + n) == "point 3: --batch 0 is out of range (see --help)"


def test_the_cli_spells_a_name_as_its_parsers_option_for_that_dest():
    p = Parser(prog="t")
    p.add_argument("--quiet", dest="quiet_sub", action="store_true")
    sub = p.add_subparsers(dest="command", parser_class=Parser)
    cmd = sub.add_parser("run")
    cmd.add_argument("-o", "--output-file", dest="out")
    cmd.add_argument("--seq-len", type=int_flag("seq_len", hi=10))
    spell = flag_spelling(p, "run")
    assert spell("out") == "--output-file" and spell("quiet_sub") == "--quiet"
    # No argument has that dest: the name with dashes.
    assert spell("dead_link") == "--dead-link"
    # A converter's error, through the parser, names the flag.
    with pytest.raises(TpusimError, match=r"^--seq-len 11 is out of range; give a whole "):
        p.parse_args(["run", "--seq-len", "11"])
    # A validator given other text than a Python name says that text as is.
    with pytest.raises(TpusimError, match="^the list 'a,,b' has an empty item"):
        split_list("a,,b", "the list")


def test_a_python_caller_reads_the_argument_it_passed_and_the_cli_reads_the_flag(capsys):
    with pytest.raises(TpusimError) as exc:
        TrainRequest(**{**_TRAIN, "seq_len": 0})
    assert str(exc.value).startswith("seq_len 0 is out of range; give a whole number in [1, ")
    assert "--" not in str(exc.value)
    with pytest.raises(TpusimError, match="^seq_len 0 is out of range"):
        sim.train(**{**_TRAIN, "seq_len": 0})
    assert main([*_TRAIN_ARGV, "--seq-len", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tpusim: error: --seq-len 0 is out of range; give a whole number in [1,")
