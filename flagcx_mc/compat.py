"""Run code written for ``mooncake.engine`` on flagcx_mc without editing it.

    from flagcx_mc.compat import install_mooncake_alias
    install_mooncake_alias()          # before the code under it imports mooncake.engine
    from mooncake.engine import TransferEngine   # -> flagcx_mc.TransferEngine

or, for a script you cannot touch:

    python -m flagcx_mc.compat path/to/script.py [args...]
    python -m flagcx_mc.compat -m some.module [args...]

Only ``mooncake.engine`` is replaced, through an import hook that gives it a proper module spec
(``importlib.util.find_spec("mooncake.engine")`` finds it, as SGLang's availability check
expects).  The rest of a real Mooncake installation (``mooncake.store``, ``mooncake.pg``, the
allocator and EP modules) imports as usual; where Mooncake is not installed, an empty
``mooncake`` package holds the stand-in and nothing else.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import runpy
import sys
import types
from collections.abc import Sequence

from . import names
from .engine.sync_engine import TransferEngine

__all__ = ["install_mooncake_alias", "uninstall_mooncake_alias", "mooncake_engine_module", "main"]

_PACKAGE = "mooncake"
_ENGINE = "mooncake.engine"


def _fill_engine_module(module: types.ModuleType) -> None:
    """Give ``module`` the names ``mooncake.engine`` exports, backed by flagcx_mc."""
    module.__doc__ = "flagcx_mc standing in for mooncake.engine"
    module.TransferEngine = TransferEngine  # type: ignore[attr-defined]
    for name in names.__all__:
        setattr(module, name, getattr(names, name))
    module.__flagcx_mc__ = True  # type: ignore[attr-defined]


def mooncake_engine_module() -> types.ModuleType:
    """A fresh module with the names ``mooncake.engine`` exports, backed by flagcx_mc."""
    module = types.ModuleType(_ENGINE)
    _fill_engine_module(module)
    return module


class _StandInLoader(importlib.abc.Loader):
    """Creates the stand-in ``mooncake.engine``, or an empty ``mooncake`` package."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None  # the default module, with spec, loader and __path__ set by importlib

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__name__ == _ENGINE:
            _fill_engine_module(module)
        else:
            module.__doc__ = "flagcx_mc's placeholder for mooncake (not installed); only mooncake.engine exists"
            module.__flagcx_mc__ = True  # type: ignore[attr-defined]


class _MooncakeEngineFinder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``: answers for ``mooncake.engine``, and for ``mooncake`` only
    when no real package of that name can be found."""

    def __init__(self) -> None:
        self._loader = _StandInLoader()

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == _ENGINE:
            return importlib.machinery.ModuleSpec(_ENGINE, self._loader, origin="flagcx_mc.compat")
        if fullname == _PACKAGE and self._real_package_spec() is None:
            return importlib.machinery.ModuleSpec(_PACKAGE, self._loader, origin="flagcx_mc.compat", is_package=True)
        return None

    def _real_package_spec(self) -> importlib.machinery.ModuleSpec | None:
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(_PACKAGE, None)
            if spec is not None:
                return spec
        return None


def _installed_finder() -> _MooncakeEngineFinder | None:
    return next((f for f in sys.meta_path if isinstance(f, _MooncakeEngineFinder)), None)


def install_mooncake_alias(force: bool = False) -> types.ModuleType:
    """Make ``import mooncake.engine`` give flagcx_mc's engine; returns that module.

    A real ``mooncake.engine`` already imported in this process is left alone unless ``force``
    is true (mixing both would silently give callers two different engines).  Installing twice
    is harmless.
    """
    existing = sys.modules.get(_ENGINE)
    if existing is not None and not getattr(existing, "__flagcx_mc__", False):
        if not force:
            raise RuntimeError("the real mooncake.engine is already imported; pass force=True to replace it")
        del sys.modules[_ENGINE]
        package = sys.modules.get(_PACKAGE)
        if package is not None and getattr(package, "engine", None) is existing:
            del package.engine
    if _installed_finder() is None:
        sys.meta_path.insert(0, _MooncakeEngineFinder())
    return importlib.import_module(_ENGINE)


def uninstall_mooncake_alias() -> None:
    """Remove the import hook and the stand-in modules (a real Mooncake imports again afterwards)."""
    finder = _installed_finder()
    if finder is not None:
        sys.meta_path.remove(finder)
    for name in (_ENGINE, _PACKAGE):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__flagcx_mc__", False):
            del sys.modules[name]
    package = sys.modules.get(_PACKAGE)
    if package is not None and getattr(getattr(package, "engine", None), "__flagcx_mc__", False):
        del package.engine


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(__doc__, file=sys.stderr)
        return 2
    install_mooncake_alias()
    if args[0] == "-m" and len(args) > 1:
        sys.argv = args[1:]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        runpy.run_path(args[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
