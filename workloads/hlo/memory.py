"""Peak HBM of an imported HLO program, from the live ranges of its buffers in the program text.

A scheduled module (`compiled.as_text()`, an `--xla_dump_to` `*after_optimizations.txt`) lists
each computation's instructions in XLA's schedule order. The model walks that order:

* **Buffers.** An instruction that computes a value defines a buffer per array leaf of its
  shape; it is live from that instruction to the last one that reads it, directly or through
  an alias. Aliases define no buffer: `parameter` (the caller's operand), `get-tuple-element`,
  `tuple`, `bitcast` and the value-preserving instructions of the lowering's `ALIASES`, the
  `*-done` of an async start (the start's result), `copy-done` (its copy's destination), and a
  `while` (its loop state is its operand's buffers, updated in place).
* **In place.** A `dynamic-update-slice`, a fusion whose root is one (on a fusion parameter) and
  an instruction with `output_to_operand_aliasing` write into their operand's buffer: no new
  buffer, the operand's lives on. A buffer whose last reader is an element-wise instruction or a
  loop fusion of the same padded size is reused for that instruction's result, as XLA's buffer
  assignment shares it (`hbm-peak` rule 1 below).
* **Entry.** The entry's parameters are live for the whole program (the arguments); the
  entry's outputs from their definition to the end. An output that `input_output_alias`
  donates to a parameter lives in the parameter's buffer. Constants are program data, not
  counted.
* **Calls.** A `while` body, a `call` and the branches of a `conditional` are walked once,
  their own buffers (everything they define; their parameters are the caller's) live within the
  walk; their peak above what the caller holds is added at the calling instruction. A loop's
  peak does not depend on its trip count (each trip reuses the same buffers).
* **Only HBM.** A value whose layout names a memory space (`S(1)` VMEM, `S(2)`-`S(4)` and
  `S(6)` on-chip scalar and semaphore memory, `S(5)` pinned host memory) is not counted.
* **Bytes** are the padded, tiled size: a layout tile `T(a,b)` rounds the minor-most dimensions
  up to multiples of the tile (a `bf16[100,100]{1,0:T(8,128)}` takes 104 x 128 elements).

What it leaves out: XLA may schedule an async copy or a rematerialised value differently from
the text order of its done; buffer assignment's own reuse of dead buffers beyond rule 1 (it
packs buffers into allocations by offset, which only lowers the peak where values of
different sizes share an allocation); fragmentation. docs/hlo.md "Peak HBM" gives its accuracy
against XLA's own buffer assignment (validation/hlo_memory.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from workloads.hlo.costs import MAX_CALL_DEPTH
from workloads.hlo.opcodes import ALIASES, ELEMENTWISE
from workloads.hlo.parser import DTYPE_BYTES, Computation, HloModule, Instruction, Shape

_SPACE = re.compile(r"S\((\d+)\)")
_TILE = re.compile(r"T\(([\d,]+)\)")
# `{0}: (1, {}, may-alias)` entries of input_output_alias / output_to_operand_aliasing.
_ALIAS = re.compile(r"\{([\d,\s]*)\}\s*:\s*\(\s*(\d+)\s*,\s*\{([\d,\s]*)\}")
_NO_BUFFER = ALIASES - {"copy-start", "copy-done", "slice-start", "slice-done"}


def leaf_bytes(shape: Shape) -> int:
    """An array's bytes in HBM (0 off HBM): its elements with the minor dimensions padded to its
    layout's first tile."""
    layout = shape.layout
    space = _SPACE.search(layout)
    if space and int(space.group(1)) != 0:
        return 0
    dims = list(shape.dims)
    colon = layout.split(":", 1)
    tile = _TILE.search(colon[1]) if len(colon) == 2 else None
    if tile:
        minor_to_major = [int(x) for x in colon[0].split(",") if x.strip()]
        physical = [dims[d] for d in reversed(minor_to_major)] if sorted(
            minor_to_major) == list(range(len(dims))) else list(dims)
        t = [int(x) for x in tile.group(1).split(",")]
        physical = [1] * max(len(t) - len(physical), 0) + physical
        for i, size in enumerate(t):
            k = len(physical) - len(t) + i
            physical[k] = -(-physical[k] // size) * size
        dims = physical
    n = 1
    for d in dims:
        n *= d
    return n * DTYPE_BYTES[shape.dtype]


@dataclass(frozen=True)
class HloMemory:
    """The program's peak HBM per chip: `peak_bytes` = `parameter_bytes` (the entry's arguments)
    + `temporary_bytes` (everything else live there: activations, gathered weights, outputs),
    at instruction `peak_at` (the entry's, or the calling instruction of the loop, call or
    branch the peak is in, with that computation's instruction after a `/`)."""

    peak_bytes: int
    parameter_bytes: int
    temporary_bytes: int
    peak_at: str
    largest: tuple[tuple[str, int], ...] = field(default=())  # (value, bytes) live at the peak

    def to_dict(self) -> dict:
        return {"hbm_peak_bytes": self.peak_bytes, "parameter_bytes": self.parameter_bytes,
                "temporary_bytes": self.temporary_bytes, "peak_at": self.peak_at,
                "largest_at_peak": [{"value": v, "bytes": b} for v, b in self.largest]}


class _Buf:
    __slots__ = ("name", "nbytes", "start", "end", "param", "owner")

    def __init__(self, name: str, nbytes: int, start: int, param: bool = False) -> None:
        self.name, self.nbytes, self.start, self.end, self.param = name, nbytes, start, start, param
        self.owner: _Buf | None = None  # the buffer this one was merged into (reuse)

    def root(self) -> _Buf:
        b = self
        while b.owner is not None:
            b = b.owner
        return b


Value = tuple  # nested tuples of _Buf (or None for a leaf off HBM / without a buffer)


def _leaves(v) -> list[_Buf]:
    if v is None:
        return []
    if isinstance(v, _Buf):
        return [v]
    out: list[_Buf] = []
    for e in v:
        out += _leaves(e)
    return out


def _at(v, path: list[int]):
    for k in path:
        if not isinstance(v, tuple) or k >= len(v):
            return v
        v = v[k]
    return v


def _replace(v, path: list[int], new):
    if not path:
        return new
    if not isinstance(v, tuple) or path[0] >= len(v):
        return v
    k = path[0]
    return (*v[:k], _replace(v[k], path[1:], new), *v[k + 1:])


def _aliases(text: str) -> list[tuple[list[int], int, list[int]]]:
    """(output index, operand number, operand index) of an aliasing attribute's entries."""
    out = []
    for m in _ALIAS.finditer(text or ""):
        idx = [int(x) for x in m.group(1).split(",") if x.strip()]
        sub = [int(x) for x in m.group(3).split(",") if x.strip()]
        out.append((idx, int(m.group(2)), sub))
    return out


class _Walk:
    """One computation walked in schedule order: its own buffers and their live ranges (the
    caller's buffers it is handed are the caller's: their ranges are the caller's business)."""

    def __init__(self, module: HloModule, comp: Computation, args: list | None,
                 depth: int) -> None:
        self.m, self.comp, self.args, self.depth = module, comp, args, depth
        self.bufs: list[_Buf] = []
        self.own: set[int] = set()
        self.cands: list[tuple[int, _Buf, list[_Buf]]] = []  # rule 1: (position, result, reads)
        self.extra: dict[int, tuple[int, str]] = {}  # position -> (callee peak above, where)
        self.pos = 0
        self.end = len(comp.instructions)

    def new(self, shape: Shape, name: str, param: bool = False):
        if shape.is_tuple:
            return tuple(self.new(e, f"{name}{{{i}}}", param)
                         for i, e in enumerate(shape.elements))
        nbytes = leaf_bytes(shape)
        if nbytes == 0:
            return None
        b = _Buf(name, nbytes, self.pos, param)
        self.bufs.append(b)
        self.own.add(id(b))
        return b

    def use(self, v) -> None:
        for b in _leaves(v):
            r = b.root()
            if id(r) in self.own and r.end < self.pos:
                r.end = self.pos

    def run(self):
        env: dict[str, object] = {}
        for i, ins in enumerate(self.comp.instructions):
            self.pos = i
            vals = [env.get(o) for o in ins.operands]
            for v in vals:
                self.use(v)
            env[ins.name] = self.value(ins, vals)
        root = env[self.comp.root.name]
        self.pos = self.end
        self.use(root)  # the result lives to the end of the computation
        # Rule 1, in schedule order: a read buffer whose last reader is this result's
        # instruction holds the result from there on.
        for pos, out, reads in self.cands:
            for r in reads:
                r = r.root()
                if r is not out and not r.param and r.end == pos and r.nbytes == out.nbytes:
                    out.owner = r
                    r.end = max(r.end, out.end)
                    break
        return root

    def callee(self, name: str, args: list) -> tuple[int, str]:
        """Walk computation `name` on `args`: (the peak of its own buffers, where)."""
        comp = self.m.computations[name]
        if self.depth > MAX_CALL_DEPTH:  # the lowering refuses such a module before this walk
            return 0, ""
        w = _Walk(self.m, comp, args, self.depth + 1)
        w.run()
        peak, at, _live = w.peak()
        return peak, f"{comp.name}/{at}" if at else comp.name

    def value(self, ins: Instruction, vals: list):
        op = ins.opcode
        if op == "parameter":
            k = int(ins.literal or 0)
            if self.args is not None:
                return self.args[k] if k < len(self.args) else None
            return self.new(ins.shape, ins.name, param=True)  # the entry's arguments
        if op == "constant":
            return None
        if op == "get-tuple-element":
            v = vals[0] if vals else None
            k = int(ins.attrs.get("index", "0"))
            return v[k] if isinstance(v, tuple) and k < len(v) else None
        if op == "tuple":
            return tuple(vals)
        if op.endswith("-done"):
            return self.done(ins, vals)
        if op in _NO_BUFFER:
            return vals[0] if vals else None
        if op == "while":
            state = vals[0] if vals else None
            self.note(*self.callee(ins.attrs["body"].lstrip("%"), [state]), ins)
            return state
        if op == "call":
            out = self.new(ins.shape, ins.name)
            peak, at = self.callee(ins.called()[0], vals)
            self.note(peak - sum(b.nbytes for b in _leaves(out)), at, ins)
            return out
        if op == "conditional":
            out = self.new(ins.shape, ins.name)
            best = (0, "")
            for k, name in enumerate(ins.called()):
                best = max(best, self.callee(name, [vals[k + 1]] if k + 1 < len(vals) else []))
            self.note(best[0] - sum(b.nbytes for b in _leaves(out)), best[1], ins)
            return out
        if op.endswith("-start") or op == "async-start":
            return self.start(ins, vals)
        return self.compute(ins, vals)

    def note(self, peak: int, at: str, ins: Instruction) -> None:
        if peak > self.extra.get(self.pos, (0, ""))[0]:
            self.extra[self.pos] = (peak, f"{ins.name}>{at}")

    def start(self, ins: Instruction, vals: list):
        """An async start: its operands stay live (aliased in its tuple), its results are new."""
        shape, op = ins.shape, ins.opcode
        if not shape.is_tuple:
            return self.new(shape, ins.name)
        elems = shape.elements
        if op == "all-gather-start":  # (operands..., results...)
            half = len(elems) // 2
            return (*vals[:half], *(self.new(e, f"{ins.name}{{{half + i}}}")
                                    for i, e in enumerate(elems[half:])))
        if op == "copy-start":  # (destination, source, context)
            return (self.new(elems[0], f"{ins.name}{{0}}"), vals[0] if vals else None,
                    *(None for _ in elems[2:]))
        if op == "collective-permute-start":  # (operand, result, context...)
            return (vals[0] if vals else None, self.new(elems[1], f"{ins.name}{{1}}"),
                    *(self.new(e, f"{ins.name}{{{i + 2}}}") for i, e in enumerate(elems[2:])))
        if op == "async-start" or elems[0].is_tuple:
            # An async wrapper (`async-start`, printed by `compiled.as_text()` as the wrapped
            # op's name, `slice-start`): ((operands...), result, context...).
            return (tuple(vals), self.new(elems[1], f"{ins.name}{{1}}"),
                    *(self.new(e, f"{ins.name}{{{i + 2}}}") for i, e in enumerate(elems[2:])))
        return self.new(shape, ins.name)

    def done(self, ins: Instruction, vals: list):
        v = vals[0] if vals else None
        if not isinstance(v, tuple):
            return v
        op = ins.opcode
        if op == "all-gather-done":
            rest = v[len(v) // 2:]
            return rest[0] if len(rest) == 1 else tuple(rest)
        if op == "copy-done":
            return v[0]
        if op == "collective-permute-done" or (len(v) > 1 and isinstance(v[0], tuple)):
            return v[1]  # the result of (operand(s), result, context...)
        return v

    def compute(self, ins: Instruction, vals: list):
        out = self.new(ins.shape, ins.name)
        inplace = self.in_place(ins)
        for out_idx, k, sub in inplace:
            if k < len(vals):
                for b in _leaves(_at(out, out_idx)):
                    b.nbytes = 0  # the operand's buffer holds it
                out = _replace(out, out_idx, _at(vals[k], sub))
        if not inplace and isinstance(out, _Buf) and self.shares(ins):
            reads = [v for v in vals if isinstance(v, _Buf) and id(v.root()) in self.own]
            if reads:
                self.cands.append((self.pos, out, reads))
        return out

    @staticmethod
    def shares(ins: Instruction) -> bool:
        if ins.opcode in ELEMENTWISE:
            return True
        return ins.opcode == "fusion" and ins.attrs.get("kind", "") == "kLoop"

    def in_place(self, ins: Instruction) -> list[tuple[list[int], int, list[int]]]:
        """(output index, operand, operand index) of the outputs written into an operand."""
        found = _aliases(ins.attrs.get("output_to_operand_aliasing", ""))
        if found:
            return found
        if ins.opcode == "dynamic-update-slice":
            return [([], 0, [])]
        if ins.opcode == "fusion" and ins.called():
            fused = self.m.computations.get(ins.called()[0])
            if fused is None:
                return []
            root = fused.root
            roots = [([], root)] if root.opcode != "tuple" else [
                ([i], fused.by_name.get(o)) for i, o in enumerate(root.operands)]
            out = []
            for idx, r in roots:
                k = _dus_param(fused, r)
                if k is not None:
                    out.append((idx, k, []))
            return out
        return []

    def peak(self) -> tuple[int, str, list[_Buf]]:
        """(peak bytes of this computation's own buffers plus its callees', where, the buffers
        live there)."""
        n = self.end + 1
        delta = [0] * (n + 1)
        for b in self.bufs:
            if b.owner is None:  # a merged buffer is its owner's
                delta[b.start] += b.nbytes
                delta[min(b.end, self.end) + 1] -= b.nbytes
        best, at, level = 0, -1, 0
        for t in range(n):
            level += delta[t]
            total = level + self.extra.get(t, (0, ""))[0]
            if total > best:
                best, at = total, t
        if at < 0:
            return 0, "", []
        live = [b for b in self.bufs if b.owner is None and b.start <= at <= b.end]
        if self.extra.get(at, (0, ""))[0] > 0:
            name = self.extra[at][1]
        else:
            name = self.comp.instructions[at].name if at < self.end else "ROOT"
        return best, name, live


def _skip_bitcasts(fused: Computation, r: Instruction | None) -> Instruction | None:
    for _ in range(16):
        if r is None or r.opcode != "bitcast" or not r.operands:
            return r
        r = fused.by_name.get(r.operands[0])
    return r


def _dus_param(fused: Computation, r: Instruction | None) -> int | None:
    """The fusion parameter a dynamic-update-slice root writes into, if it writes into one."""
    r = _skip_bitcasts(fused, r)
    if r is None or r.opcode != "dynamic-update-slice" or not r.operands:
        return None
    p = _skip_bitcasts(fused, fused.by_name.get(r.operands[0]))
    return int(p.literal or 0) if p is not None and p.opcode == "parameter" else None


def hlo_memory(module: HloModule) -> HloMemory:
    """The entry computation's peak HBM per chip (see the module docstring)."""
    entry = module.entry_computation
    w = _Walk(module, entry, None, 0)
    result = w.run()
    params = [b for b in w.bufs if b.param]
    for b in params:
        b.start, b.end = 0, w.end  # the arguments are live for the whole program
    for idx, _p, _sub in _aliases(module.attrs.get("input_output_alias", "")):
        for b in _leaves(_at(result, idx)):
            if not b.root().param:
                b.root().nbytes = 0  # written into the donated parameter's buffer
    peak, at, live = w.peak()
    pbytes = sum(b.nbytes for b in params)
    largest = sorted(((b.name, b.nbytes) for b in live if b.nbytes), key=lambda x: -x[1])[:5]
    return HloMemory(peak_bytes=int(peak), parameter_bytes=int(pbytes),
                     temporary_bytes=int(peak - pbytes), peak_at=at, largest=tuple(largest))


__all__ = ["HloMemory", "hlo_memory", "leaf_bytes"]
