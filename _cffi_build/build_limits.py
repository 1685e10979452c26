"""cffi builder for ``flagcx_mc.tools.bench._limits_cffi``, the benchmark's physical limits
(``limits/fmc_limits.c``) in a module of their own beside the core; run by setup.py through
cffi_modules (API mode, out-of-line, like the core).

The raw-socket limit opens, tunes and feeds its sockets with the core's own helpers
(``fmc_util.c``, ``fmc_socket.c``: the same TCP options and loopback congestion control as the
engine's data streams, and the same thread-local error text), so those files are compiled in
here too; nothing else of the core is.  Sources and headers are found by name anywhere under ``src/``.
"""
from __future__ import annotations

from pathlib import Path

import cffi  # type: ignore[import-untyped, unused-ignore]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SRC = HERE / "src"
LIMITS = HERE / "limits"


def _core_source(name: str) -> Path:
    found = sorted(SRC.rglob(name))
    if len(found) != 1:
        raise RuntimeError(f"expected one {name} under {SRC}, found {len(found)}")
    return found[0]


def _rel(path: Path) -> str:
    # set_source paths are relative to the project root, where setup.py runs.
    return str(path.relative_to(ROOT))


# The core's socket helpers (fmc_socket.c: listen, connect, tuning) and what they use.
CORE_HELPERS = ("fmc_util.c", "fmc_socket.c", "fmc_random.c")
SOURCES = [_rel(LIMITS / "fmc_limits.c")] + [_rel(_core_source(name)) for name in CORE_HELPERS]
INCLUDE_DIRS = [_rel(LIMITS)] + sorted({_rel(h.parent) for h in SRC.rglob("*.h")}) + [_rel(HERE)]

ffibuilder = cffi.FFI()
ffibuilder.cdef((LIMITS / "limits_cdefs.h").read_text())
ffibuilder.set_source(
    "flagcx_mc.tools.bench._limits_cffi",
    '#include "fmc_internal.h"\n#include "limits_cdefs.h"',
    sources=SOURCES,
    include_dirs=INCLUDE_DIRS,
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-pthread", "-std=gnu11"],
    extra_link_args=["-pthread", "-ldl"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
