"""The package's layers: the stage layer (core, formats, models, stages, runtime) works without the CLI, the
benchmark sits on top where only the CLI reaches it, and no import circle (counting imports inside functions,
as the old pipeline -> cli one was) joins any two modules."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "powerinfer_tools"
STAGE_LAYER = ("core", "formats", "models", "stages", "runtime")


def module_names() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ("powerinfer_tools",) + path.relative_to(PACKAGE).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """Every module `name` imports, at its top or inside a function: `from a import b` counts as a.b when a.b
    is a module, as a otherwise. Third-party modules count by their top-level name (typer)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {m if m.startswith("powerinfer_tools") else m.split(".")[0] for m in found}


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imports_of(path, name, modules) for name, path in modules.items()}


def layer(name: str) -> str:
    return name.split(".")[1] if name.count(".") else ""


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def cycles(graph: dict[str, set[str]]) -> list[str]:
    return [m for m in graph if m in reachable(graph, m)]


def test_the_stage_layer_reaches_neither_cli_nor_bench_nor_typer():
    graph = import_graph()
    for name in graph:
        if layer(name) in STAGE_LAYER:
            bad = {m for m in reachable(graph, name) if m == "typer" or layer(m) in ("cli", "bench")}
            assert not bad, f"{name} reaches {sorted(bad)}"


def test_only_the_cli_imports_the_benchmark():
    graph = import_graph()
    importers = {name for name, deps in graph.items() if layer(name) != "bench" and any(layer(d) == "bench"
                                                                                         for d in deps)}
    assert importers == {"powerinfer_tools.cli.app"}


def test_core_imports_only_core():
    graph = import_graph()
    for name, deps in graph.items():
        if layer(name) == "core":
            assert {layer(d) for d in deps if d.startswith("powerinfer_tools.")} <= {"core"}, name


def test_no_import_circle():
    assert cycles(import_graph()) == []


def test_the_graph_sees_a_circle_through_a_function_level_import():
    graph = import_graph()
    graph["powerinfer_tools.runtime.default_build"] = graph["powerinfer_tools.runtime.default_build"] | {
        "powerinfer_tools.cli"}   # the old pipeline's `from powerinfer_tools.cli import app`
    assert "powerinfer_tools.runtime.default_build" in cycles(graph)


def test_every_stage_layer_module_imports_with_typer_blocked():
    names = [n for n in module_names() if layer(n) in STAGE_LAYER]
    code = ("import importlib, sys\nsys.modules['typer'] = None  # import typer now raises ImportError\n"
            f"for name in {names!r}:\n    importlib.import_module(name)\n"
            "assert 'typer' not in sys.modules or sys.modules['typer'] is None\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr
    assert len(names) > 30
