"""The shape of the code: imports run one way (no circles), and nothing below the CLI parses
command lines. Read from the source with `ast`, nothing is imported."""

from __future__ import annotations

import ast
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
