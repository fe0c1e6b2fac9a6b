"""What a compiled HLO module says, read with the one HLO parser (`workloads/hlo/parser.py`):
every collective with its kind, bytes, replica groups and executions (while loops' trip
counts), and every op's `estimated_cycles` from XLA's cost model with its op name.
"""

from __future__ import annotations

import re

from workloads.hlo.parser import (
    Computation,
    HloModule,
    Instruction,
    Shape,
    backend_config,
    parse_hlo,
    source_target_pairs,
)

# --------------------------------------------------------------------------------------------
# Reading the compiled module (workloads.hlo.parser; used by the worker)
# --------------------------------------------------------------------------------------------

_OP_NAME_RE = re.compile(r'op_name="([^"]*)"')
_CYCLES_RE = re.compile(r'"estimated_cycles":"?(\d+)')
_LAYER_RE = re.compile(r"layer(\d+)")
_COLL_BASE = {
    "all-gather": "all-gather", "all-gather-start": "all-gather",
    "reduce-scatter": "reduce-scatter", "all-reduce": "all-reduce",
    "all-reduce-start": "all-reduce", "all-to-all": "all-to-all",
    "collective-permute": "collective-permute",
    "collective-permute-start": "collective-permute",
}


def op_name(ins: Instruction) -> str:
    """The `op_name` of an instruction's metadata ("" without one)."""
    m = _OP_NAME_RE.search(ins.attrs.get("metadata", ""))
    return m.group(1) if m else ""


def estimated_cycles(ins: Instruction) -> int | None:
    """XLA's cost-model estimate in the instruction's backend config (None without one)."""
    m = _CYCLES_RE.search(ins.attrs.get("backend_config", ""))
    return int(m.group(1)) if m else None


def _callee(ins: Instruction, key: str) -> str | None:
    """The computation an attribute such as `body=%b` or `calls=%f` names."""
    return ins.attrs.get(key, "").lstrip("%") or None


def _leaf_bytes(shape: Shape) -> list[int]:
    """Bytes of each array of a shape (one entry for an array, one per leaf of a tuple)."""
    return [leaf.nbytes for leaf in shape.leaves()]


def _int_literal(ins: Instruction) -> int | None:
    """The value of an integer constant (None for anything else)."""
    m = re.match(r"\d+", ins.literal) if ins.opcode == "constant" else None
    return int(m.group(0)) if m else None


def _root(comp: Computation) -> Instruction | None:
    """The instruction marked ROOT (None if none is)."""
    return next((i for i in comp.instructions if i.is_root), None)


def _instructions(module: HloModule, name: str | None) -> tuple[Instruction, ...]:
    comp = module.computations.get(name or "")
    return comp.instructions if comp is not None else ()


def trip_count(module: HloModule, ins: Instruction) -> int:
    """A while loop's trip count: XLA's `known_trip_count`, else read off the condition's
    limit and the induction variable's step (1 if neither can be read)."""
    known = backend_config(ins).get("known_trip_count")
    if isinstance(known, dict) and int(known.get("n", 0) or 0):
        return int(known["n"])
    body = _instructions(module, _callee(ins, "condition"))
    consts = [c for i in body if (c := _int_literal(i)) is not None]
    if not (any(i.attrs.get("direction") == "LT" for i in body) and len(consts) == 1):
        return 1
    limit = consts[0]
    # induction variable: the tuple index the condition compares; its step is the constant
    # added to it in the body (windowed-einsum loops are unrolled by 2, so step is often 2).
    k = next((i.attrs["index"] for i in body
              if i.opcode == "get-tuple-element" and "index" in i.attrs), None)
    step = 1
    bbody = _instructions(module, _callee(ins, "body"))
    params_ = {i.name for i in bbody if i.opcode == "parameter"}
    gtes = {i.name for i in bbody if i.opcode == "get-tuple-element"
            and len(i.operands) == 1 and i.operands[0] in params_
            and i.attrs.get("index") == k}
    # The induction variable may reach its increment through copies (a loop rotated by the
    # scheduler: `add(copy(gte), 2)`); without following them a loop unrolled by 2 would count
    # twice its trips (the MoE program's bidirectional windowed einsums).
    grew = True
    while grew:
        more = {i.name for i in bbody if i.opcode in ("copy", "bitcast")
                and len(i.operands) == 1 and i.operands[0] in gtes}
        grew = not more <= gtes
        gtes |= more
    cvals = {i.name: c for i in bbody if (c := _int_literal(i)) is not None}
    root = next((i for i in bbody if i.is_root and i.opcode == "tuple"), None)
    nxt = None
    if root is not None and k is not None and int(k) < len(root.operands):
        nxt = root.operands[int(k)]
    for i in bbody:
        if i.opcode == "add" and (nxt is None or i.name == nxt):
            if any(r in gtes for r in i.operands):
                c = [cvals[r] for r in i.operands if r in cvals]
                if c:
                    step = c[0]
                    break
    return -(-limit // max(step, 1))


def _first_operand(ins: Instruction | None) -> str:
    return ins.operands[0] if ins is not None and ins.operands else ""


class _Collectives:
    """The walk of `parse_hlo_collectives`: every computation reached from the entry, with the
    executions of the loops around it, its collectives recorded in `results`."""

    def __init__(self, module: HloModule) -> None:
        self.module = module
        self.comps = module.computations
        self.shapes = module.shapes
        self.by_name = {ins.name: ins for comp in self.comps.values()
                        for ins in comp.instructions}
        self.results: list[dict] = []

    def operand_bytes(self, ins: Instruction) -> list[int]:
        """Bytes of each operand (a tuple-shaped operand: its first array)."""
        return [b for ref in ins.operands for b in _leaf_bytes(self.shapes[ref])[:1]
                if ref in self.shapes]

    def sliced_all_reduces(self, comp: str) -> set[str]:
        """All-reduces of a fused computation whose result is only dynamic-sliced by its ROOT:
        TPU's all-reduce-scatter fusion (`SingleInputAllReduceScatterFusion`, a computation
        named `all-reduce-scatter*`), one ring reduce-scatter, not an all-reduce."""
        c = self.comps.get(comp)
        root = _root(c) if c is not None else None
        if root is None or root.opcode != "dynamic-slice":
            return set()
        src = _first_operand(root)
        return {i.name for i in c.instructions if i.opcode == "all-reduce" and i.name == src}

    def padded_scatter_fixup(self, ins: Instruction) -> bool:
        """A collective-permute of a slice of an all-reduce-scatter fusion's result: XLA pads
        a gradient whose reduce-scatter it splits unevenly (a [4096, 4096] one into 4 x 1040
        rows in the v6e data x fsdp program) and moves each shard's extra rows to its
        neighbour afterwards. It is the tail of that reduce-scatter, counted with it."""
        sl = self.by_name.get(_first_operand(ins))
        if sl is None or sl.opcode != "slice":
            return False
        fu = self.by_name.get(_first_operand(sl))
        called = _callee(fu, "calls") if fu is not None else None
        return bool(fu is not None and fu.opcode == "fusion" and called
                    and self.sliced_all_reduces(called))

    def ring_role(self, ins: Instruction) -> str:
        """What an unrolled windowed einsum's collective-permute carries (a ring over few chips
        that XLA writes out step by step instead of a `windowed_dot_general` loop): "rs0", a
        reduce-scatter ring's start (a zero accumulator), "rs", its partial sums (a fusion
        adding a received permute to a partial product, reached through copies and tuple
        elements), or "ag", a gather's weight shards (the weights themselves, or a received
        shard relayed)."""
        seen = set()
        src = _first_operand(ins)
        while src in self.by_name and src not in seen:
            seen.add(src)
            prod = self.by_name[src]
            op = prod.opcode
            if op == "broadcast":
                return "rs0"  # a reduce-scatter ring's start: a zero accumulator
            if op == "fusion":
                body = _instructions(self.module, _callee(prod, "calls"))
                received = any(getattr(self.by_name.get(r), "opcode", None)
                               == "collective-permute-done" for r in prod.operands)
                return "rs" if received and any(i.opcode == "add" for i in body) else "ag"
            if op not in ("copy", "bitcast", "copy-start", "copy-done", "get-tuple-element"):
                return "ag"
            src = _first_operand(prod)
        return "ag"

    def visit(self, comp: str, mult: int, ctx_name: str, loop: str | None, seen: tuple,
              fused: bool = False):
        if comp in seen or comp not in self.comps:
            return
        scatter = self.sliced_all_reduces(comp) if fused else set()
        for ins in self.comps[comp].instructions:
            op = ins.opcode
            name = op_name(ins) or ctx_name
            base = _COLL_BASE.get(op)
            if base == "all-reduce" and ins.name in scatter:
                base = "reduce-scatter"
            fixup = base == "collective-permute" and self.padded_scatter_fixup(ins)
            role = self.ring_role(ins) if (
                base == "collective-permute" and not fixup
                and name.endswith("dot_general")
                and not (loop or "").startswith("windowed")) else None
            if base is not None:
                self.record(ins, base, op, name, mult, loop, fused, fixup, role)
            if op == "async-start":
                # async wrapper around e.g. reduce-scatter: visit the wrapped computation.
                for c in ins.called():
                    self.visit(c, mult, name, loop, seen + (comp,))
            elif op == "while":
                n = trip_count(self.module, ins)
                body = _callee(ins, "body")
                if body:
                    tag = ("windowed-ag" if "_ag" in body else
                           "windowed-rs" if "_rs" in body else "loop")
                    self.visit(body, mult * n, name, f"{tag}:{ins.name}[x{n}]", seen + (comp,))
            elif op in ("call", "conditional", "fusion"):
                for c in ins.called():
                    self.visit(c, mult, name, loop, seen + (comp,), fused or op == "fusion")
        return

    def record(self, ins: Instruction, base: str, op: str, name: str, mult: int,
               loop: str | None, fused: bool, fixup: bool, role: str | None) -> None:
        """One collective's row: kind, async, executions, bytes, layer and phase, loop, groups
        or pairs, channel."""
        # TPU "async collective fusions" put one collective (one channel_id) into a
        # start fusion plus continuation fusions: count it once (deduplicated below).
        async_ = op.endswith("-start") or fused
        ch = ins.attrs.get("channel_id")
        if base == "all-gather":
            sizes = _leaf_bytes(ins.shape)
            nbytes = max(sizes) if sizes else 0
        elif base == "collective-permute":
            sizes = _leaf_bytes(ins.shape) if async_ else self.operand_bytes(ins)
            nbytes = sizes[0] if sizes else 0
        else:
            nbytes = sum(self.operand_bytes(ins))
        ml = _LAYER_RE.search(name)
        pairs = source_target_pairs(ins.attrs.get("source_target_pairs", ""))
        self.results.append(dict(
            kind=base, async_=async_, count=mult, bytes=nbytes,
            layer=int(ml.group(1)) if ml else -1,
            phase="bwd" if "transpose" in name else "fwd",
            in_loop=loop is not None, loop=loop, op_name=name[-120:],
            replica_groups=ins.attrs.get("replica_groups", ""),
            pairs=len(pairs), pair_list=[[a, b] for a, b in pairs],
            opcode=op, channel=int(ch) if ch and not fixup else None,
            **({"fixup": True} if fixup else {}),
            **({"ring": role} if role else {})))


def parse_hlo_collectives(text: str) -> list[dict]:
    """Every collective of a compiled module as the cross-check counts it: kind, whether
    async, executions (loop trip counts applied), bytes (V), layer and phase from its
    `op_name`, the loop it runs in, its replica groups or source-target pairs, its channel."""
    walk = _Collectives(parse_hlo(text, source="XLA module"))
    walk.visit(walk.module.entry, 1, "", None, ())
    results = walk.results
    # one logical collective per channel_id; keep the occurrence with the smallest multiplier
    # (an async all-gather started outside a loop whose continuation is sunk into it runs once).
    best: dict = {}
    rest = []
    for r in results:
        if r["channel"] is None:
            rest.append(r)
        elif r["channel"] not in best or r["count"] < best[r["channel"]]["count"]:
            best[r["channel"]] = r
    out = rest + list(best.values())
    for r in out:
        if r["count"] == 1:
            r["in_loop"] = False
    return out


def parse_hlo_costs(text: str) -> list[dict]:
    """XLA's own per-op cost: every instruction whose backend config carries
    `estimated_cycles` (XLA's TPU cost model; collectives and custom calls carry none),
    multiplied by the trip counts of the while loops around it, summed per (op_name, the
    op_name of the matmul inside its fusion or "", opcode, the windowed-einsum loop it sits in:
    "windowed-ag" (an all-gather einsum, `_body_ag`), "windowed-rs" (a reduce-scatter one,
    `_body_rs`) or ""): `cycles` (total), `count` (executions) and `instrs` (HLO
    instructions)."""
    module = parse_hlo(text, source="XLA module")
    comps = module.computations

    def matmul_name(comp: str | None, seen: tuple = ()) -> str:
        """The op_name of the first convolution or dot of a fused computation (or of a fusion
        nested in it): which einsum the fusion computes."""
        for ins in _instructions(module, comp):
            if ins.opcode in ("convolution", "dot"):
                return op_name(ins) or "?"
            if ins.opcode == "fusion" and comp not in seen:
                for c in ins.called():
                    found = matmul_name(c, seen + (comp,))
                    if found:
                        return found
        return ""

    acc: dict[tuple, list] = {}

    def visit(comp: str, mult: int, loop: str, seen: tuple) -> None:
        if comp in seen or comp not in comps:
            return
        for ins in comps[comp].instructions:
            cyc = estimated_cycles(ins)
            if cyc is not None:
                if ins.opcode == "fusion":
                    mm = matmul_name(_callee(ins, "calls"))
                else:
                    mm = op_name(ins) or "?" if ins.opcode in ("convolution", "dot") else ""
                a = acc.setdefault((op_name(ins), mm, ins.opcode, loop), [0, 0, 0])
                a[0] += cyc * mult
                a[1] += mult
                a[2] += 1
            body = _callee(ins, "body")
            if ins.opcode == "while" and body:
                tag = loop
                if "windowed_dot_general_body" in body:
                    tag = "windowed-rs" if "_body_rs" in body else "windowed-ag"
                visit(body, mult * trip_count(module, ins), tag, seen + (comp,))
            elif ins.opcode in ("call", "conditional", "async-start"):
                for c in ins.called():
                    visit(c, mult, loop, seen + (comp,))

    visit(module.entry, 1, "", ())
    return [dict(op_name=k[0], matmul=k[1], opcode=k[2], loop=k[3], cycles=v[0], count=v[1],
                 instrs=v[2]) for k, v in sorted(acc.items())]


