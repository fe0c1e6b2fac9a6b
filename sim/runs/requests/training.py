"""The requests of a training step (`tpusim train`), its compiled trace (`tpusim compile`), a
replay of a trace or of XLA's HLO (`tpusim replay`, `tpusim import-hlo`) and a search of the
ways to run a step (`tpusim plan`), with the training settings they share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import field
from typing import Any, ClassVar

from sim.runs.requests.base import (
    PERTURB_FIELDS,
    POD_FIELDS,
    SPARE_FIELDS,
    RequestBase,
    StepRequest,
    request_dataclass,
)
from topologies.validate import whole_flag

TRAINING_FIELDS = ("model", "seq_len", "batch_per_chip", "mesh", "dcn", "axis_map", "remat",
             "remat_save", "remat_offload", "attention", "microbatches", "param_dtype",
             "grad_dtype", "gather_dtype",
             "optimizer_dtype", "optimizer", "pipeline_schedule", "virtual_stages", "no_overlap",
             "no_fusion", "tp_activations", "tp_comm", "dp_allreduce", "dp_grad_split",
             "fsdp_grad", "ep_alltoall", "moe_dispatch", "vocab_tiling", "logits_dtype",
             "mlp_act_dtype", "embed_lookup", "matmul_dtype",
             "quantize_attention", "quantize_logits", "quant_scales", "quant_gather",
             "no_stochastic_rounding", "fsdp_gather")
# int8 training's settings: recorded in `inputs.flags` only when not their defaults, so bf16
# results read (and rerun) as before.
_QUANT_FLAGS = ("matmul_dtype", "quantize_attention", "quantize_logits", "quant_scales",
                "quant_gather", "no_stochastic_rounding")
# Recorded in `inputs.flags` only when not their defaults (results from before they existed
# read and rerun as before): int8 training's settings, the logits path's and the MLP
# activation's dtypes, the embedding lookup's form and the MoE dispatch form.
_WHEN_SET = (*_QUANT_FLAGS, "logits_dtype", "mlp_act_dtype", "embed_lookup", "moe_dispatch")


@request_dataclass
class TrainRequest(StepRequest):
    """One training step (`tpusim train`): a model on a mesh of the pod, with its settings."""

    COMMAND: ClassVar[str] = "train"
    FLAGS: ClassVar[tuple[str, ...]] = (
        *POD_FIELDS, "overrides", *TRAINING_FIELDS, "algorithm", *PERTURB_FIELDS, *SPARE_FIELDS,
        "mode", "power_cap")
    RECORDED_WHEN_SET: ClassVar[tuple[str, ...]] = _WHEN_SET
    REQUIRED: ClassVar[tuple[str, ...]] = ("model", "seq_len", "batch_per_chip", "mesh")

    model: str | None = None
    seq_len: int | None = None
    batch_per_chip: float | None = None
    mesh: str | None = None
    dcn: str | None = None
    axis_map: str | None = None
    remat: str = "full"
    remat_save: str | None = None
    remat_offload: str | None = None
    attention: str = "flash"
    microbatches: int = 1
    param_dtype: str = "bf16"
    grad_dtype: str = "bf16"
    gather_dtype: str | None = None
    optimizer_dtype: str = "fp32"
    optimizer: str = "adam"
    pipeline_schedule: str | None = None
    virtual_stages: int = 1
    no_overlap: bool = False
    no_fusion: bool = False
    tp_activations: str = "sharded"
    tp_comm: str = "blocking"
    dp_allreduce: str = "async"
    dp_grad_split: str = "per-matrix"
    fsdp_grad: str = "reduce-scatter"
    ep_alltoall: str = "sync"
    moe_dispatch: str = "auto"
    vocab_tiling: int = 1
    logits_dtype: str = "bf16"
    mlp_act_dtype: str = "bf16"
    embed_lookup: str = "auto"
    fsdp_gather: str = "async"
    matmul_dtype: str = "bf16"
    quantize_attention: bool = False
    quantize_logits: bool = False
    quant_scales: str = "per-channel"
    quant_gather: str = "int8"
    no_stochastic_rounding: bool = False
    algorithm: str = "auto"


@request_dataclass
class CompileRequest(TrainRequest):
    """A training step compiled into a trace (`tpusim compile`): for the pod's chip, or for
    `chips` chips of no particular generation (its compiler's memory rules off). Only `model.*`
    overrides apply: the chip, topology and algorithm are the replay's."""

    COMMAND: ClassVar[str] = "compile"
    FLAGS: ClassVar[tuple[str, ...]] = (
        *POD_FIELDS, "chips", "overrides", *TRAINING_FIELDS, "expert_skew", "capacity_factor",
        "seed")
    SET_SCOPE: ClassVar[tuple[str, ...] | None] = ("model",)

    chips: int | None = None
    expert_skew: float | None = 0.0
    seed: int | None = 0


@request_dataclass
class ReplayRequest(StepRequest):
    """A trace file or XLA's compiled HLO text replayed on a pod (`tpusim replay`)."""

    COMMAND: ClassVar[str] = "replay"
    FLAGS: ClassVar[tuple[str, ...]] = ("trace", *POD_FIELDS, "overrides", "no_overlap",
                                        "chakra_compute", "chakra_comm_group", "algorithm",
                                        *PERTURB_FIELDS, *SPARE_FIELDS,
                                        "mode", "power_cap")
    # Recorded in inputs.flags only when set: results written before the flag existed, and
    # replays of other traces, record what they always did (and rerun the same).
    RECORDED_WHEN_SET: ClassVar[tuple[str, ...]] = ("chakra_compute", "chakra_comm_group")
    REQUIRED: ClassVar[tuple[str, ...]] = ("trace",)
    SET_SCOPE: ClassVar[tuple[str, ...] | None] = ("chip", "topology", "collective")

    trace: str | None = None
    no_overlap: bool = False
    algorithm: str = "auto"
    # Chakra input only: how compute nodes are costed (workloads.chakra.convert.ChakraCompute).
    chakra_compute: str = "roofline"
    # Chakra input only: ASTRA-sim's communicator-group JSON (workloads.chakra.comm_group).
    chakra_comm_group: str | None = None
    # The trace file's SHA-256 a result recorded: `rerun` refuses a file that changed since.
    trace_sha256: str | None = field(default=None, repr=False)
    # `tpusim export` replays through this request too; its results say so.
    as_command: str = field(default="replay", repr=False)

    @property
    def command(self) -> str:
        return self.as_command



@request_dataclass
class ImportHloRequest(RequestBase):
    """XLA's compiled HLO text read for a pod (`tpusim import-hlo`): its inventory and trace."""

    COMMAND: ClassVar[str] = "import-hlo"
    FLAGS: ClassVar[tuple[str, ...]] = ("program", *POD_FIELDS)
    REQUIRED: ClassVar[tuple[str, ...]] = ("program",)
    SET_SCOPE: ClassVar[tuple[str, ...] | None] = None

    program: str | None = None


# The most candidates `plan --exhaustive` simulates unless `max_simulations` says more.
EXHAUSTIVE_MAX_SIMULATIONS = 100
_WHOLE = ("seq_len", "global_batch", "top", "workers", "max_simulations", "max_tensor",
          "max_data", "max_sequence", "max_pipeline", "max_expert")


@request_dataclass
class PlanRequest(RequestBase):
    """A search of the ways to run one training step (`tpusim plan`): the pod, the model and
    the batch, and the search space (comma lists, as the command line gives them). `workers`
    and `dask` say where candidates run (`dask`: "local", an address or a
    `distributed.Client`)."""

    COMMAND: ClassVar[str] = "plan"
    FLAGS: ClassVar[tuple[str, ...]] = (
        *POD_FIELDS, "overrides", "model", "seq_len", "global_batch", "top", "workers", "dask",
        "exhaustive", "max_simulations", "objective", "axes", "max_tensor", "max_data",
        "max_sequence", "max_pipeline", "max_expert", "default_placement", "remat", "microbatches",
        "param_dtype", "grad_dtype", "optimizer_dtype", "optimizer", "gather_dtype", "shapes",
        "wiring")
    REQUIRED: ClassVar[tuple[str, ...]] = ("model", "seq_len", "global_batch")
    SET_SCOPE: ClassVar[tuple[str, ...] | None] = ("chip", "topology", "model")
    OWN_CONVERTERS: ClassVar[dict[str, Callable[[Any], Any]]] = {
        **{name: whole_flag(name) for name in _WHOLE},
        "microbatches": str}  # a comma list of counts here

    model: str | None = None
    seq_len: int | None = None
    global_batch: int | None = None
    top: int = 5
    workers: int = 0
    dask: Any = None
    exhaustive: bool = False
    max_simulations: int | None = None
    axes: str = "data,fsdp,pipeline,expert,sequence,tensor"
    max_tensor: int = 8
    max_data: int = 4
    max_sequence: int = 2
    max_pipeline: int = 4
    max_expert: int = 64
    default_placement: bool = False
    remat: str = "full,minimal,none"
    microbatches: str = "1,2,4"
    param_dtype: str = "bf16"
    grad_dtype: str = "bf16"
    optimizer_dtype: str = "fp32"
    optimizer: str = "adam"
    gather_dtype: str | None = None
    objective: str = "time"
    shapes: str | None = field(default=None, metadata={"quiet": True})
    wiring: str = field(default="auto", metadata={"quiet": True})


