"""Packages whose names load on first use: `import costmodel` or `import wfd` imports none of
their modules (no simulator, no torch) until one of the names is asked for."""

import importlib
import sys
import types


class _LazyPackage(types.ModuleType):
    def __getattr__(self, name: str):
        exports = self.__dict__["_exports"]
        if name not in exports:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f".{exports[name]}", self.__name__), name)

    def __setattr__(self, name: str, value: object) -> None:
        # Importing submodule X binds package.X to it; where the package exports a name X that
        # its submodule X defines (costmodel.predict, wfd.generate), keep that name instead.
        if (isinstance(value, types.ModuleType)
                and self.__dict__.get("_exports", {}).get(name) == name):
            value = getattr(value, name)
        super().__setattr__(name, value)


def lazy_exports(package: str, exports: dict[str, str]) -> list[str]:
    """Give ``package`` its ``exports`` (each name -> the module of the package that defines
    it), each imported when first asked for; returns the names, for ``__all__``."""
    module = sys.modules[package]
    module.__class__ = _LazyPackage
    module.__dict__["_exports"] = exports
    return sorted(exports)
