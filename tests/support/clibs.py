"""Shared libraries the tests build from tests/helpers/*.c (a fake CUDA driver, LD_PRELOAD shims)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from support.sanitizer import environ_without_sanitizer

HELPERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")


def build_helper_library(tmp_path_factory, source: str, *libs: str) -> str:
    """tests/helpers/<source> built as a shared library in a fresh temporary folder; the test is
    skipped where there is no C compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip(f"no C compiler to build tests/helpers/{source}")
    src = os.path.join(HELPERS, source)
    out = str(tmp_path_factory.mktemp("helper") / (os.path.splitext(source)[0] + ".so"))
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", out, src, *libs], check=True,
                   env=environ_without_sanitizer())
    return out
