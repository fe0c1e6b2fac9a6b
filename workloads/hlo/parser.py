"""HLO module text -> `HloModule`: a tokenizer and a recursive-descent parser of XLA's HLO text
grammar (modules, computations, instructions, shapes with layouts and tuples, attributes).

The parser never evaluates the text: attribute values are kept as their source text and decoded
by the typed readers below (`replica_groups`, `source_target_pairs`, dimension lists, JSON
backend configs). It accepts what `compiled.as_text()` and XLA's `--xla_dump_to` write (the
optimized module and the post-SPMD-partitioning dump). Every malformed input raises a one-line
`TpusimError` naming the line and what was expected.
"""

from __future__ import annotations

import bisect
import json
import math
import re
from dataclasses import dataclass, field

from topologies.errors import TpusimError
from topologies.progress import NO_TASK, task
from workloads.dtypes import HLO_ELEMENT_BYTES

# Limits against hostile or accidental input (one-line errors, never a hang or a recursion error).
MAX_TEXT_BYTES = 64 << 20  # the 2 MB 8-layer train step is 30x smaller
MAX_NESTING = 64  # brace/paren nesting inside one instruction, and computation call depth
# Instructions in one module: real text is ~180 bytes per instruction (a 2-layer training step is
# ~10,000), so 64 MiB of it is ~370,000; short synthetic lines could pack 1.2 M into 64 MiB and
# take ~3.5 GB to parse (~1.2 GB at this limit, measured).
MAX_INSTRUCTIONS = 400_000
# Tokens per instruction: 21-29 in the eight compiled modules of tests/fixtures/hlo (a token is
# ~150 bytes in memory). Without a bound, 8 MiB of commas tokenized to 8 M tokens (920 MB, 5
# CPU-s) before the first error, and 64 MiB would have taken ~7 GB. A module may have 64 per
# instruction (of at least 1,000), and never more than real text of MAX_INSTRUCTIONS has.
MAX_TOKENS_PER_INSTRUCTION = 64
MAX_TOKENS = 30 * MAX_INSTRUCTIONS
# One array of a module: at most 2^40 bytes (1 TiB, ~5x the largest chip's HBM) and dimensions
# of at most 2^40 elements. Without a bound an all-gather of f32[4096000000000,1024000000]
# "succeeded" with a 4,400-year step; a program XLA compiled for a chip holds no such array.
MAX_ARRAY_BYTES = 1 << 40
MAX_DIM = 1 << 40
_INSTRUCTION_RE = re.compile(r"(?m)^[ \t]*(?:ROOT[ \t]+)?%?[\w.\-]+[ \t]*=[ \t]")

# Bytes per element of each HLO element type (the project's one dtype table).
DTYPE_BYTES = HLO_ELEMENT_BYTES

_SOURCE_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")

_TOKEN_RE = re.compile(
    r"""
    \s*  # leading whitespace rides along with the token: one match per token
    (?:
    (?P<comment>/\*.*?\*/|//[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*")
  | (?P<sq>'[^'\n]*')
  | (?P<arrow>->)
  | (?P<le><=)
  | (?P<ellipsis>\.\.\.)
  | (?P<word>-?[%\w$][\w.$+]*(?:-(?!>)[\w.$+]*)*)
  | (?P<punct>[{}()\[\],=:*<>;/@!?#|^])
    )
    """,
    re.VERBOSE | re.DOTALL,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    """An array shape (`bf16[8,128]{1,0}`) or a tuple of shapes (`(f32[], s32[4])`)."""

    dtype: str = ""
    dims: tuple[int, ...] = ()
    layout: str = ""  # minor-to-major and tiling text, e.g. "1,0:T(8,128)(2,1)"
    elements: tuple[Shape, ...] | None = None  # tuple shapes only

    @property
    def is_tuple(self) -> bool:
        return self.elements is not None

    @property
    def num_elements(self) -> int:
        if self.elements is not None:
            return sum(e.num_elements for e in self.elements)
        n = 1
        for d in self.dims:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        if self.elements is not None:
            return sum(e.nbytes for e in self.elements)
        return self.num_elements * DTYPE_BYTES[self.dtype]

    def leaves(self) -> list[Shape]:
        if self.elements is None:
            return [self]
        out: list[Shape] = []
        for e in self.elements:
            out += e.leaves()
        return out

    def __str__(self) -> str:
        if self.elements is not None:
            return "(" + ", ".join(str(e) for e in self.elements) + ")"
        s = f"{self.dtype}[{','.join(map(str, self.dims))}]"
        return s + (f"{{{self.layout}}}" if self.layout else "")


@dataclass(frozen=True, slots=True, kw_only=True)
class Instruction:
    name: str
    opcode: str
    shape: Shape
    operands: tuple[str, ...]  # instruction names (without %)
    attrs: dict[str, str]  # attribute name -> value source text
    literal: str = ""  # constant(...) / parameter(N) contents
    is_root: bool = False
    line: int = 0

    def called(self) -> list[str]:
        """Computations this instruction calls, in attribute order."""
        out = []
        for key in ("calls", "to_apply", "body", "condition", "branch_computations",
                    "true_computation", "false_computation", "async_execution_thread_calls"):
            v = self.attrs.get(key)
            if v:
                out += [n.strip().lstrip("%") for n in v.strip("{}").split(",") if n.strip()]
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Computation:
    name: str
    instructions: tuple[Instruction, ...]
    is_entry: bool = False
    by_name: dict[str, Instruction] = field(default_factory=dict, compare=False)

    @property
    def root(self) -> Instruction:
        for ins in self.instructions:
            if ins.is_root:
                return ins
        return self.instructions[-1]


@dataclass(frozen=True, slots=True, kw_only=True)
class HloModule:
    name: str
    attrs: dict[str, str]
    computations: dict[str, Computation]
    entry: str
    shapes: dict[str, Shape] = field(default_factory=dict, compare=False)  # instruction shapes

    @property
    def entry_computation(self) -> Computation:
        return self.computations[self.entry]

    @property
    def num_partitions(self) -> int:
        return int(self.attrs.get("num_partitions", "1"))

    @property
    def replica_count(self) -> int:
        return int(self.attrs.get("replica_count", "1"))

    @property
    def num_instructions(self) -> int:
        return sum(len(c.instructions) for c in self.computations.values())


_BLOB_ATTRS = frozenset({"backend_config", "metadata", "frontend_attributes", "sharding",
                         "output_to_operand_aliasing", "entry_computation_layout",
                         "source_target_pairs", "replica_groups", "origin"})
_GROUP_RE = re.compile(r"""(?:[^{}"]|"(?:[^"\\]|\\.)*")+|[{}]""")


def _group_end(text: str, pos: int, parser: _Parser) -> int:
    """End offset of the brace group that opens at `pos` (strings may hold braces)."""
    depth = 0
    for m in _GROUP_RE.finditer(text, pos):
        c = m.group()
        if c == "{":
            depth += 1
            if depth > MAX_NESTING:
                raise parser._error_at(m.start(), f"braces nest deeper than {MAX_NESTING} "
                                                  f"levels; this is not a program XLA writes")
        elif c == "}":
            depth -= 1
            if depth == 0:
                return m.end()
    raise parser._error_at(pos, "a '{' is never closed (truncated file?)")


class _Parser:
    def __init__(self, text: str, source: str, max_tokens: int = MAX_TOKENS) -> None:
        self.text = text
        self.source = source
        self._newlines: list[int] | None = None
        toks: list[tuple[str, str, int]] = []
        with task("HLO tokenize", total=len(text), unit="byte") as t:
            self._tokenize(text, toks, max_tokens, t)
        self.toks = toks
        self.i = 0
        self.shapes: dict[str, Shape] = {}
        self.task = NO_TASK  # the progress of `module()` (parse_hlo's)
        self.parsed = 0  # instructions of the computations parsed so far

    def _tokenize(self, text: str, toks: list, max_tokens: int, t) -> None:
        pos = 0
        n = len(text)
        match = _TOKEN_RE.match
        append = toks.append
        check = 1 << 14 if t.active else math.inf
        while pos < n:
            if len(toks) >= check:
                check = len(toks) + (1 << 14)
                if t.due():
                    t.update(pos)
            if len(toks) > max_tokens:
                raise self._error_at(pos, f"over {max_tokens:,} tokens by here, more than "
                                          f"{MAX_TOKENS_PER_INSTRUCTION} per instruction (a "
                                          f"compiled module has 21-29); this is not a program "
                                          f"XLA writes")
            m = match(text, pos)
            if m is None:
                rest = text[pos:].lstrip()
                if not rest:
                    break
                raise self._error_at(n - len(rest), f"unexpected character {rest[0]!r}")
            kind = m.lastgroup
            pos = m.end()
            if kind == "comment":
                continue
            val = m.group(kind)
            append((kind, val, m.start(kind)))  # type: ignore[arg-type]
            # Brace groups that are only ever kept as text (layouts written right after a
            # shape's `]`, and the long attribute values) become one token: most of a
            # module's bytes are backend-config JSON, and this keeps tokenizing linear and fast.
            if pos < n and text[pos] == "{" and (
                    val == "]" or (val == "=" and len(toks) >= 2 and toks[-2][1] in _BLOB_ATTRS)):
                end = _group_end(text, pos, self)
                append(("blob", text[pos:end], pos))
                pos = end

    # -- helpers ----------------------------------------------------------------------------
    def _line(self, pos: int) -> int:
        if self._newlines is None:
            self._newlines = [m.start() for m in re.finditer("\n", self.text)]
        return bisect.bisect_left(self._newlines, pos) + 1

    def _error_at(self, pos: int, what: str) -> TpusimError:
        return TpusimError(f"{self.source} is not valid HLO text: line {self._line(pos)}: {what}")

    def error(self, what: str) -> TpusimError:
        if self.i >= len(self.toks):
            return TpusimError(
                f"{self.source} is not valid HLO text: it ends early ({what}); the file looks "
                f"truncated, write it again with compiled.as_text()"
            )
        kind, val, pos = self.toks[self.i]
        return self._error_at(pos, f"{what}, found {val[:40]!r}")

    def peek(self, k: int = 0) -> str:
        j = self.i + k
        return self.toks[j][1] if j < len(self.toks) else ""

    def next(self) -> str:
        if self.i >= len(self.toks):
            raise self.error("expected more input")
        v = self.toks[self.i][1]
        self.i += 1
        return v

    def expect(self, val: str) -> None:
        if self.peek() != val:
            raise self.error(f"expected {val!r}")
        self.i += 1

    def word(self, what: str) -> str:
        if self.i >= len(self.toks) or self.toks[self.i][0] != "word":
            raise self.error(f"expected {what}")
        return self.next()

    def _item(self) -> None:
        """Skip one bracketed group (any nesting) or one token."""
        if self.i >= len(self.toks):  # a source table cut after its number (truncated file)
            raise self.error("expected a source-table entry")
        kind, v, pos = self.toks[self.i]
        if kind != "punct" or v not in "{([":
            self.i += 1
            return
        depth = 0
        while True:
            if self.i >= len(self.toks):
                raise self.error("unbalanced brackets")
            kind, v, pos = self.toks[self.i]
            self.i += 1
            if kind == "punct" and v in "{([":
                depth += 1
                if depth > MAX_NESTING:
                    raise self._error_at(
                        pos, f"brackets nest deeper than {MAX_NESTING} levels; this is not a "
                             f"program XLA writes")
            elif kind == "punct" and v in "})]":
                depth -= 1
                if depth == 0:
                    return

    def skip_balanced(self) -> str:
        """Skip one attribute value and return its source text: a bracketed group, a string or
        a word, joined by `->` / `<=` and followed by `T(...)` where HLO writes those
        (`dim_labels=b01f_01io->b01f`, `replica_groups=[2,4]<=[4,2]T(1,0)`)."""
        if self.i >= len(self.toks):
            raise self.error("expected a value")
        if self.toks[self.i][1] in ("}", ")", "]", ","):
            raise self.error("expected a value")
        start = self.toks[self.i][2]
        self._item()
        while self.i < len(self.toks):
            nxt = self.toks[self.i][1]
            if nxt in ("->", "<="):
                self.i += 1
                if self.i >= len(self.toks):
                    raise self.error("expected a value after " + nxt)
                self._item()
            elif nxt == "T" and self.peek(1) == "(":
                self.i += 1
                self._item()
            elif (nxt == "[" and self.toks[self.i - 1][1] == "mesh") or (
                    nxt == "{" and self.toks[self.i - 1][1] in ("]", ")")):
                # mesh-axes replica groups: `mesh['axis_0'=16,'axis_1'=1] {'axis_0'}`
                self._item()
            elif (nxt == "," and self.peek(1) == "device_ids" and self.peek(2) == "="
                  and self.toks[self.i - 1][1] == "]" and self.text[start:start + 4] == "mesh"):
                # ... and their device list: `mesh['axis_0'=4,'axis_1'=4],
                # device_ids=([4,4]T(1,0)) {'axis_0'}`
                self.i += 3
                if self.i >= len(self.toks):
                    raise self.error("expected the device_ids list")
                self._item()
            else:
                break
        last = self.toks[self.i - 1]
        return self.text[start:last[2] + len(last[1])]

    # -- grammar ----------------------------------------------------------------------------
    def module(self) -> HloModule:
        if self.peek() != "HloModule":
            raise TpusimError(
                f"{self.source} is not HLO text: it does not start with 'HloModule'; give the "
                f"text of compiled.as_text() or an --xla_dump_to *.txt file"
            )
        self.next()
        name = self.word("a module name")
        attrs: dict[str, str] = {}
        while self.peek() == ",":
            self.next()
            key = self.word("a module attribute")
            self.expect("=")
            attrs[key] = self.skip_balanced()
        comps: dict[str, Computation] = {}
        entry = None
        while self.i < len(self.toks):
            if self.peek() in _SOURCE_TABLES:
                # Source-location tables (`FileNames` / `1 "f.py"` ...): no cost information.
                self.next()
                while self.i < len(self.toks) and self.peek().isdigit():
                    self.next()
                    self._item()
                continue
            comp = self.computation()
            if comp.name in comps:
                raise self.error(f"computation {comp.name!r} is defined twice")
            comps[comp.name] = comp
            if comp.is_entry:
                if entry is not None:
                    # XLA's verifier: a module has one entry computation.
                    raise self.error(f"computation {comp.name!r} is a second ENTRY (the first "
                                     f"is {entry!r}); a module has one entry computation")
                entry = comp.name
        if not comps:
            raise TpusimError(f"{self.source} has a module header but no computations; the "
                              f"file looks truncated")
        if entry is None:
            entry = list(comps)[-1]  # XLA prints the entry last when it is not marked
        for c in comps.values():
            for ins in c.instructions:
                for callee in ins.called():
                    if callee not in comps:
                        raise TpusimError(
                            f"{self.source}: line {ins.line}: {ins.name} calls computation "
                            f"{callee!r}, which the module does not define (truncated file?)")
        return HloModule(name=name, attrs=attrs, computations=comps, entry=entry,
                         shapes=self.shapes)

    def computation(self) -> Computation:
        is_entry = False
        if self.peek() == "ENTRY":
            self.next()
            is_entry = True
        name = self.word("a computation name ('ENTRY %main ...' or '%name ...')").lstrip("%")
        # Optional signature `(p: f32[2], ...) -> f32[2]`.
        if self.peek() == "(":
            self._item()
            if self.peek() == "->":
                self.next()
                self.shape(layout=False)  # the '{' that follows opens the body
        if self.peek() == ",":  # e.g. `, execution_thread="main"`
            while self.peek() == ",":
                self.next()
                self.word("an attribute")
                self.expect("=")
                self.skip_balanced()
        self.expect("{")
        instrs: list[Instruction] = []
        by_name: dict[str, Instruction] = {}
        while self.peek() != "}":
            if self.i >= len(self.toks):
                raise self.error(f"computation {name!r} is not closed with '}}'")
            ins = self.instruction()
            if ins.name in by_name:
                # XLA's parser: operands name instructions, so a name is defined once in a
                # computation (the second definition silently replaced the first).
                raise TpusimError(f"{self.source} is not valid HLO text: line {ins.line}: "
                                  f"instruction %{ins.name} is defined twice in computation "
                                  f"{name!r}; instruction names are unique")
            instrs.append(ins)
            by_name[ins.name] = ins
            if self.task.active and len(instrs) % 1024 == 0 and self.task.due():
                self.task.update(self.parsed + len(instrs))
        self.next()
        # Attributes after the body: `}, execution_thread="sparsecore"` (v6e's SparseCore
        # computations, e.g. a scatter-add's reducer).
        while self.peek() == "," and self.peek(2) == "=":
            self.next()
            self.word("an attribute")
            self.expect("=")
            self.skip_balanced()
        if not instrs:
            raise self.error(f"computation {name!r} has no instructions")
        self.parsed += len(instrs)
        self.task.update(self.parsed)
        return Computation(name=name, instructions=tuple(instrs), is_entry=is_entry,
                           by_name=by_name)

    def shape(self, depth: int = 0, layout: bool = True) -> Shape:
        if depth > MAX_NESTING:
            raise self.error(f"tuple shapes nest deeper than {MAX_NESTING} levels")
        if self.peek() == "(":
            self.next()
            elems = []
            while self.peek() != ")":
                elems.append(self.shape(depth + 1, layout))
                if self.peek() == ",":
                    self.next()
                elif self.peek() != ")":
                    raise self.error("expected ',' or ')' in a tuple shape")
            self.next()
            return Shape(elements=tuple(elems))
        dtype = self.word("a shape such as f32[8,128]")
        if dtype not in DTYPE_BYTES:
            raise self.error(f"unknown element type {dtype!r} (expected e.g. bf16, f32, s32)")
        self.expect("[")
        dims: list[int] = []
        while self.peek() != "]":
            tok = self.next()
            if tok == "<=":  # dynamic dimension: bounded size
                tok = self.next()
            elif tok == "?":
                tok = "0"
            try:
                dims.append(int(tok))
            except ValueError:
                raise self.error(f"dimension {tok!r} of a {dtype} shape is not an integer") \
                    from None
            if dims[-1] < 0 or dims[-1] > MAX_DIM:
                raise self.error(f"dimension {dims[-1]:,} of a {dtype} shape is out of range "
                                 f"(0 to 2^40); this is not a shape XLA compiles for a chip")
            if self.peek() == ",":
                self.next()
        self.next()
        text = ""
        if layout and self.peek().startswith("{"):
            text = self.skip_balanced()[1:-1]
        shape = Shape(dtype=dtype, dims=tuple(dims), layout=text)
        if shape.nbytes > MAX_ARRAY_BYTES:
            raise self.error(f"shape {shape} holds {shape.nbytes:.3g} bytes, over the limit of "
                             f"2^40 (1 TiB) for one array; this is not a shape XLA compiles "
                             f"for a chip")
        return shape

    def instruction(self) -> Instruction:
        is_root = False
        if self.peek() == "ROOT":
            self.next()
            is_root = True
        pos = self.toks[self.i][2] if self.i < len(self.toks) else len(self.text)
        name = self.word("an instruction ('%name = shape opcode(...)')").lstrip("%")
        self.expect("=")
        shape = self.shape()
        opcode = self.word("an opcode")
        self.expect("(")
        operands: list[str] = []
        literal = ""
        if opcode in ("constant", "parameter", "iota") or self.peek() == "{":
            if self.peek() != ")":
                literal = self.skip_balanced()
                while self.peek() == ",":  # constant({1, 2})-style lists at depth 0
                    self.next()
                    literal += "," + self.skip_balanced()
        else:
            while self.peek() != ")":
                # operand: [shape] %name   (long form prints the operand's shape first)
                if self.i + 1 < len(self.toks) and self.toks[self.i][0] == "word" and (
                        self.peek(1) == "[" or self.peek() == "(") and \
                        self.peek() in DTYPE_BYTES:
                    self.shape()
                elif self.peek() == "(":
                    self.shape()
                tok = self.word("an operand name")
                operands.append(tok.lstrip("%"))
                if self.peek() == ",":
                    self.next()
                elif self.peek() != ")":
                    raise self.error("expected ',' or ')' after an operand")
        self.expect(")")
        attrs: dict[str, str] = {}
        while self.peek() == ",":
            self.next()
            key = self.word("an attribute name")
            self.expect("=")
            attrs[key] = self.skip_balanced()
        self.shapes[name] = shape
        return Instruction(name=name, opcode=opcode, shape=shape, operands=tuple(operands),
                           attrs=attrs, literal=literal, is_root=is_root, line=self._line(pos))


def parse_hlo(text: str, *, source: str = "HLO module") -> HloModule:
    """Parse HLO module text (see the module docstring)."""
    if len(text) > MAX_TEXT_BYTES:
        raise TpusimError(
            f"{source} is {len(text) / 2**20:.0f} MiB of HLO text; tpusim reads modules of at "
            f"most {MAX_TEXT_BYTES >> 20} MiB (compile fewer layers or use a scanned model)"
        )
    if "\x00" in text[:4096]:
        raise TpusimError(f"{source} is a binary file, not HLO text; give the text of "
                          f"compiled.as_text()")
    count = sum(1 for _ in _INSTRUCTION_RE.finditer(text))
    if count > MAX_INSTRUCTIONS:
        raise TpusimError(
            f"{source} has {count:,} instructions; tpusim imports modules of at most "
            f"{MAX_INSTRUCTIONS:,} (compile fewer layers or use a scanned model)"
        )
    budget = min(MAX_TOKENS, MAX_TOKENS_PER_INSTRUCTION * max(count, 1000))
    parser = _Parser(text, source, budget)
    with task("HLO parse", total=count, unit="instruction") as parser.task:
        return parser.module()


# -- typed attribute readers ------------------------------------------------------------------
_INT_RE = re.compile(r"-?\d+")


def int_list(text: str) -> tuple[int, ...]:
    """`{1,0}` / `{}` / `1` -> ints."""
    return tuple(int(x) for x in _INT_RE.findall(text))


def replica_groups(text: str, num_devices: int) -> list[list[int]]:
    """`{{0,1},{2,3}}`, `{}` (one group of every device) or the iota form `[a,b]<=[n]` /
    `[a,b]<=[d0,d1]T(1,0)` -> lists of device ids."""
    t = text.strip()
    if t.startswith("mesh"):
        return _mesh_groups(t, num_devices)
    if t.startswith("["):
        m = re.fullmatch(r"\[([\d,\s]+)\]\s*<=\s*\[([\d,\s]+)\](?:\s*T\(([\d,\s]+)\))?", t)
        if not m:
            raise TpusimError(f"replica_groups={t!r} is not an iota list like [2,4]<=[8] or "
                              f"[2,4]<=[4,2]T(1,0)")
        out_dims = int_list(m.group(1))
        reshape = int_list(m.group(2))
        perm = int_list(m.group(3)) if m.group(3) else tuple(range(len(reshape)))
        if sorted(perm) != list(range(len(reshape))):
            raise TpusimError(f"replica_groups={t!r}: T{perm} is not a permutation")
        total = 1
        for d in reshape:
            total *= d
        prod_out = 1
        for d in out_dims:
            prod_out *= d
        if total != prod_out or len(out_dims) != 2:
            raise TpusimError(f"replica_groups={t!r}: the iota list must be [groups,size] with "
                              f"as many devices as [{','.join(map(str, reshape))}] holds")
        if total > num_devices:
            # Checked before the ids are listed: [1,1000000000]<=[1000000000] was expanded
            # into a list of a billion ids (6 GB and growing) before the count was checked.
            raise TpusimError(f"replica_groups={t[:80]!r} lists {total:,} devices but the "
                              f"module has {num_devices:,}")
        # ids = iota(total).reshape(reshape).transpose(perm).reshape(out_dims)
        strides = [1] * len(reshape)
        for k in range(len(reshape) - 2, -1, -1):
            strides[k] = strides[k + 1] * reshape[k + 1]
        tdims = [reshape[p] for p in perm]
        tstrides = [strides[p] for p in perm]
        flat: list[int] = [0]
        for d, s in zip(tdims, tstrides, strict=True):
            flat = [b + k * s for b in flat for k in range(d)]
        g, size = out_dims
        return [flat[i * size:(i + 1) * size] for i in range(g)]
    inner = t[1:-1].strip() if t.startswith("{") and t.endswith("}") else t
    if not inner:
        return [list(range(num_devices))]
    groups = [list(int_list(g)) for g in re.findall(r"\{([^{}]*)\}", inner)]
    if not groups:
        raise TpusimError(f"replica_groups={t[:60]!r} is not a list of groups like {{{{0,1}}}}")
    return groups


def _mesh_groups(t: str, num_devices: int) -> list[list[int]]:
    """`mesh['a'=4,'b'=4] {'b'}`: devices 0..n-1 laid out row-major on the named mesh; a group
    is the devices that differ only along the axes in braces. With `device_ids=(...)` after the
    mesh, mesh position p (row-major) holds device ids[p] instead of p: an explicit list
    `(3,1,2,0)` or an iota `([4,4]T(1,0))` = iota(n) reshaped to [4,4], transposed by (1,0) and
    flattened (the `<=` form's order without its output dims)."""
    m = re.fullmatch(r"mesh\[([^\]]*)\](?:\s*,\s*device_ids=\((.*)\))?\s*\{([^}]*)\}", t)
    axes = re.findall(r"'([^']*)'\s*=\s*(\d+)", m.group(1)) if m else []
    if not m or not axes:
        raise TpusimError(f"replica_groups={t[:80]!r} is not a mesh-axes list like "
                          f"mesh['x'=4,'y'=4] {{'y'}}")
    names = [a for a, _ in axes]
    sizes = [int(n) for _, n in axes]
    chosen = re.findall(r"'([^']*)'", m.group(3))
    if re.search(r"[():]", m.group(3)) or any(c not in names for c in chosen):
        raise TpusimError(f"replica_groups={t[:80]!r}: tpusim reads whole mesh axes only "
                          f"(got {m.group(2)!r}; axes are {names})")
    total = 1
    for n in sizes:
        total *= n
    if total > num_devices:
        raise TpusimError(f"replica_groups={t[:80]!r} lays out {total:,} devices but the module "
                          f"has {num_devices:,}")
    strides = [1] * len(sizes)
    for k in range(len(sizes) - 2, -1, -1):
        strides[k] = strides[k + 1] * sizes[k + 1]
    inside = [k for k in range(len(sizes)) if names[k] in chosen]
    outside = [k for k in range(len(sizes)) if names[k] not in chosen]

    def ids(dims: list[int]) -> list[int]:
        flat = [0]
        for k in dims:
            flat = [b + i * strides[k] for b in flat for i in range(sizes[k])]
        return flat

    groups = [[b + o for o in ids(inside)] for b in ids(outside)]
    if m.group(2) is None:
        return groups
    device = _device_list(m.group(2).strip(), total, t)
    return [[device[p] for p in g] for g in groups]


def _device_list(text: str, total: int, where: str) -> list[int]:
    """A mesh's `device_ids=(...)` content: explicit ids or an iota `[d0,d1]T(perm)`."""
    m = re.fullmatch(r"\[([\d,\s]+)\](?:\s*T\(([\d,\s]+)\))?", text)
    if m:
        dims = int_list(m.group(1))
        perm = int_list(m.group(2)) if m.group(2) else tuple(range(len(dims)))
        n = 1
        for d in dims:
            n *= d
        if sorted(perm) != list(range(len(dims))) or n != total:
            raise TpusimError(f"replica_groups={where[:80]!r}: device_ids=({text}) is not an "
                              f"iota of {total} devices with a permutation")
        strides = [1] * len(dims)
        for k in range(len(dims) - 2, -1, -1):
            strides[k] = strides[k + 1] * dims[k + 1]
        flat: list[int] = [0]
        for p in perm:
            flat = [b + i * strides[p] for b in flat for i in range(dims[p])]
        return flat
    ids = list(int_list(text))
    if not re.fullmatch(r"[\d,\s]+", text) or sorted(ids) != sorted(set(ids)) \
            or len(ids) != total:
        raise TpusimError(f"replica_groups={where[:80]!r}: device_ids=({text[:40]}) must list "
                          f"the mesh's {total} devices once each")
    return ids


def source_target_pairs(text: str) -> list[tuple[int, int]]:
    pairs = []
    for g in re.findall(r"\{([^{}]*)\}", text):
        ids = int_list(g)
        if len(ids) != 2:
            raise TpusimError(f"source_target_pairs entry {{{g}}} is not a pair")
        pairs.append((ids[0], ids[1]))
    return pairs


def backend_config(ins: Instruction) -> dict:
    """The JSON backend config (`backend_config={...}` or a quoted JSON string); {} if absent
    or not JSON."""
    raw = ins.attrs.get("backend_config", "")
    if not raw:
        return {}
    try:
        if raw.startswith('"'):
            raw = json.loads(raw)
        v = json.loads(raw)
    except (ValueError, TypeError):
        return {}
    return v if isinstance(v, dict) else {}


def dot_dims(ins: Instruction) -> dict[str, tuple[int, ...]]:
    return {k: int_list(ins.attrs.get(k, "")) for k in (
        "lhs_batch_dims", "rhs_batch_dims", "lhs_contracting_dims", "rhs_contracting_dims")}


def frontend_attributes(ins: Instruction) -> dict[str, str]:
    raw = ins.attrs.get("frontend_attributes", "")
    return {k: v for k, v in re.findall(r'([\w.\-]+)="((?:[^"\\]|\\.)*)"', raw)}
