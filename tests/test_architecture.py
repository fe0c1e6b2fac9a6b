"""The shape of the code: imports run one way (no circles), and nothing below the CLI parses
command lines. Read from the source with `ast`, nothing is imported."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sim", "workloads", "topologies", "validation")
# The product's library: below every front end. (`validation/` holds scripts with command lines
# of their own, and its CLI fuzzer drives `tpusim` on purpose: it sits above, like the CLI.)
LIBRARY = ("sim", "workloads", "topologies")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _imports(path: Path) -> list[tuple[str, int]]:
    """Every module named by an import of the file (at any depth, in functions too), with its
    line: `from a.b import c` names `a.b` and `a.b.c` (a submodule when there is one). Imports
    under `if TYPE_CHECKING:` never run and are left out."""
    out = []
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
                   for stmt in node.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, node.lineno))
            out += [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
    return out


def import_graph() -> dict[str, set[str]]:
    """Project module -> the project modules it imports. Importing a package's submodule
    (`from sim.cli import common`) is an arrow to the submodule, not to the package that
    contains the importer."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        for name, _line in _imports(path):
            r = resolve(name)
            if r is not None and r != m and not m.startswith(r + "."):
                graph[m].add(r)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles_in_the_project():
    graph = import_graph()
    assert len(graph) > 50
    assert circles(graph) == []


def test_nothing_below_the_cli_parses_command_lines():
    # The library takes typed requests; argv and argparse belong to `sim/cli/` alone.
    offenders = []
    for m, path in _modules().items():
        if m == "sim.cli" or m.startswith("sim.cli.") or m.split(".")[0] not in LIBRARY:
            continue
        text = path.read_text(encoding="utf-8")
        for name, line in _imports(path):
            if name == "argparse" or name.startswith("argparse."):
                offenders.append(f"{m}:{line} imports argparse")
        if "sys.argv" in text:
            offenders.append(f"{m} reads sys.argv")
    assert offenders == []


def test_the_library_never_imports_the_cli():
    graph = import_graph()
    # `python -m sim` (sim/__main__.py) is the command itself.
    below = {m: deps for m, deps in graph.items()
             if not m.startswith("sim.cli") and m != "sim.__main__"
             and m.split(".")[0] in LIBRARY}
    bad = sorted(f"{m} -> {d}" for m, deps in below.items() for d in deps
                 if d == "sim.cli" or d.startswith("sim.cli."))
    assert bad == []


# Which executor times a step is decided in one place: `sim/engine/executors.py`'s table
# (`choose_executor`). Everything else asks it (`simulate_step`, `simulate_chips`) and never
# calls an executor's entry point itself.
EXECUTOR_ENTRY_POINTS = {"sim.engine.replay.replay", "sim.engine.class_engine.run_classes",
                         "sim.engine.vector_engine.run_vectors"}


def test_only_the_executor_table_calls_the_executors():
    found = {}
    for m, path in _modules().items():
        if m == "sim.engine.executors":
            continue
        hits = [f"{name}:{line}" for name, line in _imports(path)
                if name in EXECUTOR_ENTRY_POINTS]
        if hits:
            found[str(path.relative_to(ROOT))] = hits
    assert found == {}, "run a step through sim.engine.executors (simulate_step, simulate_chips)"


# A rate as achieved is a property of the spec (`ChipSpec.eff_*`, `unit_rate`): no module
# multiplies a raw rate by its efficiency or by the clock itself.
def _rate_products(path: Path) -> list[int]:
    """Lines of products (a * b * ...) of a `*_per_s` attribute and an `*_efficiency` or
    `clock_scale` attribute."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    inner = {id(n.left) for n in ast.walk(tree)
             if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult)}
    inner |= {id(n.right) for n in ast.walk(tree)
              if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult)}
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)) or id(node) in inner:
            continue
        stack, names = [node], []
        while stack:
            n = stack.pop()
            if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult):
                stack += [n.left, n.right]
            elif isinstance(n, ast.Attribute):
                names.append(n.attr)
        if any(a.endswith("_per_s") for a in names) and any(
                a.endswith("_efficiency") or a == "clock_scale" for a in names):
            out.append(node.lineno)
    return out


def test_the_rate_product_finder_finds_a_rate_times_its_efficiency(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("a = chip.hbm_bytes_per_s * chip.hbm_efficiency\nb = chip.clock_scale * 2\n"
                 "c = x * chip.mxu_flops_per_s * chip.clock_scale * y\n")
    assert _rate_products(f) == [1, 3]


def test_rates_as_achieved_come_from_the_spec():
    found = {str(path.relative_to(ROOT)): lines for m, path in _modules().items()
             if m.split(".")[0] in LIBRARY and m != "sim.hardware"
             and (lines := _rate_products(path))}
    assert found == {}, "use ChipSpec's eff_* properties (or unit_rate)"


# Rooms of a size one can read: a product module of at most MAX_MODULE_LINES lines, a function
# of at most MAX_FUNCTION_LINES unless the comment block right above its `def` (or its
# decorators) starts with `# Long:` and says why (a hot loop kept in one frame for speed, say).
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 120
# Still to split (the architecture issue's move is under way): each entry goes when its room
# is split; the test fails on an entry that is no longer needed, so the lists only shrink.
PENDING_MODULES: set[str] = set()
PENDING_FUNCTIONS: set[str] = set()


def _long_functions(path: Path) -> list[tuple[str, int]]:
    """(name, lines) of every function over MAX_FUNCTION_LINES without a `# Long:` comment."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out = []
    for node in ast.walk(ast.parse("\n".join(lines))):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        length = node.end_lineno - node.lineno + 1
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        top = first - 1  # the comment block right above: its first line must say `# Long:`
        while top >= 1 and lines[top - 1].strip().startswith("#"):
            top -= 1
        above = lines[top].strip() if top < first - 1 else ""
        if length > MAX_FUNCTION_LINES and not above.startswith("# Long:"):
            out.append((node.name, length))
    return out


def test_the_long_function_finder_honours_a_why_comment(tmp_path):
    body = "\n".join(f"    x = {i}" for i in range(MAX_FUNCTION_LINES))
    plain = tmp_path / "plain.py"
    plain.write_text(f"def f():\n{body}\n")
    said = tmp_path / "said.py"
    said.write_text(f"# Long: one frame\n# for speed\n@staticmethod\ndef f():\n{body}\n")
    assert _long_functions(plain) == [("f", MAX_FUNCTION_LINES + 1)]
    assert _long_functions(said) == []


def test_no_product_module_or_function_is_too_long_to_read():
    big, long_fns = set(), set()
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if len(path.read_text(encoding="utf-8").splitlines()) > MAX_MODULE_LINES:
                big.add(rel)
            long_fns |= {f"{rel}:{name}" for name, _n in _long_functions(path)}
    assert sorted(big - PENDING_MODULES) == [], f"modules over {MAX_MODULE_LINES} lines"
    assert sorted(long_fns - PENDING_FUNCTIONS) == [], (
        f"functions over {MAX_FUNCTION_LINES} lines with no `# Long:` comment above")
    assert sorted(PENDING_MODULES - big) == [] and sorted(PENDING_FUNCTIONS - long_fns) == [], (
        "split already: drop from the PENDING lists")


# Below the CLI nothing spells a command-line flag: a library error names the Python argument
# (a `{name}` placeholder of `TpusimError`, which the CLI renders as the flag), docs name
# settings by their Python names. Comments may still say what a setting is on the command line.
# XLA's own flags (`--xla_dump_to`) are no tpusim flags.
FLAG_TEXT = re.compile(r"(?<![\w-])--(?!xla_)[a-z][a-z0-9-]*")
# Still to convert: each entry goes when its module names no flag in its strings; the test
# fails on an entry that is no longer needed, so the set only shrinks.
PENDING_FLAG_TEXT: set[str] = set()  # every module converted


def _flag_text(path: Path) -> list[tuple[int, str]]:
    """(line, flag) of every `--flag` in a string of the module (docstrings and the literal
    parts of f-strings included; comments are not strings)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            out += [(node.lineno, m) for m in FLAG_TEXT.findall(node.value)]
    return sorted(out)


def test_the_flag_text_finder_reads_strings_not_comments(tmp_path):
    src = tmp_path / "m.py"
    src.write_text('"""Doc naming --seq-len."""\n# a comment naming --mesh\n'
                   'x = f"{y} --dead-link {z}"\nw = "a-b --x9 c--d -- e --xla_dump_to"\n')
    assert [f for _l, f in _flag_text(src)] == ["--seq-len", "--dead-link", "--x9"]


def test_nothing_below_the_cli_spells_a_flag():
    found: dict[str, list[str]] = {}
    for m, path in _modules().items():
        if m == "sim.cli" or m.startswith("sim.cli.") or m.split(".")[0] not in LIBRARY:
            continue
        rel = path.relative_to(ROOT).as_posix()
        hits = _flag_text(path)
        if hits:
            found[rel] = [f"{line}: {flag}" for line, flag in hits]
    new = {rel: hits[:5] for rel, hits in found.items() if rel not in PENDING_FLAG_TEXT}
    assert new == {}, "flag text below the CLI: name the Python argument (TpusimError's " \
                      "{name} placeholders, ARCHITECTURE.md)"
    assert sorted(PENDING_FLAG_TEXT - set(found)) == [], \
        "converted already: drop from PENDING_FLAG_TEXT"


# An import inside a function says why it is there (start-up time of the CLI, a heavy optional
# dependency, an import circle): a comment on its line, or on the line above it (or above the
# run of imports it belongs to). An import at the top of the module needs no reason.


def _unsaid_imports(path: Path) -> list[int]:
    """Lines of the function-level imports of project modules with no comment saying why."""
    lines = path.read_text(encoding="utf-8").splitlines()
    tree = ast.parse("\n".join(lines))

    def project(node: ast.stmt) -> bool:
        if isinstance(node, ast.Import):
            return any(a.name.split(".")[0] in PACKAGES for a in node.names)
        return (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None
                and node.module.split(".")[0] in PACKAGES)

    def said(node: ast.stmt) -> bool:
        own = any("#" in lines[i - 1] for i in range(node.lineno, node.end_lineno + 1))
        return own or (node.lineno > 1 and lines[node.lineno - 2].strip().startswith("#"))

    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            for field in ("body", "orelse", "finalbody"):
                stmts = getattr(node, field, None)
                if not isinstance(stmts, list) or node is not fn and isinstance(
                        node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                run_said = False  # a run of imports under one comment is said as a whole
                for prev, stmt in zip([None, *stmts], stmts, strict=False):
                    if not isinstance(stmt, (ast.Import, ast.ImportFrom)):
                        continue
                    joined = isinstance(prev, (ast.Import, ast.ImportFrom))
                    run_said = said(stmt) or (joined and run_said)
                    if project(stmt) and not run_said:
                        out.append(stmt.lineno)
    return sorted(set(out))


def test_the_unsaid_import_finder_reads_comments(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import sim\n\n\ndef f():\n    import sim.api\n    import json\n\n\n"
                   "def g():\n    # deferred: start-up\n    import sim.api\n    from sim import x\n"
                   "    y = 1\n    import sim.runs  # deferred: start-up\n    import sim.cli\n"
                   "    y = 2\n    if y:\n        from workloads import z\n")
    assert _unsaid_imports(src) == [5, 18]


def test_every_function_level_import_says_why():
    found = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            unsaid = _unsaid_imports(path)
            if unsaid:
                found[rel] = unsaid
    assert {rel: lines[:5] for rel, lines in found.items()} == {}, \
        "an import inside a function needs a comment saying why (on its line or the line " \
        "above), or move it to the top of the module"


def _meta_key_reads(path: Path) -> list[tuple[int, str]]:
    """(line, key) of every read of a trace's metadata by string key: `x.meta["key"]`,
    `x.meta.get("key")`, `"key" in x.meta`, and the same on a name bound to `x.meta`
    (`meta = trace.meta`) in the function (or module) that binds it."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    scopes = [tree] + [n for n in ast.walk(tree)
                       if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    out = set()

    def own(scope: ast.AST):
        """The scope's nodes, without the bodies of the functions nested in it."""
        todo = list(ast.iter_child_nodes(scope))
        while todo:
            n = todo.pop()
            yield n
            if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                todo += ast.iter_child_nodes(n)

    for scope in scopes:
        aliases = {t.id for n in own(scope) if isinstance(n, ast.Assign)
                   and isinstance(n.value, ast.Attribute) and n.value.attr == "meta"
                   for t in n.targets if isinstance(t, ast.Name)}

        def is_meta(e: ast.AST) -> bool:
            return (isinstance(e, ast.Attribute) and e.attr == "meta") or (
                isinstance(e, ast.Name) and e.id in aliases)  # noqa: B023

        def key(e: ast.AST) -> str | None:
            return e.value if isinstance(e, ast.Constant) and isinstance(e.value, str) else None

        for n in own(scope):
            if isinstance(n, ast.Subscript) and is_meta(n.value) and key(n.slice):
                out.add((n.lineno, key(n.slice)))
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) \
                    and n.func.attr == "get" and is_meta(n.func.value) and n.args \
                    and key(n.args[0]):
                out.add((n.lineno, key(n.args[0])))
            elif isinstance(n, ast.Compare) and key(n.left) and any(
                    isinstance(o, (ast.In, ast.NotIn)) for o in n.ops) \
                    and any(is_meta(c) for c in n.comparators):
                out.add((n.lineno, key(n.left)))
    return sorted(out)


def test_the_meta_key_finder_finds_reads_on_the_attribute_and_on_its_alias(tmp_path):
    src = tmp_path / "m.py"
    src.write_text('def f(t, doc):\n    a = t.meta["batch"]\n    meta = t.meta\n'
                   '    b = meta.get("kind")\n    c = "moe" in meta\n    d = doc["meta"]\n'
                   '    e = t.meta.batch\n\n\ndef g(meta):\n    return meta["x"]\n')
    assert _meta_key_reads(src) == [(2, "batch"), (4, "kind"), (5, "moe")]


def test_product_code_reads_trace_meta_by_attribute_not_by_string_key():
    # `Trace.meta` is a `TraceMeta` (workloads/trace_meta.py): its fields are attributes, and a
    # string key would be a typo the type checker cannot see (and a TypeError at run time).
    found = {path.relative_to(ROOT).as_posix(): hits for path in _modules().values()
             if (hits := _meta_key_reads(path))}
    assert found == {}


# A name another module uses is public API of its module: no project module imports an
# underscore name from another (`from sim.engine.summary import _summarize`). Still to rename:
# each entry goes when its module imports no such name; the set only shrinks.
PENDING_PRIVATE_IMPORTS: set[str] = set()


def _private_imports(path: Path) -> list[str]:
    """`module.name` of every underscore name the file imports from a project module."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] in PACKAGES:
            out += [f"{node.module}.{a.name}" for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")]
    return out


def test_the_private_import_finder_reads_from_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from sim.engine.summary import _summarize, summarize\n"
                 "from numpy import _private\nfrom sim import __version__\n")
    assert _private_imports(f) == ["sim.engine.summary._summarize"]


def test_no_module_imports_another_modules_private_names():
    found = {str(path.relative_to(ROOT)): names for path in _modules().values()
             if (names := _private_imports(path))}
    new = {rel: names for rel, names in found.items() if rel not in PENDING_PRIVATE_IMPORTS}
    assert new == {}, "a name used by another module is public: drop its underscore"
    assert sorted(PENDING_PRIVATE_IMPORTS - set(found)) == [], \
        "renamed already: drop from PENDING_PRIVATE_IMPORTS"
