"""The package's shape (CONTRIBUTING.md, "Layout"): one job per room.

Guards against the drift that made `server/app.py` an 800-line file: no module over 400
lines, no function over 60, no import cycle between the package's modules, and every import
pointing down the floors (helpers -> layers -> models -> engine -> the API -> the lab, the
benchmarks, the server -> scale -> the CLI), lazy imports (inside functions) included, found by
reading the source with `ast`. Inside those floors: the engine core never imports its runtime
(engine/runtime/), the server reaches the engine only through that runtime, and the server's
API packages (openai/, responses/, anthropic/) point one way.
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
    return {target for target, _ in _import_lines(name, path, known)}


def _import_lines(name: str, path: Path, known: set[str]) -> set[tuple[str, int]]:
    """(package module, line) for each import in `name`'s source, top level or lazy."""
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
                found.add((target, node.lineno))
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
        "minivllm.engine.engine_output",
        "minivllm.engine.runtime.output_processor",
        "minivllm.engine.runtime.engine_loop",
        "minivllm.config",
        "minivllm.heap",
        "minivllm.tokenizer",
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


# The floors (STYLE.md, "Imports point down"): which of the package's top-level units (a
# subpackage, a module beside them, or `minivllm` itself, the public API) each may import.
# The ground helpers may use each other (the cycle test keeps that honest); a helper that a
# higher floor and a lower one both need moves down here, as `paging.blocks_for` did.
HELPERS = {
    "cache",
    "lora_request",
    "config",
    "heap",  # malloc_trim, after a load (the HTTP process's too: torch-free)
    "startup",  # start-up phases' log lines (the CLI's and the engine's: torch-free)
    "tokenizer",  # the HTTP process loads it: torch-free
    "distributed",  # the ranks' state and head split; the TP executor is in engine/
    "logprobs",
    "outputs",
    "paging",
    "pooling_params",
    "sampling_params",
    "structured",
}
BELOW_THE_API = HELPERS | {"layers", "models", "engine"}
API = {"minivllm", "llm"}  # `from minivllm import LLM`
MAY_IMPORT: dict[str, set[str]] = {
    **{helper: HELPERS for helper in HELPERS},
    "layers": HELPERS,
    "models": HELPERS | {"layers"},
    "engine": HELPERS | {"layers", "models"},
    "minivllm": BELOW_THE_API | API,
    "llm": BELOW_THE_API | API,
    "lab": BELOW_THE_API | API,
    "bench": BELOW_THE_API | API,
    "server": BELOW_THE_API | API | {"lab"},  # `serve --lab` mounts the lab
    "scale": BELOW_THE_API | API | {"server"},
    "cli": BELOW_THE_API | API | {"lab", "bench", "server", "scale"},
}


def _unit(module: str) -> str:
    """The top-level unit a module belongs to: `minivllm.engine.scheduler` -> `engine`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_every_import_points_down_the_floors() -> None:
    """A lower floor never imports a higher one (the layers nothing from the engine, the
    engine nothing from the server), lazy imports included; a new unit must take a floor."""
    modules = _modules()
    known = set(modules)
    homeless = sorted({_unit(name) for name in modules} - set(MAY_IMPORT))
    assert not homeless, f"top-level units without a floor (add them to MAY_IMPORT): {homeless}"
    upward = []
    for name, path in sorted(modules.items()):
        unit = _unit(name)
        for target, line in sorted(_import_lines(name, path, known)):
            if _unit(target) != unit and _unit(target) not in MAY_IMPORT[unit]:
                where = path.relative_to(PACKAGE.parent)
                upward.append(f"{where}:{line} imports {target} ({unit} may not import it)")
    assert not upward, "imports that point up a floor:\n" + "\n".join(upward)


def _imports_of(prefix: str) -> dict[str, set[str]]:
    """The package modules each module under `prefix` imports (lazily or not)."""
    modules = _modules()
    known = set(modules)
    return {
        name: _imports(name, path, known)
        for name, path in modules.items()
        if name == prefix or name.startswith(prefix + ".")
    }


def _within(module: str, prefixes: set[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


RUNTIME = "minivllm.engine.runtime"


def test_the_engine_core_never_imports_its_runtime() -> None:
    """The runtime (engine loop, async engine, engine process, output processor) drives the
    engine core from above: nothing else in engine/ imports it."""
    upward = {
        f"{name} imports {target}"
        for name, targets in _imports_of("minivllm.engine").items()
        if not _within(name, {RUNTIME})
        for target in targets
        if _within(target, {RUNTIME})
    }
    assert not upward, sorted(upward)


# What server/ may see of the layers below it: the runtime (its client, streams and errors)
# and the seams the runtime hands it: request building, the engine it wraps, finish reasons
# and the speculative counters' names. Never the scheduler, the runner, the layers or a model.
SERVER_SEES = {
    RUNTIME,
    "minivllm.engine.requests",
    "minivllm.engine.llm_engine",
    "minivllm.engine.sequence",
    "minivllm.engine.spec_decode",
}


def test_the_server_reaches_the_engine_only_through_its_runtime() -> None:
    """server/ holds HTTP: a request goes server -> runtime -> engine and never back."""
    inner = {"minivllm.engine", "minivllm.layers", "minivllm.models"}
    reached = {
        f"{name} imports {target}"
        for name, targets in _imports_of("minivllm.server").items()
        for target in targets
        # `from minivllm.engine import requests` names the package too: only its modules count
        if _within(target, inner) and target not in inner and not _within(target, SERVER_SEES)
    }
    assert not reached, sorted(reached)


# The engine's insides, by attribute: the server asks the engine or its runtime, never these.
ENGINE_INSIDES = {"scheduler", "block_manager", "model_runner", "runner"}


def test_the_server_reads_no_engine_insides() -> None:
    """No `x.scheduler`, `x.block_manager`, `x.model_runner` or `x.runner` in server/: an import
    floor cannot see an attribute reach into an engine the runtime handed over."""
    reaches = {
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno} .{node.attr}"
        for name, path in _modules().items()
        if name.startswith("minivllm.server")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in ENGINE_INSIDES
    }
    assert not reaches, sorted(reaches)


def test_the_server_is_split_by_api() -> None:
    """server/openai/ is the base API; responses/ and anthropic/ build on it, never on each
    other; the shared HTTP bits (errors, middleware, metrics) import no API package."""
    apis = {f"minivllm.server.{api}" for api in ("openai", "responses", "anthropic")}
    allowed = {
        "minivllm.server.openai": set(),
        "minivllm.server.responses": {"minivllm.server.openai"},
        "minivllm.server.anthropic": {"minivllm.server.openai"},
        "minivllm.server.errors": set(),
        "minivllm.server.middleware": set(),
        "minivllm.server.metrics": set(),
    }
    crossed = set()
    for owner, may in allowed.items():
        for name, targets in _imports_of(owner).items():
            for target in targets:
                if _within(target, apis - {owner} - may):
                    crossed.add(f"{name} imports {target}")
    assert not crossed, sorted(crossed)


def test_the_cli_parser_imports_no_torch() -> None:
    """`minivllm serve` builds every command's parser before it starts the engine process:
    importing torch there (0.8 s, through the bench commands' imports) delayed every start."""
    import subprocess
    import sys

    code = (
        "import sys; from minivllm.cli import build_parser; build_parser(); "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
