"""Structural facts of the storage seam (issue 23), checked on the source: the seam stays
narrow, and nothing above storage/ asks which kind of backend it has."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "shardsafe"
STORAGE = SRC / "storage"
MAX_ABSTRACT = 11  # read range, write in parts (write, finish, abort), stat, list, open, create, remove, folders


def _abstract(path: Path) -> dict[str, list[str]]:
    """class -> its abstract methods, for the classes defined in ``path``."""
    out = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            out[node.name] = [f.name for f in node.body if isinstance(f, ast.FunctionDef) and any(
                isinstance(d, ast.Name) and d.id == "abstractmethod" for d in f.decorator_list)]
    return out


def test_base_surface_is_narrow():
    """storage/base.py's abstract operations (what every backend implements) stay about 10;
    commit mechanics (rename, exchange, lock, sync) are not among them."""
    ops = {f"{c}.{m}" for c, ms in _abstract(STORAGE / "base.py").items() for m in ms}
    assert len(ops) <= MAX_ABSTRACT, sorted(ops)
    assert not {o.split(".")[1] for o in ops} & {"rename", "exchange", "lock", "locked", "sync", "mtime"}, ops


def _backend_classes() -> set[str]:
    """Names of the Backend and Folder classes defined in storage/ and its packages (and the commit
    strategies')."""
    names = set()
    for path in STORAGE.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and re.search(r"(Backend|Folder|Commit)$", node.name):
                names.add(node.name)
    return names - {"Backend", "Folder", "Commit"}  # the seam's own types are what callers use


def test_nothing_above_storage_branches_on_the_backend():
    """No module outside storage/ mentions a backend's class, can_rename or an in_place
    flag: how a checkpoint is committed is the backend's strategy (storage/commit.py)."""
    classes = _backend_classes()
    assert {"LocalBackend", "S3Backend", "AzureBackend", "RenameCommit", "InPlaceCommit"} <= classes
    word = re.compile(r"\b(" + "|".join(sorted(classes)) + r"|can_rename)\b|\.in_place\b")
    bad = []
    for path in SRC.rglob("*.py"):
        if STORAGE in path.parents:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if word.search(line):
                bad.append(f"{path.relative_to(SRC)}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_steps_and_checkpoint_folder_do_not_import_each_other():
    def imports(path: Path) -> set[str]:
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module.split(".")[-1])
        return found

    assert "checkpoint_folder" not in imports(SRC / "steps.py")
