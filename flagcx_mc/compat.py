"""Run code written for ``mooncake.engine`` on flagcx_mc without editing it.

    from .compat import install_mooncake_alias
    install_mooncake_alias()          # before the code under it imports mooncake
    from mooncake.engine import TransferEngine   # -> flagcx_mc.TransferEngine

or, for a script you cannot touch:

    python -m flagcx_mc.compat path/to/script.py [args...]
    python -m flagcx_mc.compat -m some.module [args...]
"""

from __future__ import annotations

import runpy
import sys
import types
from typing import List, Optional

from . import names
from .engine.sync_engine import TransferEngine

__all__ = ["install_mooncake_alias", "mooncake_engine_module", "main"]


def mooncake_engine_module() -> types.ModuleType:
    """A module with the names ``mooncake.engine`` exports, backed by flagcx_mc."""
    module = types.ModuleType("mooncake.engine", "flagcx_mc standing in for mooncake.engine")
    module.TransferEngine = TransferEngine
    for name in names.__all__:
        setattr(module, name, getattr(names, name))
    module.__flagcx_mc__ = True
    return module


def install_mooncake_alias(force: bool = False) -> types.ModuleType:
    """Make ``import mooncake`` and ``import mooncake.engine`` resolve to flagcx_mc.

    A real Mooncake already imported in this process is left alone unless ``force`` is true
    (mixing both would silently give callers two different engines).
    """
    existing = sys.modules.get("mooncake.engine")
    if existing is not None and not getattr(existing, "__flagcx_mc__", False) and not force:
        raise RuntimeError("the real mooncake.engine is already imported; pass force=True to replace it")
    engine = mooncake_engine_module()
    package = types.ModuleType("mooncake", "flagcx_mc standing in for mooncake")
    package.__path__ = []  # a package, so `import mooncake.engine` works
    package.engine = engine
    package.__flagcx_mc__ = True
    sys.modules["mooncake"] = package
    sys.modules["mooncake.engine"] = engine
    return engine


def main(argv: Optional[List[str]] = None) -> int:
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
