"""HumanEval-shaped prompt rows read from the running interpreter's standard library.

No download: every function with a docstring becomes a stub (signature and docstring) to
complete, the way HumanEval (Chen et al. 2021) asks for code, and the function itself is the
reference answer (both from the ``def`` line: decorators are left out). ``python_functions``
reads module-level functions, ``python_methods`` the methods of module-level classes (their
stub keeps the ``class`` line, so the answer is indented as written). Rows are ordered by a
hash of their id, so any first N of them spread over the library.
"""

from __future__ import annotations

import ast
import hashlib
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

SKIP = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo"}
MIN_LINES, MAX_LINES = 4, 40  # a function's lines after its ``def`` line, bounds included


def humaneval_message(stub: str) -> str:
    """How a chat target sees a HumanEval stub: an instruction around a fenced code block."""
    stub = stub if stub.endswith("\n") else stub + "\n"
    return f"Complete the following Python function:\n```python\n{stub}```"


def _modules(root: Path) -> Iterator[tuple[str, ast.Module, list[str]]]:
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in SKIP or part.startswith("test") for part in rel.parts):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        yield ".".join(rel.with_suffix("").parts), tree, source.splitlines(keepends=True)


def _documented(body: list[ast.stmt]) -> Iterator[ast.FunctionDef]:
    for node in body:
        if not isinstance(node, ast.FunctionDef) or not ast.get_docstring(node):
            continue
        if MIN_LINES <= node.end_lineno - node.lineno <= MAX_LINES:
            yield node


def _row(rowid: str, header: str, lines: list[str], node: ast.FunctionDef) -> dict:
    function = header + "".join(lines[node.lineno - 1 : node.end_lineno])
    stub = header + "".join(lines[node.lineno - 1 : node.body[0].end_lineno])
    return {
        "messages": [
            {"role": "user", "content": humaneval_message(stub)},
            {"role": "assistant", "content": f"```python\n{function}```"},
        ],
        "category": "python",
        "id": rowid,
    }


def _shuffled(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: hashlib.sha1(r["id"].encode()).hexdigest())


def _root(root: str | os.PathLike | None) -> Path:
    return Path(root or sysconfig.get_paths()["stdlib"])


def python_functions(root: str | os.PathLike | None = None) -> list[dict]:
    """A row for every module-level function with a docstring and 4 to 40 lines (tests and
    demos excluded): the prompt its signature and docstring wrapped as HumanEval stubs are
    (:func:`humaneval_message`), the assistant turn the whole function in a fenced block."""
    rows = []
    for module, tree, lines in _modules(_root(root)):
        for node in _documented(tree.body):
            rows.append(_row(f"{module}.{node.name}", "", lines, node))
    return _shuffled(rows)


def python_methods(root: str | os.PathLike | None = None) -> list[dict]:
    """As :func:`python_functions`, for the methods of module-level classes: the stub is the
    ``class`` line, then the method's signature and docstring; the answer the ``class`` line
    and the whole method. Only undecorated classes whose ``class`` line ends in its colon (no
    wrapped bases, no comment); of two methods with one name (a property and its setter), the
    first."""
    rows = []
    for module, tree, lines in _modules(_root(root)):
        for cls in tree.body:
            if not isinstance(cls, ast.ClassDef) or cls.decorator_list:
                continue
            header = lines[cls.lineno - 1]
            if not header.rstrip().endswith(":"):
                continue
            seen = set()  # a property's setter has its getter's name: the getter stays
            for node in _documented(cls.body):
                if node.name not in seen:
                    seen.add(node.name)
                    rows.append(_row(f"{module}.{cls.name}.{node.name}", header, lines, node))
    return _shuffled(rows)


GENERATED = {"python_functions": python_functions, "python_methods": python_methods}
