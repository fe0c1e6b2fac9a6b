"""MoE routing as the step compilers see it: router skew (expert loads drawn from a Zipf law),
capacity-factor token dropping, and the dense one-hot dispatch/combine of MaxText's
non-dropless path. Pure functions of the model, the run settings and a seed.

Conventions (docs/model.md "MoE routing"):
* a *routing group* is the tokens MaxText computes capacity over: one sequence (its local
  shard under sequence parallelism) in training and prefill, one sequence's step in decode;
* expert `shares` are the fractions of the k x tokens routing assignments each expert receives,
  sorted from the most to the least popular (rank r gets a share proportional to r^-S, capped
  at 1/k because a token picks k distinct experts);
* the popularity ranks sit on the expert-parallel shards in blocks (the E/ep most popular
  experts on one shard, the next E/ep on the next), as MaxText lays experts out by index
  (expert e on shard e // (E/ep)) when popularity follows the index: the clustered, pessimistic
  placement. Shard 0 then holds the most load, and its share never falls as S grows (it is the
  sum of the E/ep largest shares; tests check it on a grid). A balanced (round-robin)
  placement is not monotone: with k >= 2 and extreme skew its hottest experts land on
  different chips and the load evens out again. The seed decides, per layer, which chip of the
  expert axis holds the hottest block.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np

from topologies.errors import TpusimError
from topologies.groups import GroupGeometry, axis_factor
from topologies.mesh import place_mesh
from topologies.scenario import CAPACITY_FACTOR_RANGE, EXPERT_SKEW_RANGE
from topologies.validate import short_repr
from workloads.models import TransformerSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class MoeConfig:
    """Router settings of a run (`expert_skew`, `capacity_factor`, `seed`).

    Attributes:
        expert_skew: Zipf exponent S of the expert loads (0 = uniform routing).
        capacity_factor: None = dropless (every routed token is computed); C > 0 = MaxText's
            dropping path: each expert takes at most C x tokens x top_k / num_experts tokens of
            a routing group, the rest are dropped, and dispatch/combine are dense one-hot
            einsums over a [tokens, experts, capacity] mask.
        seed: picks which chip of the expert axis holds which load in each layer.
    """

    expert_skew: float = 0.0
    capacity_factor: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        # The ranges of topologies.scenario.Scenario, which the simulating commands check:
        # `compile` reaches here directly (--capacity-factor 1e300 was an infinite op size).
        s = self.expert_skew
        if not EXPERT_SKEW_RANGE.holds(s):
            raise TpusimError(
                f"{{expert_skew}} {short_repr(s)} must be {EXPERT_SKEW_RANGE.text} (the Zipf "
                f"exponent of the expert loads; 0 is uniform routing)", "expert_skew"
            )
        c = self.capacity_factor
        if c is not None and not CAPACITY_FACTOR_RANGE.holds(c):
            raise TpusimError(
                f"{{capacity_factor}} {short_repr(c)} must be {CAPACITY_FACTOR_RANGE.text} "
                f"(MaxText uses 1.0-2.0); omit it for dropless routing", "capacity_factor"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TpusimError(f"{{seed}} {short_repr(self.seed)} must be an integer", "seed")

    @property
    def is_default(self) -> bool:
        return self.expert_skew == 0 and self.capacity_factor is None

    def check_model(self, model: TransformerSpec) -> None:
        """Router settings need routed experts: refuse them on a dense model."""
        if model.is_moe or self.is_default:
            return
        flag = "expert_skew" if self.expert_skew else "capacity_factor"
        value = self.expert_skew if self.expert_skew else self.capacity_factor
        raise TpusimError(
            f"{{{flag}}} {value} needs an MoE model, but {model.name} is dense (no routed "
            f"experts); drop {{{flag}}} or pick an MoE model such as mixtral-8x7b", flag
        )


def expert_shares(num_experts: int, top_k: int, skew: float) -> list[float]:
    """Fraction of the routing assignments each expert receives, most popular first.

    Zipf(S): share_r proportional to r^-S (r = 1..E), water-filled so that no expert takes more
    than 1/k of them (a token's k experts are distinct). Sums to 1; S = 0 gives 1/E each.
    """
    e, k = num_experts, top_k
    raw = [(r + 1) ** -skew for r in range(e)]
    cap = 1.0 / k
    saturated = 0
    while True:
        rest = sum(raw[saturated:])
        scale = (1.0 - saturated * cap) / rest
        if saturated < e and raw[saturated] * scale > cap * (1 + 1e-12):
            saturated += 1  # shares are sorted, so the saturated experts are a prefix
            continue
        return [cap] * saturated + [v * scale for v in raw[saturated:]]


def shard_shares(shares: list[float], ep: int) -> list[float]:
    """Share of the assignments each expert-parallel shard receives (ranks in blocks of E/ep:
    shard j holds ranks j x E/ep ... (j + 1) x E/ep - 1), shard 0 the most loaded."""
    per = len(shares) // ep
    return [sum(shares[j * per:(j + 1) * per]) for j in range(ep)]


def expert_capacity(group_tokens: int, num_experts: int, top_k: int,
                    capacity_factor: float) -> int:
    """Tokens one expert takes from one routing group on MaxText's dropping path:
    `int(max(ceil(tokens x k / E) x C, C))` (MaxText `RoutedMoE.generate_masks`)."""
    return int(max(math.ceil(group_tokens * top_k / num_experts) * capacity_factor,
                   capacity_factor))


def smallest_capacity_factor(group_tokens: int, num_experts: int, top_k: int) -> str:
    """The smallest capacity factor of 3 significant digits, as text, that leaves an expert at
    least one token of a routing group (`expert_capacity` >= 1). Rounded up, not to nearest:
    1/64 to 3 digits is 0.0156, whose capacity int(64 x 0.0156) is 0."""
    c = 1 / math.ceil(group_tokens * top_k / num_experts)
    step = 10.0 ** (math.floor(math.log10(c)) - 2)
    k = math.ceil(c / step - 1e-9)
    while expert_capacity(group_tokens, num_experts, top_k, float(f"{k * step:.3g}")) < 1:
        k += 1
    return f"{k * step:.3g}"


@dataclass(frozen=True, slots=True, kw_only=True)
class MoeRouting:
    """Per-layer routing quantities one chip of an expert-parallel group sees.

    Attributes:
        group_tokens: tokens per routing group.
        load_factor: tokens the busiest expert shard computes over the uniform share (>= 1);
            the all-to-alls and expert matmuls of a dropless step scale by it.
        shard_load_factors: the same for every shard (shard 0 first).
        capacity: tokens per expert per group (dropping path), else None.
        expert_rows_per_token: rows the busiest chip's expert matmuls process per local token
            (k x load_factor dropless; E x capacity / group_tokens dropping).
        dropped_fraction: expected fraction of the routing assignments dropped (expected
            per-expert loads against the capacity; 0 when dropless).
        hot_shard_per_layer: for each MoE layer, the expert-axis index holding shard 0.
    """

    group_tokens: int
    load_factor: float
    shard_load_factors: tuple[float, ...]
    capacity: int | None
    expert_rows_per_token: float
    dropped_fraction: float
    hot_shard_per_layer: tuple[int, ...]

    @property
    def dense_dispatch(self) -> bool:
        return self.capacity is not None

    def summary(self, cfg: MoeConfig) -> dict:
        return {
            "expert_skew": cfg.expert_skew,
            "capacity_factor": cfg.capacity_factor,
            "seed": cfg.seed,
            "expert_capacity": self.capacity,
            "max_load_factor": self.load_factor,
            "dropped_fraction": self.dropped_fraction,
            "expert_rows_per_token": self.expert_rows_per_token,
            "hot_shard_per_layer": list(self.hot_shard_per_layer),
            "shard_load_factors": list(self.shard_load_factors),
        }


def plan_routing(model: TransformerSpec, ep: int, group_tokens: int, cfg: MoeConfig
                 ) -> MoeRouting:
    """Routing of `model`'s MoE layers over an expert axis of `ep` chips, routing groups of
    `group_tokens` tokens."""
    e, k = model.num_experts, model.experts_per_token
    shares = expert_shares(e, k, cfg.expert_skew)
    per_shard = shard_shares(shares, ep)
    # Uniform routing is exactly the unskewed step (no rounding in the shares' sums).
    factors = tuple(1.0 for _ in per_shard) if cfg.expert_skew == 0 else \
        tuple(s * ep for s in per_shard)
    rng = random.Random(cfg.seed)
    hot = tuple(rng.randrange(ep) for _ in range(model.num_moe_layers))
    if cfg.capacity_factor is None:
        return MoeRouting(group_tokens=group_tokens, load_factor=factors[0],
                          shard_load_factors=factors, capacity=None,
                          expert_rows_per_token=k * factors[0], dropped_fraction=0.0,
                          hot_shard_per_layer=hot)
    cap = expert_capacity(group_tokens, e, k, cfg.capacity_factor)
    if cap < 1:
        balanced = math.ceil(group_tokens * k / e)
        raise TpusimError(
            f"{{capacity_factor}} {cfg.capacity_factor:g} leaves each expert a capacity of 0 "
            f"tokens of a routing group of {group_tokens:g} (int(max({balanced} x C, C))): "
            f"every token would be dropped; give at least "
            f"{smallest_capacity_factor(group_tokens, e, k)}", "capacity_factor"
        )
    assigned = group_tokens * k
    dropped = sum(max(assigned * s - cap, 0.0) for s in shares) / assigned
    # Dense dispatch pads every expert to its capacity: the work no longer follows the loads.
    return MoeRouting(group_tokens=group_tokens, load_factor=1.0,
                      shard_load_factors=tuple(1.0 for _ in factors), capacity=cap,
                      expert_rows_per_token=e * cap / group_tokens, dropped_fraction=dropped,
                      hot_shard_per_layer=hot)


# The ops whose work is the experts' (forward, its recomputation, and the MLP backward of an
# MoE layer): they follow the per-chip loads in the per-chip engine.
_EXPERT_OPS = frozenset({"expert_in", "expert_act", "expert_out", "mlp_bwd", "mlp_act_bwd",
                         "mlp_bwd_weights"})
# The all-to-alls that carry the tokens to and from the experts: the compiled volume is the
# hottest shard's; each chip moves its own shard's (its load over the hottest).
_A2A_OPS = frozenset({"ep_dispatch", "ep_combine", "ep_combine_bwd", "ep_dispatch_bwd"})


def expert_op_scales(trace, topology) -> dict[int, np.ndarray]:
    """Per-chip factors (<= 1) on the expert ops and the expert all-to-alls of a skewed,
    dropless MoE step, for the per-chip engine's `op_scale`: the compiled program carries the
    hottest shard's work and volume; a chip whose position on the expert axis holds shard j in a
    layer does `load_j / load_0` of the work and moves that share of the bytes.
    Empty when every chip does the same (no skew, dense dispatch, or no expert axis)."""
    moe = trace.meta.moe
    if not moe or trace.mesh.size("expert") < 2:
        return {}
    factors = [float(f) for f in moe.get("shard_load_factors", [])]
    hot = [int(h) for h in moe.get("hot_shard_per_layer", [])]
    if not factors or not hot or max(factors) == min(factors):
        return {}
    ep = len(factors)
    pl = place_mesh(trace.mesh, topology)["expert"]
    gaxes = tuple(sorted((axis_factor(topology, a, size, stride) for a, size, stride in
                          pl.factors), key=lambda g: (g.index if g.index >= 0 else 9, g.stride)))
    pos = GroupGeometry(topology, gaxes).local_of_chip % ep  # each chip's place on the axis
    first_moe = min((o.layer for o in trace.ops if o.name.removeprefix("re-") == "expert_in"),
                    default=0)
    out: dict[int, np.ndarray] = {}
    for o in trace.ops:
        name = o.name.removeprefix("re-")
        if (name not in _EXPERT_OPS and name not in _A2A_OPS) or o.layer < 0:
            continue
        if o.name in ("mlp_bwd", "mlp_act_bwd", "mlp_bwd_weights") and o.layer < first_moe:
            continue  # a dense layer's MLP
        h = hot[(o.layer - first_moe) % len(hot)]
        shard = (pos - h) % ep
        out[o.id] = np.asarray(factors, dtype=float)[shard] / factors[0]
    return out


def dispatch_flops(tokens: float, num_experts: int, capacity: int, d_model: int) -> float:
    """FLOPs of one dense one-hot einsum against the [tokens, experts, capacity] mask
    (dispatch `BSM,BSEC->EBCM` or combine `EBCM,BSEC->BSM`): 2 x tokens x E x C x d_model."""
    return 2.0 * tokens * num_experts * capacity * d_model


__all__ = [
    "MoeConfig",
    "MoeRouting",
    "dispatch_flops",
    "expert_capacity",
    "expert_op_scales",
    "expert_shares",
    "plan_routing",
    "shard_shares",
]
