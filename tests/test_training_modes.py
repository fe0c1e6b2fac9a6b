"""The training step's modes as `StrEnum`s (workloads/training/modes.py): every mode is taken as
its text or as its member, becomes the member, prints and records as the same text, and a
config given text equals (and caches as) the one given members."""

import pickle

import pytest

from topologies.errors import TpusimError
from workloads.training import (
    Attention,
    DpAllreduce,
    DpGradSplit,
    EpAlltoall,
    FsdpGather,
    FsdpGrad,
    MoeDispatch,
    Optimizer,
    PipelineSchedule,
    Remat,
    TpActivations,
    TpComm,
    TrainingConfig,
    training_config_from_dict,
    training_config_to_dict,
)

MODES = {"remat": Remat, "attention": Attention, "fsdp_gather": FsdpGather,
         "tp_activations": TpActivations, "tp_comm": TpComm, "dp_allreduce": DpAllreduce,
         "fsdp_grad": FsdpGrad, "dp_grad_split": DpGradSplit, "ep_alltoall": EpAlltoall,
         "pipeline_schedule": PipelineSchedule, "optimizer": Optimizer,
         "moe_dispatch": MoeDispatch}


@pytest.mark.parametrize("name", sorted(MODES))
def test_every_mode_given_as_text_becomes_its_member_and_prints_as_the_text(name):
    for member in MODES[name]:
        kw = {name: member.value}
        if name == "fsdp_grad" and member.value != "reduce-scatter":
            kw["fsdp_gather"] = "async"
        if name == "optimizer" and member.value == "sgd":
            kw["optimizer_dtype"] = "fp32"
        cfg = TrainingConfig(seq_len=128, batch_per_chip=1, **kw)
        value = getattr(cfg, name)
        assert type(value) is MODES[name] and value is member
        assert str(value) == f"{value}" == member.value
        assert cfg == TrainingConfig(seq_len=128, batch_per_chip=1, **{**kw, name: member})
        assert hash(cfg) == hash(TrainingConfig(seq_len=128, batch_per_chip=1,
                                                **{**kw, name: member}))
        recorded = training_config_to_dict(cfg)
        if name == "moe_dispatch" and member.value == "auto":
            assert name not in recorded  # recorded only when set: older results read the same
        else:
            assert recorded[name] == member.value
        assert training_config_from_dict(training_config_to_dict(cfg)) == cfg
        assert pickle.loads(pickle.dumps(cfg)) == cfg


def test_a_mode_names_its_choices_in_the_same_words_as_before():
    with pytest.raises(TpusimError, match=r"^attention 'Flash' must be dot or flash$"):
        TrainingConfig(seq_len=128, batch_per_chip=1, attention="Flash")
    with pytest.raises(TpusimError, match=r"^fsdp_gather 'x' is not a mode; use one of: async, "
                                          r"windowed, blocking, mixed-async, mixed-blocking$"):
        TrainingConfig(seq_len=128, batch_per_chip=1, fsdp_gather="x")
    with pytest.raises(TpusimError, match=r"^pipeline_schedule 3 must be one of gpipe, 1f1b, "
                                          r"interleaved$"):
        TrainingConfig(seq_len=128, batch_per_chip=1, pipeline_schedule=3)

