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


# set_source paths are relative to the project root, where setup.py runs.  Sources live in src/
# (the benchmark's baseline) and in one directory per part: common/, engine/, tcp/, mooncake/,
# samehost/, cuda/.
SRC = HERE / "src"
SOURCES = sorted(str(p.relative_to(ROOT)) for p in SRC.glob("**/fmc_*.c"))
INCLUDE_DIRS = ["_cffi_build/src"] + sorted(
    str(d.relative_to(ROOT)) for d in SRC.iterdir() if d.is_dir() and any(d.glob("fmc_*"))
) + ["_cffi_build"]

ffibuilder = cffi.FFI()
ffibuilder.cdef((HERE / "core_cdefs.h").read_text())
ffibuilder.set_source(
    "flagcx_mc._fmc_cffi",
    '#include "fmc_core.h"',
    sources=SOURCES,
    include_dirs=INCLUDE_DIRS,
    define_macros=[("FMC_VERSION", f'"{_package_version()}"')],
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-pthread", "-std=gnu11"],
    extra_link_args=["-pthread", "-ldl"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
