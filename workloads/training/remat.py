"""Remat policies as plans: which per-layer tensors a policy keeps in HBM between a layer's
forward and its backward, which it offloads to host memory, and (everything else) which the
backward recomputes; tpusim's own policies and MaxText's by their MaxText names.

MaxText wraps each decoder layer in `jax.checkpoint` with the policy its `remat_policy` names
(`Decoder.get_remat_policy`, MaxText/layers/decoders.py; docs/reference/maxtext_remat.md), and
tags the tensors it may save with `checkpoint_name`. JAX keeps a tagged tensor only when the
backward reads it (a residual), so a name whose value no backward reads costs nothing: the MLP
output projection `mlpwo` feeds only the layer output, whose gradient is the output gradient
itself. What is not kept is recomputed from what is, in program order: a policy that keeps q,
k and v recomputes the attention from them; one that keeps the attention output projection
does not recompute it (the mid residual is the layer input plus it), but still recomputes the
attention core when its weight gradient needs the context.

Per-layer tensors (`workloads/memory.py` names; per chip, sharded as the residual stream and
the weights shard them):
    layer_input    the decoder layer's input (MaxText `decoder_layer_input`), kept by the
                   scanned layer stack unless a policy offloads it
    q, k, v        the Q, K, V projections (`query_proj`, `key_proj`, `value_proj`; `qkv_proj`
                   names all three)
    attn_context   the attention output before its projection (`context`)
    attn_out_proj  the attention output projection (`out_proj`)
    mlp_hidden     the MLP input projection(s) (`mlpwi`, or the gated pair `mlpwi_0` and
                   `mlpwi_1`)
"""

from __future__ import annotations

from dataclasses import dataclass

from topologies.errors import TpusimError
from workloads.training.modes import Remat

# MaxText's tensor names (its `checkpoint_name` tags and the keys of a `custom` policy) and the
# tpusim tensors they are. `mlpwo` is never a residual (only the layer output reads it).
MAXTEXT_TENSORS: dict[str, tuple[str, ...]] = {
    "decoder_layer_input": ("layer_input",),
    "query_proj": ("q",),
    "key_proj": ("k",),
    "value_proj": ("v",),
    "qkv_proj": ("q", "k", "v"),
    "context": ("attn_context",),
    "out_proj": ("attn_out_proj",),
    "mlpwi": ("mlp_hidden",),
    "mlpwi_0": ("mlp_hidden",),
    "mlpwi_1": ("mlp_hidden",),
    "mlpwo": (),
}
MAXTEXT_TENSOR_NAMES = tuple(MAXTEXT_TENSORS)

# The tensors a projection-keeping policy must hold for the backward to skip the recompute of
# that projection (`kept_projections` keys).
_PROJECTIONS = {"qkv": ("q", "k", "v"), "out": ("attn_out_proj",),
                "mlp_in": ("mlp_hidden",), "context": ("attn_context",)}
# What `minimal` (checkpoint_dots_with_no_batch_dims) keeps: every weight matmul's output.
_MINIMAL = frozenset({"layer_input", "q", "k", "v", "attn_out_proj", "mlp_hidden"})

# MaxText's named policies: (kept on device, offloaded to host), in MaxText's names; the layer
# input stays on device (the scanned stack keeps it). Source: docs/reference/maxtext_remat.md.
_QKV = ("query_proj", "key_proj", "value_proj")
MAXTEXT_POLICIES: dict[Remat, tuple[tuple[str, ...], tuple[str, ...]]] = {
    Remat.SAVE_DOT_WITH_CONTEXT_EXCEPT_MLP: (_QKV + ("context", "out_proj"), ()),
    Remat.SAVE_DOT_EXCEPT_MLPWI: (_QKV + ("out_proj", "mlpwo"), ()),
    Remat.SAVE_DOT_EXCEPT_MLP: (_QKV + ("out_proj",), ()),
    Remat.SAVE_QKV_PROJ: (_QKV, ()),
    Remat.SAVE_OUT_PROJ: (("out_proj",), ()),
    Remat.QKV_PROJ_OFFLOADED: ((), _QKV),
}


def _tensors(names) -> frozenset[str]:
    return frozenset(t for name in names for t in MAXTEXT_TENSORS[name])


@dataclass(frozen=True, slots=True, kw_only=True)
class RematPlan:
    """What one remat policy does with each per-layer tensor.

    `device`: kept in HBM between the forward and the backward; `host`: offloaded to host
    memory in the forward and fetched back for the backward; every other tensor the backward
    reads is recomputed. `rule` is the policy whose compiled programs the memory rules of
    `workloads/memory.py` were read off (a named policy follows the nearest one: `minimal`
    when it keeps every projection, `full` when it recomputes some, their offloading forms
    when it offloads)."""

    policy: Remat
    device: frozenset[str]
    host: frozenset[str]
    rule: str
    # tpusim's own policies, whose memory sets come from `workloads.memory.saved_tensors`
    # under their own name (the named ones are sets of tensors).
    legacy: bool = False

    @property
    def offloads(self) -> bool:
        return bool(self.host)

    @property
    def kept_projections(self) -> frozenset[str]:
        """The projections (`qkv`, `out`, `mlp_in`, `context`) whose outputs the backward does
        not recompute (kept in HBM or fetched from host memory): only those a rerun forward
        skips (a policy that reruns no projection, `minimal` or `offload`, has none)."""
        if self.legacy and not self.recomputes_layer:
            return frozenset()
        kept = self.device | self.host
        return frozenset(k for k, names in _PROJECTIONS.items() if set(names) <= kept)

    @property
    def recomputes_layer(self) -> bool:
        """The backward reruns the layer's forward (all but the kept projections); otherwise
        (every weight matmul's output kept, as `minimal`) it recomputes only the elementwise
        ops."""
        if self.legacy:
            return self.policy in (Remat.FULL, Remat.QKV_OFFLOAD, Remat.QKVO_OFFLOAD)
        return not (_MINIMAL - {"layer_input"}) <= (self.device | self.host)

    def describe(self) -> str:
        """`device: ...; host: ...; recomputed: the rest` in tpusim's tensor names."""
        dev = ", ".join(sorted(self.device)) or "nothing"
        host = ", ".join(sorted(self.host)) or "nothing"
        return f"kept: {dev}; offloaded: {host}; recomputed: the rest"


_LEGACY = {
    Remat.NONE: (frozenset(), frozenset()),
    Remat.FULL: (frozenset({"layer_input"}), frozenset()),
    Remat.MINIMAL: (_MINIMAL, frozenset()),
    Remat.OFFLOAD: (frozenset({"layer_input"}), _MINIMAL - {"layer_input"}),
    Remat.QKV_OFFLOAD: (frozenset(), frozenset({"layer_input", "q", "k", "v"})),
    Remat.QKVO_OFFLOAD: (frozenset(), frozenset({"layer_input", "q", "k", "v",
                                                 "attn_out_proj"})),
}
# MaxText's names for tpusim's own policies: the same plans.
_SAME = {Remat.MINIMAL_OFFLOADED: Remat.OFFLOAD}


def check_custom_names(save: tuple[str, ...], offload: tuple[str, ...]) -> None:
    """One-line errors for `remat_save` / `remat_offload` lists."""
    for flag, names in (("remat_save", save), ("remat_offload", offload)):
        for name in names:
            if name not in MAXTEXT_TENSORS:
                raise TpusimError(
                    f"{{{flag}}} {name!r} is not one of MaxText's tensor names; use some of: "
                    f"{', '.join(MAXTEXT_TENSOR_NAMES)}", flag)
    both = sorted(set(save) & set(offload))
    if both:
        raise TpusimError(f"{', '.join(both)} is both in {{remat_save}} and {{remat_offload}}; "
                          f"a tensor is kept on device or offloaded, not both",
                          "remat_save", "remat_offload")
    for flag, names in (("remat_save", save), ("remat_offload", offload)):
        if ("mlpwi_0" in names) != ("mlpwi_1" in names):
            raise TpusimError(
                f"{{{flag}}} names one of mlpwi_0 and mlpwi_1; tpusim holds the gated pair as "
                f"one tensor: name both (or mlpwi)", flag)


def remat_plan(policy: Remat, save: tuple[str, ...] = (), offload: tuple[str, ...] = ()
               ) -> RematPlan:
    """The plan of `policy` (`save` and `offload`: MaxText tensor names, `custom` only)."""
    policy = _SAME.get(policy, policy)
    if policy in _LEGACY:
        device, host = _LEGACY[policy]
        return RematPlan(policy=policy, device=device, host=host, rule=str(policy),
                         legacy=True)
    if policy in (Remat.MINIMAL_WITH_CONTEXT, Remat.MINIMAL_FLASH):
        # minimal's set (with an MoE layer's f32 router logits) and the attention output.
        device, host = _MINIMAL | {"attn_context", "router_logits"}, frozenset()
    elif policy == Remat.CUSTOM:
        check_custom_names(save, offload)
        host = _tensors(offload)
        device = (_tensors(save) | {"layer_input"}) - host
    else:
        names_dev, names_host = MAXTEXT_POLICIES[policy]
        host = _tensors(names_host)
        device = _tensors(names_dev) | {"layer_input"}
    plan = RematPlan(policy=policy, device=frozenset(device), host=frozenset(host), rule="")
    if plan.recomputes_layer:
        rule = "qkv-offload" if host else "full"
    else:
        rule = "offload" if host else "minimal"
    return RematPlan(policy=policy, device=plan.device, host=plan.host, rule=rule)


__all__ = ["MAXTEXT_POLICIES", "MAXTEXT_TENSORS", "MAXTEXT_TENSOR_NAMES", "RematPlan",
           "check_custom_names", "remat_plan"]
