"""The package's shape (CONTRIBUTING.md, "Layout"): one job per room.

Guards against the drift that made `server/app.py` an 800-line file: no module over 400
lines, no function over 60, and no import cycle between the package's modules, lazy imports
(inside functions) included, found by reading the source with `ast`.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "minivllm"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports anywhere in its source (top level or lazily)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for target in targets:
            while target and target not in known:  # `from pkg import mod` or `from mod import f`
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def test_no_module_is_over_400_lines() -> None:
    long = {
        name: n
        for name, path in _modules().items()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_is_over_60_lines() -> None:
    long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name} ({n} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_no_import_cycles() -> None:
    modules = _modules()
    known = set(modules)
    graph = {name: _imports(name, path, known) for name, path in modules.items()}
    # A package's __init__ importing its own submodules is how packages re-export; edges
    # from a module to its own parent package are not cycles of ideas.
    for name in graph:
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".")}
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_engine_core_imports_neither_torch_nor_the_server_nor_the_lab() -> None:
    """CONTRIBUTING.md: scheduling and paging are pure Python; the engine never imports its UIs."""
    modules = _modules()
    for name in [
        "minivllm.engine.sequence",
        "minivllm.engine.block_manager",
        "minivllm.engine.scheduler",
        "minivllm.engine.llm_engine",
        "minivllm.engine.tracing",
        "minivllm.config",
    ]:
        source = modules[name].read_text()
        tree = ast.parse(source)
        top = {
            a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names
        }
        top |= {(n.module or "").split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom)}
        assert "torch" not in top, f"{name} imports torch at module level"
    for name, path in modules.items():
        if name.startswith("minivllm.engine"):
            bad = {
                t
                for t in _imports(name, path, set(modules))
                if t.startswith(("minivllm.server", "minivllm.lab"))
            }
            assert not bad, f"{name} imports {bad}"
