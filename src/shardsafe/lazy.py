"""Lazy public names of a package (PEP 562): each name is imported from its module on first
use, so that importing the package stays cheap (``shardsafe`` and ``shardsafe.tools``
import torch only when a name that needs it is used)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable
from typing import Any


def lazy_names(package: str, where: dict[str, str], public: Iterable[str], *, submodules: bool = False
               ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package``: a name of ``where`` (name ->
    module, relative to ``package``) is imported on first use and kept in the package, so
    later lookups skip ``__getattr__``; with ``submodules``, another public name is tried as
    a submodule (``shardsafe.tools``). ``public``: the names ``dir()`` lists besides the
    package's own."""
    listed = set(public)

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module, package), name)
            setattr(sys.modules[package], name, value)
            return value
        if submodules and not name.startswith("_"):
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{package}.{name}":
                    raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | listed)

    return __getattr__, __dir__
