"""The layers hold: fedcore and its tests import no orchestration, no module imports in a cycle, and no module
imports another's private names. Every import counts, a function's own imports included."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parents[2]
STACK = ("prefect", "ray", "mlflow", "hydra", "omegaconf", "dvc", "flows")


def _modules(packages: List[str]) -> Dict[str, Path]:
    out = {}
    for pkg in packages:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imports(path: Path) -> List[ast.AST]:
    return [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.Import, ast.ImportFrom))]


def _graph(mods: Dict[str, Path]) -> Dict[str, Set[str]]:
    edges: Dict[str, Set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        for node in _imports(path):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    target = target if target in mods else node.module
                    if target in mods and target != m:
                        edges[m].add(target)
            elif isinstance(node, ast.Import):
                edges[m].update(a.name for a in node.names if a.name in mods and a.name != m)
    return edges


def _cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_in_fedcore_or_flows():
    # Prepare
    edges = _graph(_modules(["fedcore", "flows"]))

    # Execute
    cycles = _cycles(edges)

    # Assert
    assert not cycles, f"import cycles: {cycles}"


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_a_private_name_from_another():
    bad = []
    for m, path in _modules(["fedcore", "flows"]).items():
        for node in _imports(path):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("fedcore", "flows"):
                bad += [
                    f"{m}: from {node.module} import {a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
    assert not bad, "\n".join(bad)


def test_fedcore_and_its_tests_import_no_orchestration():
    files = [*_modules(["fedcore"]).values(), *(ROOT / "tests" / "fedcore").rglob("*.py")]
    bad = []
    for path in files:
        for node in _imports(path):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            bad += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in STACK]
    assert not bad, "\n".join(bad)


# flows/ by job, lowest first: a module may import from its own layer and the ones below, never above.
FLOWS_LAYERS = [{"config", "systems"}, {"services"}, {"reports"}, {"runs"}, {"stages"}]


def _flows_layer(module: str) -> int:
    job = module.split(".")[1]
    return next(i for i, jobs in enumerate(FLOWS_LAYERS) if job in jobs)


def test_flows_is_split_by_job_with_the_command_line_alone_at_the_top():
    top = sorted(p.name for p in (ROOT / "flows").glob("*.py"))
    jobs = sorted(p.parent.name for p in (ROOT / "flows").glob("*/__init__.py"))
    assert top == ["__init__.py", "stages.py"], f"modules outside a job's sub-package: {top}"
    assert jobs == sorted(set().union(*FLOWS_LAYERS) - {"stages"})


def test_no_module_in_flows_imports_from_a_layer_above_its_own():
    # Prepare
    edges = _graph({m: p for m, p in _modules(["flows"]).items() if m != "flows"})

    # Execute
    upward = [f"{a} -> {b}" for a, bs in edges.items() for b in bs if _flows_layer(b) > _flows_layer(a)]

    # Assert
    assert not upward, "\n".join(sorted(upward))


def test_the_layer_check_sees_an_upward_import():
    assert _flows_layer("flows.services.tracking") < _flows_layer("flows.runs.rounds")
    assert _flows_layer("flows.config.compose") == _flows_layer("flows.systems.base")
