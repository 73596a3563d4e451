"""The ``bench`` package's import structure: every module imports in a fresh interpreter, the
imports between its modules form no cycle, the serving experiments and the baseline servers do
not import each other (a launcher starts ``python -m bench.baselines``; bench/launch.py holds what
both sides of a server start share), and no module imports another's private names.

The graph is read from the source (every ``import`` statement, those inside functions included),
so a lazy import cannot hide a cycle. bench/archive/ (one-off scripts kept for the record, some of
which run when imported) is parsed, not imported.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
ARCHIVE = BENCH / "archive"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def bench_modules() -> dict[str, Path]:
    """Every module of the package by dotted name (``bench.serving`` is its ``__init__.py``)."""
    return {module_name(p): p for p in sorted(BENCH.rglob("*.py"))}


def imported_bench_names(path: Path, modules: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """(bench module imported, names taken from it) for every import statement of ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.split(".")[0] == "bench"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] != "bench":
                continue
            for a in node.names:  # `from bench import replay` imports the module bench.replay
                sub = f"{node.module}.{a.name}"
                out.append((sub, []) if sub in modules else (node.module, [a.name]))
    return out


def import_graph() -> dict[str, set[str]]:
    modules = bench_modules()
    graph = {}
    for name, path in modules.items():
        deps = {dep for dep, _ in imported_bench_names(path, modules)}
        unknown = deps - set(modules)
        assert not unknown, f"{path}: imports {sorted(unknown)}, not modules of bench/"
        graph[name] = deps - {name}
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in graph[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_bench_imports_form_no_cycle():
    graph = import_graph()
    for name in graph:
        assert name not in reachable(graph, name), f"{name} imports itself through {sorted(reachable(graph, name))}"


def test_serving_and_baselines_do_not_import_each_other():
    graph = import_graph()
    serving = {n for n in graph if n == "bench.serving" or n.startswith("bench.serving.")}
    assert serving and not (reachable(graph, "bench.baselines") & serving)
    for name in serving:
        assert "bench.baselines" not in reachable(graph, name), name
    assert "bench.launch" in reachable(graph, "bench.serving.servers")


def test_no_private_names_cross_bench_modules():
    modules = bench_modules()
    for path in modules.values():
        for dep, names in imported_bench_names(path, modules):
            private = [n for n in names if n.startswith("_")]
            assert not private, f"{path} imports {private} from {dep}"


def test_every_bench_module_imports_in_a_fresh_interpreter():
    names = [n for n, p in bench_modules().items() if ARCHIVE not in p.parents and p.name != "__main__.py"]
    code = (
        "import importlib, json, sys\n"
        "failed = {}\n"
        f"for name in {names!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as e:\n"
        "        failed[name] = repr(e)\n"
        "print(json.dumps(failed))\n"
    )
    path = [str(REPO), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(path)}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {}
    assert len(names) > 20  # the package's modules were found


def test_archived_scripts_compile():
    """They are kept to be rerun: each compiles, and import_graph() found every bench module it names."""
    archived = sorted(ARCHIVE.rglob("*.py"))
    assert archived
    for path in archived:
        compile(path.read_text(), str(path), "exec")
