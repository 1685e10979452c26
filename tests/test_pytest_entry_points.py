"""`python -m pytest` tests the installed package, as `pytest` does, also from a checkout whose
source tree has no compiled core (a clone after `pip install .`; see the sys.path note in
tests/conftest.py).  Without it, `python -m pytest` imports ./flagcx_mc instead and fails."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parents[1]

PROBE = '''
import flagcx_mc
from flagcx_mc._core import core_version


def test_the_package_with_its_core_is_imported_not_this_tree():
    assert core_version()
    assert not flagcx_mc.__file__.startswith({copy!r}), flagcx_mc.__file__
'''


@pytest.fixture(scope="module")
def bare_checkout(tmp_path_factory) -> Path:
    """A copy of the checkout's Python sources and tests, without any compiled module."""
    copy = tmp_path_factory.mktemp("checkout")
    skip = shutil.ignore_patterns("*.so", "*.pyd", "__pycache__", ".hypothesis", ".pytest_cache", "test_*.py")
    shutil.copy2(CHECKOUT / "pyproject.toml", copy)
    shutil.copytree(CHECKOUT / "flagcx_mc", copy / "flagcx_mc", ignore=skip)
    shutil.copytree(CHECKOUT / "tests", copy / "tests", ignore=skip)
    (copy / "tests" / "test_probe.py").write_text(PROBE.format(copy=str(copy)))
    return copy


def test_python_m_pytest_imports_the_installed_package_from_a_bare_checkout(bare_checkout):
    # Only `python -m pytest` here: the `pytest` command never puts the checkout on sys.path, and
    # it is the command CI and the rest of this suite run with.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS")}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_probe.py"],
                         cwd=bare_checkout, capture_output=True, text=True, timeout=90, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "1 passed" in out.stdout, out.stdout[-3000:]
