"""The typed run layer (`sim/runs/`): every front end builds the same frozen request, `sim.run`
runs it, and a result's `inputs` rebuild it."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest

import sim
from sim.cli import build_parser, main, request_from_argv
from sim.cli.common import flag_specs
from sim.runs import REQUESTS, TrainRequest
from sim.runs.requests import CompileRequest, PlanRequest, flag_name
from sim.runs.rerun import request_from_result
from topologies.errors import TpusimError

POD = ["--chip", "v5e", "--shape", "2x2"]
TRAIN = ["train", *POD, "--model", "llama3-8b", "--seq-len", "256", "--batch-per-chip", "1",
         "--mesh", "fsdp=2,tensor=2", "--set", "model.num_layers=2"]


def _commands():
    return build_parser().get_default("commands")


@pytest.mark.parametrize("cls", [*REQUESTS.values(), CompileRequest, PlanRequest],
                         ids=lambda c: c.COMMAND)
def test_every_request_has_its_commands_settings_in_its_order_with_its_defaults(cls):
    sub = _commands()[cls.COMMAND]
    # Every setting flag of the command (not the output flags), in --help order.
    cli_flags = [name for name, _dest, _kind in flag_specs(sub)]
    assert [flag_name(n) for n in cls.FLAGS] == cli_flags
    # The same defaults: a request built with no settings is what an empty command line gives.
    fields = {f.name: f for f in dataclasses.fields(cls)}
    dests = {name: dest for name, dest, _kind in flag_specs(sub)}
    for name in cls.FLAGS:
        want = sub.get_default(dests[flag_name(name)])
        got = fields[name].default
        if name == "overrides":
            assert got == () and want == []
        elif isinstance(want, list):
            assert got == tuple(want), name
        else:
            assert got == want, name
    assert cls.SET_SCOPE == sub.get_default("set_scope")


def test_the_typed_request_gives_the_commands_json_byte_for_byte(capsys):
    assert main([*TRAIN, "--json"]) == 0
    cli_text = capsys.readouterr().out
    req = TrainRequest(chip="v5e", shape="2x2", model="llama3-8b", seq_len=256,
                       batch_per_chip=1, mesh={"fsdp": 2, "tensor": 2},
                       overrides={"model.num_layers": 2})
    assert req == request_from_argv(TRAIN)
    run = sim.run(req)
    assert json.dumps(run.to_dict(), indent=2) + "\n" == cli_text
    assert sim.train(req).to_dict() == run.to_dict()
    # A what-if is a replaced request; the recorded inputs rebuild the request that ran.
    fast = sim.run(req.replace(overrides={"model.num_layers": 2, "ici_link_bytes_per_s": "x2"}))
    assert fast.inputs["chip"]["ici_link_bytes_per_s"] == 2 * run.inputs["chip"][
        "ici_link_bytes_per_s"]
    again = request_from_result(run.to_dict())
    assert again.flags() == req.flags()
    assert sim.run(again).to_dict() == run.to_dict()


def test_requests_are_frozen_checked_and_travel_to_workers():
    req = TrainRequest(slice="v5p-128", model="llama3-70b", seq_len="8192", batch_per_chip=2,
                       mesh="fsdp=16,tensor=4", slow_link=["0,0,0:x+:0.5"])
    assert req.seq_len == 8192 and req.batch_per_chip == 2.0 and req.slow_link == ("0,0,0:x+:0.5",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.seq_len = 1  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(req)) == req
    with pytest.raises(TpusimError, match="^seq_len 0 is out of range"):
        TrainRequest(seq_len=0)
    with pytest.raises(TpusimError, match=r"sim.train\(\) needs model, seq_len, batch_per_chip"):
        sim.train(mesh="fsdp=4")
    with pytest.raises(TpusimError, match="takes a request or keywords, not both"):
        sim.train(req, seq_len=4)
    with pytest.raises(TpusimError, match="takes a TrainRequest"):
        sim.train(sim.DecodeRequest(model="llama3-8b"))
    with pytest.raises(TpusimError, match="takes a request"):
        sim.run({"command": "train"})


_TRAIN_KW = dict(chip="v5e", shape="2x2", model="llama3-8b", seq_len=128, batch_per_chip=1,
                 mesh="fsdp=4")


@pytest.mark.parametrize("change,says", [
    ({"seq_len": [128]}, "TrainRequest(seq_len=[128]): seq_len takes one number or text"),
    ({"no_overlap": 1}, "TrainRequest(no_overlap=1): no_overlap takes True or False"),
    ({"slow_link": [None]}, "TrainRequest(slow_link=[None]): slow_link takes a list of values"),
    ({"overrides": [1, 2]}, "TrainRequest(overrides=[1, 2]): overrides takes a dict"),
    ({"chip": 5}, "TrainRequest(chip=5): chip takes a chip preset name"),
    ({"model_spec": "llama3-8b"}, "model_spec takes a TransformerSpec"),
    ({"bogus": 1}, "TrainRequest() has no field(s) bogus; "),
    ({"seq_len": 128.5}, "seq_len '128.5' is not a whole number"),
])
def test_a_request_given_a_wrong_typed_field_is_a_one_line_tpusim_error(change, says):
    from sim.runs.requests import TrainRequest

    with pytest.raises(TpusimError) as err:
        TrainRequest(**{**_TRAIN_KW, **change})
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_request_given_a_positional_argument_is_a_one_line_tpusim_error():
    from sim.runs.requests import CollectiveRequest, TrainRequest

    for cls in (TrainRequest, CollectiveRequest):
        with pytest.raises(TpusimError, match=rf"^{cls.__name__}\(\) takes its settings as "
                                              r"keywords, got 1 positional argument"):
            cls("v5e")


def test_a_request_takes_none_as_a_settings_default_and_one_text_as_a_one_item_list():
    from sim.runs.requests import TrainRequest

    r = TrainRequest(**_TRAIN_KW, wraparound=None, slow_link="0,0:x+:0.5")
    assert r.wraparound == "auto" and r.slow_link == ("0,0:x+:0.5",)
    assert r == TrainRequest(**_TRAIN_KW, slow_link=["0,0:x+:0.5"])
