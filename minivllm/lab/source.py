"""The code pane's data: the real source of the function that holds a traced line.

Only files of the `minivllm` package are served, read from the installed package itself, so
the pane shows exactly the code that ran.
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

from minivllm.engine.tracing import PACKAGE_ROOT


class SourceNotFound(ValueError):
    """The location is malformed or outside the minivllm package."""


def function_source(location: str) -> dict[str, object]:
    """The innermost function around `location` ("minivllm/engine/scheduler.py:LINE").

    Returns {"file", "line", "function", "start", "lines"}: `lines` are the function's source
    lines, the first of which is line `start` of the file.
    """
    file, sep, line_text = location.rpartition(":")
    if not sep or not line_text.isdigit():
        raise SourceNotFound(f"expected 'minivllm/path.py:LINE', got {location!r}")
    line = int(line_text)
    path = (PACKAGE_ROOT / file).resolve()
    package = (PACKAGE_ROOT / "minivllm").resolve()
    if package not in path.parents or path.suffix != ".py" or not path.is_file():
        raise SourceNotFound(f"{file!r} is not a source file of the minivllm package")
    lines = _read(str(path))
    if not 1 <= line <= len(lines):
        raise SourceNotFound(f"{file} has {len(lines)} lines, not {line}")
    name, start, end = _enclosing_function(str(path), line) or ("<module>", line, line)
    return {
        "file": file,
        "line": line,
        "function": name,
        "start": start,
        "lines": lines[start - 1 : end],
    }


@lru_cache(maxsize=64)
def _read(path: str) -> list[str]:
    return Path(path).read_text(encoding="utf-8").splitlines()


def _enclosing_function(path: str, line: int) -> tuple[str, int, int] | None:
    """(qualified name, first line, last line) of the innermost def holding `line`."""
    tree = ast.parse("\n".join(_read(path)))
    best: tuple[str, int, int] | None = None

    def visit(node: ast.AST, prefix: str) -> None:
        nonlocal best
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                last = child.end_lineno or child.lineno
                if first <= line <= last:
                    if not isinstance(child, ast.ClassDef):
                        best = (name, first, last)
                    visit(child, name + ".")

    visit(tree, "")
    return best


def function_line(file: str, qualname: str) -> str:
    """'file:LINE' of the def of `qualname` ("Class.method" or "function") in a package file,
    found by parsing it (no import: the runner's module loads torch)."""
    path = (PACKAGE_ROOT / file).resolve()
    tree = ast.parse("\n".join(_read(str(path))))

    def find(node: ast.AST, prefix: str) -> int | None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if name == qualname and not isinstance(child, ast.ClassDef):
                    return child.lineno
                if qualname.startswith(name + "."):
                    found = find(child, name + ".")
                    if found is not None:
                        return found
        return None

    line = find(tree, "")
    if line is None:
        raise SourceNotFound(f"no function {qualname!r} in {file}")
    return f"{file}:{line}"
