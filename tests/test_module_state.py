"""No module-level mutable state in the product: a run's answer depends on its request (and seed)
alone, never on what ran before it in the same process. Read from the source with `ast`.

What counts: a `global` statement; a module attribute assigned from outside (`progress.QUIET =
True`); a random generator built at module level; and a module-level container that a function
mutates. Two kinds of the last are allowed and named here, so a new one is a decision: memo
caches of pure functions (keyed on every input, bounded, so a hit returns what a miss would
compute), and registries filled while their module is imported (then only read)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("sim", "workloads", "topologies")

# Memo caches of pure functions: the same key always maps to the same value, and each is bounded
# (cleared or evicted past a size), so what they hold never changes an answer.
MEMO_CACHES = {
    "_SHARE_GRIDS",  # the simplex grid for k parts: k <= 3 in a 3-D torus, so at most 2 entries
    "_DIRECT_SKELETONS", "_SCHEDULE_CACHE", "_COST_CACHE", "_STAGE_CACHE", "_CHUNK_CACHE",
    "_GRID_CACHE", "_TRACE_CACHE",
}
# Registries filled by module-level calls while their module is imported, read-only afterwards.
IMPORT_TIME_REGISTRIES = {"MODEL_SOURCES", "MODEL_ALIASES"}

_MUTATORS = {"append", "extend", "update", "setdefault", "add", "pop", "clear", "insert",
             "remove", "discard", "popitem", "move_to_end", "appendleft", "__setitem__"}
_CONTAINER_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque",
                    "WeakValueDictionary", "WeakKeyDictionary"}
_RNG_CALLS = {"Random", "default_rng", "RandomState", "SystemRandom"}


def _call_name(node: ast.AST) -> str:
    if not isinstance(node, ast.Call):
        return ""
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _module_assignments(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        for t in targets:
            if isinstance(t, ast.Name):
                yield t.id, value, node.lineno


def state_offences(source: str, where: str = "<src>") -> list[str]:
    """Every use of module-level mutable state in `source` (see the module docstring)."""
    tree = ast.parse(source)
    out = []
    containers = set()
    imported_modules = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            imported_modules |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            # `from sim import progress` binds a module as often as a value; either may be
            # assigned through, and neither should be.
            imported_modules |= {a.asname or a.name for a in node.names}
    for name, value, line in _module_assignments(tree):
        if _call_name(value) in _RNG_CALLS:
            out.append(f"{where}:{line} {name}: a random generator at module level")
        if (isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp,
                               ast.SetComp)) or _call_name(value) in _CONTAINER_CALLS):
            containers.add(name)
    mutable = containers - MEMO_CACHES - IMPORT_TIME_REGISTRIES
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        local = {a.arg for a in fn.args.args + fn.args.kwonlyargs + fn.args.posonlyargs}
        for node in ast.walk(fn):
            if isinstance(node, ast.Global):
                out.append(f"{where}:{node.lineno} global {', '.join(node.names)}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and isinstance(node.func.value, ast.Name) and node.func.value.id in mutable
                  and node.func.value.id not in local and node.func.attr in _MUTATORS):
                out.append(f"{where}:{node.lineno} {node.func.value.id}.{node.func.attr}()")
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) \
                    else [node.target]
                for t in targets:
                    if (isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)
                            and t.value.id in mutable and t.value.id not in local):
                        out.append(f"{where}:{node.lineno} {t.value.id}[...] changed")
                    if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                            and t.value.id in imported_modules and t.value.id not in local):
                        out.append(f"{where}:{node.lineno} {t.value.id}.{t.attr} assigned")
    return out


def test_the_state_finder_finds_each_kind():
    src = (
        "import random\nfrom sim import progress\n"
        "RNG = random.Random(1)\nSEEN = {}\nLOG = []\nCOUNT = 0\n"
        "def f(k):\n    global COUNT\n    COUNT += 1\n    SEEN[k] = 1\n    LOG.append(k)\n"
        "    progress.QUIET = True\n"
        "def g(LOG):\n    LOG.append(1)\n"  # a parameter shadows the module's name
    )
    found = state_offences(src)
    assert sorted(o.split(" ", 1)[1] for o in found) == sorted([
        "RNG: a random generator at module level", "global COUNT", "SEEN[...] changed",
        "LOG.append()", "progress.QUIET assigned"])


def test_a_memo_cache_of_a_pure_function_is_allowed():
    src = "_COST_CACHE = {}\ndef cost(k):\n    _COST_CACHE[k] = k * 2\n    return k * 2\n"
    assert state_offences(src) == []


def test_no_module_level_mutable_state_in_the_product():
    offences = []
    for pkg in LIBRARY:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            offences += state_offences(path.read_text(encoding="utf-8"),
                                       path.relative_to(ROOT).as_posix())
    assert offences == []


def test_every_allowed_cache_and_registry_still_exists():
    # An allowance for a name that is gone would quietly cover a new one of that name.
    names = set()
    for pkg in LIBRARY:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            names |= {n for n, _v, _l in _module_assignments(ast.parse(path.read_text()))}
    assert sorted((MEMO_CACHES | IMPORT_TIME_REGISTRIES) - names) == []
