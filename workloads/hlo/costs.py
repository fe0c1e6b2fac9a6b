"""What an HLO instruction costs on one chip, read off the module alone: MXU FLOPs of dots and
convolutions (`conv_flops` counts the positions that land on real input), VPU FLOPs, HBM bytes
of a fusion, the MXU format of a matmul, and the checks XLA's verifier makes of dot and gather
dimension numbers. `ModuleCosts` memoises them per computation; `workloads/hlo/lower.py` walks
the module with it."""

from __future__ import annotations

import re
from typing import Any

from topologies.errors import TpusimError
from workloads.hlo.opcodes import COLLECTIVES, ELEMENTWISE, FP8_TYPES, INT8_TYPES, MXU_OPS
from workloads.hlo.parser import Computation, HloModule, Instruction, Shape, dot_dims, int_list

MAX_CALL_DEPTH = 64


def _window(text: str, n: int) -> dict[str, list]:
    """`{size=4x2 stride=3x1 pad=0_0x1_1 lhs_dilate=4x1}` -> per-spatial-dim lists."""
    out: dict[str, list] = {"size": [1] * n, "stride": [1] * n, "pad": [(0, 0)] * n,
                            "lhs_dilate": [1] * n, "rhs_dilate": [1] * n}
    for key, val in re.findall(r"(\w+)=([\w\-]+)", text):
        parts = val.split("x")
        if len(parts) != n:
            continue
        if key == "pad":
            out["pad"] = [tuple(int(v) for v in p.split("_")) for p in parts]
        elif key in out:
            out[key] = [int(v) for v in parts]
    return out


def conv_flops(lhs: Shape, rhs: Shape, out: Shape, dim_labels: str, window: str) -> float:
    """2 x batch x output features x input features per group x, per spatial dimension, the
    (output, kernel) position pairs that land on a real input element (not padding, not a hole
    of lhs dilation). XLA's TPU backend writes matmuls and attention einsums as convolutions,
    some with dilated windows that select one tap per output: counting window taps instead
    would overstate them several times."""
    m = re.fullmatch(r"([^_]+)_([^-]+)->(.+)", dim_labels.strip())
    if not m or lhs.is_tuple or rhs.is_tuple or out.is_tuple:
        return 2.0 * out.num_elements * (rhs.num_elements / max(rhs.dims[-1], 1)
                                         if rhs.dims else 1)
    ll, rl, ol = m.groups()
    if len(ll) != len(lhs.dims) or len(rl) != len(rhs.dims) or len(ol) != len(out.dims):
        return 2.0 * out.num_elements
    spatial = sorted(c for c in rl if c.isdigit())
    w = _window(window.strip("{}"), len(spatial))
    total = 2.0 * out.dims[ol.index("b")] * out.dims[ol.index("f")] * rhs.dims[rl.index("i")]
    for k, c in enumerate(spatial):
        n_in = lhs.dims[ll.index(c)]
        n_k = rhs.dims[rl.index(c)]
        n_out = out.dims[ol.index(c)]
        stride, (pad_lo, _pad_hi) = w["stride"][k], w["pad"][k]
        ld, rd = w["lhs_dilate"][k], w["rhs_dilate"][k]
        span = (n_in - 1) * ld + 1
        valid = 0
        for o in range(n_out):
            for t in range(n_k):
                p = o * stride + t * rd - pad_lo
                if 0 <= p < span and p % ld == 0:
                    valid += 1
        total *= valid
    return total


def whole(text: Any, ins: Instruction) -> int:
    """A parameter number or tuple index of `ins` as an int (one-line error if the text was
    edited into something else)."""
    t = str(text).strip()
    if not (t.lstrip("-").isdigit() and t.isascii() and len(t) <= 18):
        raise TpusimError(
            f"HLO instruction %{ins.name} ({ins.opcode}) has the index {t[:40]!r}, not a whole "
            f"number; give unedited compiled.as_text() output"
        )
    return int(t)


class ModuleCosts:
    """The costs of one module's instructions and computations (memoised per computation)."""

    def __init__(self, module: HloModule, source: str) -> None:
        self.m = module
        self.source = source
        self._comp_flops: dict[str, tuple[float, float]] = {}
        self._comp_dtype: dict[str, str] = {}
        self._comp_colls: dict[str, list[Instruction]] = {}

    def shape_of(self, comp: Computation, name: str) -> Shape:
        ins = comp.by_name.get(name)
        if ins is not None:
            return ins.shape
        s = self.m.shapes.get(name)
        if s is None:
            raise TpusimError(f"{self.source}: operand %{name} is not defined (truncated file?)")
        return s

    def mxu_dtype(self, comp: Computation, ins: Instruction) -> str:
        """The MXU format of a dot or convolution: int8 or fp8 when both operands are, else
        bf16 (`INT8_TYPES`)."""
        types = {self.shape_of(comp, o).dtype for o in ins.operands[:2]}
        if len(ins.operands) >= 2 and types <= INT8_TYPES:
            return "int8"
        if len(ins.operands) >= 2 and types <= FP8_TYPES:
            return "fp8"
        return "bf16"

    def comp_dtype(self, comp: Computation) -> str:
        """The MXU format of a fused computation's first dot or convolution (nested fusions
        included; bf16 without one)."""
        if comp.name in self._comp_dtype:
            return self._comp_dtype[comp.name]
        out = "bf16"
        for ins in comp.instructions:
            if ins.opcode in MXU_OPS:
                out = self.mxu_dtype(comp, ins)
                break
            if ins.opcode in ("fusion", "call"):
                inner = [self.comp_dtype(self.m.computations[c]) for c in ins.called()]
                if any(d != "bf16" for d in inner):
                    out = next(d for d in inner if d != "bf16")
                    break
        self._comp_dtype[comp.name] = out
        return out

    def mxu_flops(self, comp: Computation, ins: Instruction) -> float:
        out = ins.shape.num_elements
        if ins.opcode == "dot":
            dd = dot_dims(ins)
            lhs = self.shape_of(comp, ins.operands[0])
            self.check_dot(comp, ins, dd, lhs)
            k = 1
            for d in dd["lhs_contracting_dims"]:
                k *= lhs.dims[d]
            return 2.0 * out * k
        if len(ins.operands) < 2:
            return 0.0
        return conv_flops(self.shape_of(comp, ins.operands[0]),
                          self.shape_of(comp, ins.operands[1]), ins.shape,
                          ins.attrs.get("dim_labels", ""), ins.attrs.get("window", ""))

    def check_dot(self, comp: Computation, ins: Instruction, dd: dict, lhs: Shape) -> None:
        """A dot's batch and contracting dimensions as XLA's verifier checks them: each within
        its operand's rank, as many on either side, of equal sizes (a dimension past the rank
        used to be skipped, costing the dot as if it contracted nothing)."""
        if len(ins.operands) < 2:
            raise TpusimError(f"{self.source}: line {ins.line}: {ins.name} is a dot with "
                              f"{len(ins.operands)} operand(s); a dot takes two")
        rhs = self.shape_of(comp, ins.operands[1])
        for kind in ("batch", "contracting"):
            ld, rd = dd[f"lhs_{kind}_dims"], dd[f"rhs_{kind}_dims"]
            for side, dims, shape in (("lhs", ld, lhs), ("rhs", rd, rhs)):
                bad = [d for d in dims if not 0 <= d < len(shape.dims)]
                if bad or len(set(dims)) != len(dims):
                    raise TpusimError(
                        f"{self.source}: line {ins.line}: {ins.name} has {side}_{kind}_dims "
                        f"{{{','.join(map(str, dims))}}}, but its {side} {shape} has rank "
                        f"{len(shape.dims)} (dimensions 0..{len(shape.dims) - 1}, each once); "
                        f"XLA rejects this module")
            if len(ld) != len(rd) or any(lhs.dims[a] != rhs.dims[b]
                                         for a, b in zip(ld, rd, strict=False)):
                raise TpusimError(
                    f"{self.source}: line {ins.line}: {ins.name}'s {kind} dimensions do not "
                    f"match ({lhs} lhs {{{','.join(map(str, ld))}}}, {rhs} rhs "
                    f"{{{','.join(map(str, rd))}}}); XLA rejects this module")

    def check_gather(self, comp: Computation, ins: Instruction) -> None:
        """A gather's dimension numbers within the ranks, as XLA's verifier checks them."""
        if len(ins.operands) < 2:
            raise TpusimError(f"{self.source}: line {ins.line}: {ins.name} is a gather with "
                              f"{len(ins.operands)} operand(s); a gather takes two")
        operand = self.shape_of(comp, ins.operands[0])
        indices = self.shape_of(comp, ins.operands[1])
        rank, out_rank = len(operand.dims), len(ins.shape.dims)
        for attr, limit, what in (("collapsed_slice_dims", rank, "operand"),
                                  ("start_index_map", rank, "operand"),
                                  ("operand_batching_dims", rank, "operand"),
                                  ("offset_dims", out_rank, "output"),
                                  ("start_indices_batching_dims", len(indices.dims),
                                   "indices")):
            if attr not in ins.attrs:
                continue
            dims = int_list(ins.attrs[attr])
            bad = [d for d in dims if not 0 <= d < limit]
            if bad:
                raise TpusimError(
                    f"{self.source}: line {ins.line}: {ins.name} has {attr}="
                    f"{{{','.join(map(str, dims))}}}, but its {what} has rank {limit} "
                    f"(dimensions 0..{limit - 1}); XLA rejects this module")
        if "index_vector_dim" in ins.attrs:
            ivd = whole(ins.attrs["index_vector_dim"], ins)
            if not 0 <= ivd <= len(indices.dims):
                raise TpusimError(
                    f"{self.source}: line {ins.line}: {ins.name} has index_vector_dim={ivd}, "
                    f"but its indices {indices} have rank {len(indices.dims)} (0..."
                    f"{len(indices.dims)}); XLA rejects this module")
        if "slice_sizes" in ins.attrs:
            sizes = int_list(ins.attrs["slice_sizes"])
            if len(sizes) != rank or any(not 0 <= z <= n for z, n in zip(sizes, operand.dims,
                                                                          strict=False)):
                raise TpusimError(
                    f"{self.source}: line {ins.line}: {ins.name} has slice_sizes="
                    f"{{{','.join(map(str, sizes))}}} for an operand {operand}: one size per "
                    f"dimension, each at most the dimension; XLA rejects this module")

    def comp_flops(self, comp: Computation) -> tuple[float, float]:
        """(MXU, VPU) FLOPs of a fused computation, nested fusions included."""
        if comp.name in self._comp_flops:
            return self._comp_flops[comp.name]
        mxu = vpu = 0.0
        for ins in comp.instructions:
            op = ins.opcode
            if op == "gather":
                self.check_gather(comp, ins)
            if op in MXU_OPS:
                mxu += self.mxu_flops(comp, ins)
            elif op in ELEMENTWISE:
                vpu += ins.shape.num_elements
            elif op == "reduce" and ins.operands:
                vpu += self.shape_of(comp, ins.operands[0]).num_elements
            elif op in ("fusion", "call"):
                for c in ins.called():
                    a, v = self.comp_flops(self.m.computations[c])
                    mxu += a
                    vpu += v
        self._comp_flops[comp.name] = (mxu, vpu)
        return mxu, vpu

    def fusion_bytes(self, comp: Computation, ins: Instruction, fused: Computation) -> float:
        """HBM bytes of one fusion: parameters read once (a parameter used only through
        slices reads the slices), the result written once (an in-place dynamic-update-slice
        root writes only its update)."""
        params = {p.name: whole(p.literal or 0, p) for p in fused.instructions
                  if p.opcode == "parameter"}
        users: dict[str, list[Instruction]] = {}
        for f in fused.instructions:
            for o in f.operands:
                users.setdefault(o, []).append(f)
        root = fused.root
        dus_roots = [root] if root.opcode == "dynamic-update-slice" else [
            fused.by_name[o] for o in root.operands
            if o in fused.by_name and fused.by_name[o].opcode == "dynamic-update-slice"
        ] if root.opcode == "tuple" else []
        in_place = {r.operands[0] for r in dus_roots}
        total = 0.0
        for pname, idx in params.items():
            if idx >= len(ins.operands):
                continue
            full = self.shape_of(comp, ins.operands[idx]).nbytes
            us = users.get(pname, [])
            if pname in in_place:
                continue
            if us and all(u.opcode in ("dynamic-slice", "slice", "gather") and
                          u.operands[0] == pname for u in us):
                total += min(full, sum(u.shape.nbytes for u in us))
            else:
                total += full
        out = ins.shape.nbytes
        if dus_roots:
            upd = sum(self.shape_of(fused, r.operands[1]).nbytes for r in dus_roots)
            out = out - sum(r.shape.nbytes for r in dus_roots) + upd
        return total + max(out, 0)

    def operand_bytes(self, comp: Computation, ins: Instruction) -> float:
        return float(sum(self.shape_of(comp, o).nbytes for o in ins.operands))

    def collectives_in(self, comp: Computation) -> list[Instruction]:
        if comp.name not in self._comp_colls:
            found = []
            for ins in comp.instructions:
                if ins.opcode in COLLECTIVES:
                    found.append(ins)
                elif ins.opcode in ("fusion", "call"):
                    for c in ins.called():
                        found += self.collectives_in(self.m.computations[c])
            self._comp_colls[comp.name] = found
        return self._comp_colls[comp.name]

    def static_cost(self, comp: Computation, depth: int = 0) -> float:
        """Rough size of a computation (FLOPs + bytes, loops once) to pick a conditional's
        branch."""
        if depth > MAX_CALL_DEPTH:
            return 0.0
        total = 0.0
        for ins in comp.instructions:
            if ins.opcode in ("fusion",):
                a, v = self.comp_flops(self.m.computations[ins.called()[0]])
                total += a + v + ins.shape.nbytes
            elif ins.opcode in MXU_OPS:
                total += self.mxu_flops(comp, ins) + ins.shape.nbytes
            elif ins.opcode in ("call", "while", "conditional"):
                total += sum(self.static_cost(self.m.computations[c], depth + 1)
                             for c in ins.called())
            elif ins.opcode in COLLECTIVES:
                total += ins.shape.nbytes
            else:
                total += ins.shape.nbytes
        return total
