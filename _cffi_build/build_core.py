"""cffi builder for the C core (API mode, out-of-line); run by setup.py through cffi_modules."""
from __future__ import annotations

import re
from pathlib import Path

import cffi

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _package_version() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE)
    return match.group(1) if match else "0.0.0"


# set_source paths are relative to the project root, where setup.py runs.
SOURCES = sorted(str(p.relative_to(ROOT)) for p in (HERE / "src").glob("fmc_*.c"))

ffibuilder = cffi.FFI()
ffibuilder.cdef((HERE / "core_cdefs.h").read_text())
ffibuilder.set_source(
    "flagcx_mc._fmc_cffi",
    '#include "fmc_core.h"',
    sources=SOURCES,
    include_dirs=["_cffi_build/src", "_cffi_build"],
    define_macros=[("FMC_VERSION", f'"{_package_version()}"')],
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-pthread", "-std=gnu11"],
    extra_link_args=["-pthread", "-ldl"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
