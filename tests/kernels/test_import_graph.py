"""The import graph of kernels/: every module imports alone on a CPU-only install, the graph
has no cycle, and nothing under kernels/sm90 imports the entry points (kernels/interface.py)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kernels"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = sorted(_module_name(path) for path in PACKAGE.rglob("*.py"))


def _imported_modules(path: Path) -> set[str]:
    """The kernels.* modules `path` imports, at the top or inside a function (a lazy import is
    still an edge: calling the function needs the module)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from kernels.sm90 import forward` names a module; `from .x import f`, a function.
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {module for module in found if module in MODULES and module != name}


GRAPH = {_module_name(path): _imported_modules(path) for path in PACKAGE.rglob("*.py")}


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of the graph as a list of modules, or [] (depth-first search)."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = "open"
        stack.append(node)
        for successor in sorted(graph.get(node, ())):
            if state.get(successor) == "open":
                return stack[stack.index(successor):] + [successor]
            if successor not in state:
                found = visit(successor)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_the_import_graph_of_kernels_has_no_cycle():
    # A package's __init__ importing its own modules is the package's surface, not a cycle.
    graph = {module: {m for m in imports if not module.startswith(m + ".")}
             for module, imports in GRAPH.items()}
    graph = {module: {m for m in imports if GRAPH.get(m) is not None} for module, imports
             in graph.items()}
    assert _cycle({m: {i for i in imports if not (m == "kernels" or i == "kernels")}
                   for m, imports in graph.items()}) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


def test_no_sm90_module_imports_the_entry_points():
    upward = {module: sorted(imports & {"kernels.interface", "kernels.autograd", "kernels.ops",
                                        "kernels", "kernels.dispatch"})
              for module, imports in GRAPH.items() if module.startswith("kernels.sm90.")}
    assert {module: found for module, found in upward.items() if found} == {}


# Run in a fresh interpreter: for each module, every kernels.* module is dropped from
# sys.modules before it is imported, so it comes in alone (torch and the CuTe DSL stay loaded:
# a fresh interpreter per module took minutes).
_IMPORT_EACH_ALONE = """
import importlib, sys, traceback
failed = []
for module in sys.argv[1:]:
    for name in [n for n in sys.modules if n == "kernels" or n.startswith("kernels.")]:
        del sys.modules[name]
    try:
        importlib.import_module(module)
    except Exception:
        failed.append(module + ": " + traceback.format_exc(limit=3))
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_each_module_imports_alone():
    """Each module of kernels/ imports as the first kernels module (CPU-only install: no GPU
    is asked at import)."""
    result = subprocess.run([sys.executable, "-c", _IMPORT_EACH_ALONE, *MODULES], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
