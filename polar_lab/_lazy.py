"""Package attributes imported on first use (PEP 562), so importing a package costs only what is used."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any


def lazy_exports(package: str, home: dict[str, str]) -> tuple[list[str], Callable[[str], Any]]:
    """`__all__` and a module-level `__getattr__` that imports each name from the module `home` gives it."""

    def __getattr__(name: str) -> Any:
        if name in home:
            return getattr(import_module(home[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return sorted(home), __getattr__
