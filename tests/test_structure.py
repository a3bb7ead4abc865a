"""Structural facts of the source tree (issue 23), checked on every run: small modules,
short functions, no import circle, threads made in one place."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "shardsafe"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, ast.Module]:
    return {".".join(p.relative_to(SRC.parent).with_suffix("").parts): ast.parse(p.read_text())
            for p in sorted(SRC.rglob("*.py"))}


def test_no_source_file_over_600_lines():
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py")
            if (n := p.read_text().count("\n")) > MAX_FILE_LINES}
    assert not long, long


def test_no_function_over_80_lines():
    long = []
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {n} lines")
    assert not long, long


def _imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The shardsafe modules ``name`` imports at module level (not inside functions, not
    under ``if TYPE_CHECKING``): what runs when it is imported."""
    package = name if name.endswith("__init__") else name.rsplit(".", 1)[0]
    package = package.removesuffix(".__init__")
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If):  # TYPE_CHECKING blocks: not run
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                for cand in (f"{target}.{alias.name}", target):
                    if cand in known:
                        out.add(cand)
                        break
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
    return out - {name}


def test_no_import_circle():
    """Module-level imports form no cycle (a package's __init__ and its own modules aside:
    the package imports what it exports)."""
    mods = _modules()
    known = {n.removesuffix(".__init__") for n in mods}
    graph = {n.removesuffix(".__init__"): _imports(n, t, known) for n, t in mods.items()}
    for n in graph:  # a module importing its own package's __init__ is Python's import order, not a circle
        graph[n] = {m for m in graph[n] if not n.startswith(m + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    assert not cycles, cycles


def test_threads_and_pools_are_made_in_workers_only():
    hits = []
    for p in SRC.rglob("*.py"):
        if p.name == "workers.py" and p.parent == SRC:
            continue
        for no, line in enumerate(p.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if "ThreadPoolExecutor(" in code or "threading.Thread(" in code or "Thread(target" in code:
                hits.append(f"{p.relative_to(SRC)}:{no}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_no_hand_written_request_signing():
    """Object-store requests are signed by maintained clients (botocore, obstore), never by
    code in src/ (issue 23): no hmac, no SigV4 string building."""
    hits = []
    for p in SRC.rglob("*.py"):
        for no, line in enumerate(p.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if "import hmac" in code or "AWS4-HMAC" in code or "x-amz-content-sha256" in code.lower():
                hits.append(f"{p.relative_to(SRC)}:{no}: {line.strip()}")
    assert not hits, "\n".join(hits)
