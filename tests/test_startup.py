"""What the CLI's start-up relies on: numpy's OpenBLAS thread pool is held to one thread by
`sim/cli/__init__.py` (about 0.07 CPU-s of every command, benchmarks/bench_startup.py), which
changes no number only because the product code makes no BLAS call, and works only because the
CLI's modules do not import numpy before it is set."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Builds JAX programs under the jax python (XLA's matmuls, not numpy's).
NOT_NUMPY = {"workloads/hlo/jaxgen.py"}
BLAS = {"dot", "matmul", "einsum", "inner", "tensordot", "vdot", "solve", "inv", "lstsq",
        "eig", "eigh", "svd", "cholesky", "qr", "det", "pinv", "multi_dot"}


def _blas_calls(path: Path) -> list[int]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
            out.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in BLAS:
            out.append(node.lineno)
    return out


def test_the_blas_finder_sees_matmuls_and_linear_algebra(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import numpy as np\na = b @ c\nd = np.dot(a, a)\ne = np.linalg.inv(d)\n"
                   "f = a.sum()\n")
    assert _blas_calls(src) == [2, 3, 4]


def test_no_product_module_calls_blas():
    found = {}
    for pkg in ("sim", "workloads", "topologies"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel not in NOT_NUMPY and _blas_calls(path):
                found[rel] = _blas_calls(path)
    assert found == {}, "a BLAS call: its result could depend on OpenBLAS's thread count, " \
                        "which the CLI sets to one (sim/cli/__init__.py)"


def test_the_cli_sets_one_blas_thread_before_numpy_is_imported():
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    out = subprocess.run(
        [sys.executable, "-c", "import os, sys; import sim.cli; "
         "print('numpy' in sys.modules, os.environ.get('OPENBLAS_NUM_THREADS'))"],
        cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        check=True).stdout.split()
    assert out == ["False", "1"]
    mine = subprocess.run(
        [sys.executable, "-c", "import os; import sim.cli; "
         "print(os.environ['OPENBLAS_NUM_THREADS'])"],
        cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "4"},
        capture_output=True, text=True, check=True).stdout.split()
    assert mine == ["4"]  # the user's own setting wins
