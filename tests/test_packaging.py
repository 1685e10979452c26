"""The package as a packager and a user get it: the sdist built from this checkout, the wheel built
from that sdist (both with `python -m build --no-isolation`, offline, as distributions build), the
wheel's tag and contents, and the wheel installed into a fresh virtual environment where the demo
and the Mooncake alias run.  A file missing from either archive, a subpackage left out of the
wheel or a wrong tag fails here.

The build compiles the C core (a minute or two on 2 cores); `-m "not packaging"` deselects it.
The fresh environment gets the wheel alone (`--no-deps --no-index`); its dependencies come from
this interpreter's site-packages through a .pth file, so nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

from flagcx_mc._core import core_version

CHECKOUT = Path(__file__).resolve().parents[1]
VERSION = re.search(r'^version\s*=\s*"([^"]+)"', (CHECKOUT / "pyproject.toml").read_text(), re.MULTILINE)

pytestmark = [
    pytest.mark.packaging,
    pytest.mark.timeout(900),
    pytest.mark.skipif(VERSION is None, reason="no pyproject.toml with a version beside tests/"),
    pytest.mark.skipif(importlib.util.find_spec("build") is None, reason="needs `build` (the test extra)"),
]

# Compiled modules: the C core and the benchmark's limits (cffi), the argument packer (limited API).
COMPILED = ("flagcx_mc/_fmc_cffi.abi3.so", "flagcx_mc/_argpack.abi3.so", "flagcx_mc/tools/bench/_limits_cffi.abi3.so")
# What a packager needs besides the package's sources.
SDIST_FILES = ("LICENSE", "README.md", "CHANGELOG.md", "ARCHITECTURE.md", "BENCHMARKS.md", "pyproject.toml",
               "setup.py", "MANIFEST.in", "_cffi_build/build_core.py", "_cffi_build/core_cdefs.h",
               "_cffi_build/argpack.c", "tests/conftest.py", "tests/test_packaging.py", "examples/quickstart.py")
SDIST_TREES = ("tests", "examples", "_cffi_build", "docs")  # every tracked file under these
DOCS = ("README.md", "BENCHMARKS.md", "ARCHITECTURE.md")  # the files their relative links name


def _run(cmd: list[str], cwd: Path, timeout: float, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> tuple[Path, Path]:
    """(sdist, wheel): the sdist from this checkout, the wheel from that sdist."""
    out = tmp_path_factory.mktemp("dist")
    # The sdist build writes flagcx_mc.egg-info beside pyproject.toml: build from a copy, so the
    # checkout stays as it was (other runs may share it).
    source = out / "checkout"
    shutil.copytree(CHECKOUT, source, symlinks=True,
                    ignore=shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__",
                                                  ".hypothesis", ".pytest_cache", "bench-results"))
    build = [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out)]
    _run([*build, "--sdist", str(source)], out, 300)
    (sdist,) = out.glob("*.tar.gz")
    _run([*build, "--wheel", str(sdist)], out, 600)
    (wheel,) = out.glob("*.whl")
    return sdist, wheel


def _tracked(tree: str) -> list[str]:
    """Files git tracks under `tree` ([] where this is no git checkout, e.g. an unpacked sdist)."""
    if not (CHECKOUT / ".git").exists() or shutil.which("git") is None:
        return []
    proc = subprocess.run(["git", "ls-files", "--", tree], cwd=CHECKOUT, capture_output=True, text=True, timeout=30)
    return [f for f in proc.stdout.splitlines() if (CHECKOUT / f).is_file()] if proc.returncode == 0 else []


def _doc_links() -> set[str]:
    links = set()
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", (CHECKOUT / doc).read_text()):
            target = target.split("#")[0]
            if target and not re.match(r"[a-z]+:", target):
                links.add(os.path.normpath(target))
    return links


def test_sdist_holds_what_a_packager_needs(dists):
    sdist, _ = dists
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
    root = f"flagcx_mc-{VERSION.group(1)}/"
    assert all(n == root.rstrip("/") or n.startswith(root) for n in names)
    files = {n[len(root):] for n in names if n.startswith(root)}
    missing = [f for f in SDIST_FILES if f not in files]
    assert not missing, f"sdist lacks {missing}"
    for tree in SDIST_TREES:
        left_out = [f for f in _tracked(tree) if f not in files]
        assert not left_out, f"sdist lacks tracked files of {tree}/: {left_out[:20]}"
    links = _doc_links()
    assert any(link.startswith("docs/") for link in links)
    unlinked = sorted(link for link in links if link not in files)
    assert not unlinked, f"the documents link to files the sdist lacks: {unlinked}"
    built = [f for f in files if f.endswith((".so", ".pyc", ".o")) or "__pycache__" in f]
    assert not built, f"build products in the sdist: {built[:20]}"
    sources = {str(p.relative_to(CHECKOUT)) for p in (CHECKOUT / "flagcx_mc").rglob("*.py")}
    assert sources <= files, f"sdist lacks {sorted(sources - files)[:20]}"


def test_wheel_is_one_abi3_wheel_with_the_package_and_nothing_else(dists):
    _, wheel = dists
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    tag = f"cp310-abi3-{platform}"
    assert wheel.name == f"flagcx_mc-{VERSION.group(1)}-{tag}.whl"
    info = f"flagcx_mc-{VERSION.group(1)}.dist-info"
    with zipfile.ZipFile(wheel) as zf:
        files = set(zf.namelist())
        meta = zf.read(f"{info}/METADATA").decode()
        wheel_file = zf.read(f"{info}/WHEEL").decode()
    assert f"Tag: {tag}" in wheel_file.splitlines() and "Root-Is-Purelib: false" in wheel_file
    for line in ("License-Expression: Apache-2.0", "Requires-Python: >=3.10",
                 "Classifier: Operating System :: POSIX :: Linux", "Provides-Extra: redis",
                 "Provides-Extra: prometheus", "Provides-Extra: bench"):
        assert line in meta.splitlines(), f"METADATA lacks {line!r}"
    assert f"{info}/licenses/LICENSE" in files
    assert "flagcx-mc = flagcx_mc.tools.cli:main" in zipfile.ZipFile(wheel).read(f"{info}/entry_points.txt").decode()
    # Every module of the source package (a subpackage missing from pyproject.toml's list would
    # be dropped silently), the compiled modules, the typing marker, and nothing outside them.
    sources = {str(p.relative_to(CHECKOUT)) for p in (CHECKOUT / "flagcx_mc").rglob("*.py")}
    assert sources <= files, f"wheel lacks {sorted(sources - files)[:20]}"
    assert set(COMPILED) <= files and "flagcx_mc/py.typed" in files
    outside = sorted(f for f in files if not f.startswith(("flagcx_mc/", f"{info}/")))
    assert not outside, f"wheel holds files outside the package: {outside[:20]}"
    needed = sources | set(COMPILED) | {"flagcx_mc/py.typed"}
    extra = sorted(f for f in files - needed if f.startswith("flagcx_mc/"))
    assert not extra, f"wheel holds what the package does not need: {extra[:20]}"  # C sources, tests, caches


@pytest.fixture(scope="module")
def fresh_venv(dists, tmp_path_factory) -> Path:
    """A new virtual environment with the wheel installed and nothing else of flagcx_mc; the
    dependencies are this interpreter's (a .pth file lists its site-packages directories)."""
    _, wheel = dists
    venv = tmp_path_factory.mktemp("venv") / "fresh"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], venv.parent, 120)
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
          str(wheel)], venv.parent, 300)
    site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], venv.parent, 60)
    here = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(site.strip()) / "_deps_of_the_test_environment.pth").write_text("\n".join(sorted(here)) + "\n")
    return venv


def _fresh_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def test_the_installed_wheel_runs_the_demo(fresh_venv, tmp_path):
    python = fresh_venv / "bin" / "python"
    where = _run([str(python), "-c", "import flagcx_mc, flagcx_mc._core as c; print(flagcx_mc.__file__); "
                  "print(c.core_version())"], tmp_path, 60, _fresh_env()).split()
    assert where[0].startswith(str(fresh_venv)), f"imported {where[0]}, not the installed wheel"
    assert where[1] == core_version() == VERSION.group(1)
    out = _run([str(fresh_venv / "bin" / "flagcx-mc"), "demo", "--shape", "4kx256", "--shape", "1mx8",
                "--repeat", "1"], tmp_path, 180, _fresh_env())
    assert "all transfers verified by sha256" in out, out
    assert re.search(r"^write\s+4 KiB\s+256\s.*yes$", out, re.MULTILINE), out


def test_the_installed_wheel_stands_in_for_mooncake(fresh_venv, tmp_path):
    script = tmp_path / "uses_mooncake.py"
    script.write_text(textwrap.dedent("""\
        import sys
        from mooncake.engine import TransferEngine
        import flagcx_mc
        assert TransferEngine is flagcx_mc.TransferEngine
        assert flagcx_mc.__file__.startswith(sys.prefix), flagcx_mc.__file__
        print("alias ok", sys.argv[1:])
        """))
    out = _run([str(fresh_venv / "bin" / "python"), "-m", "flagcx_mc.compat", str(script), "x"], tmp_path, 60,
               _fresh_env())
    assert "alias ok ['x']" in out


def test_the_argument_packer_in_the_wheel_loads_on_other_cpythons(dists, tmp_path):
    """The abi3 promise where it can be checked here: the wheel's argument packer (it needs only
    libpython) imported by every other CPython 3.10+ on PATH, packing exactly."""
    _, wheel = dists
    others = sorted({p for minor in range(10, 20) if (p := shutil.which(f"python3.{minor}"))
                     and f"python3.{minor}" != f"python{sys.version_info[0]}.{sys.version_info[1]}"})
    if not others:
        pytest.skip("no other CPython 3.10+ on PATH")
    with zipfile.ZipFile(wheel) as zf:
        zf.extract("flagcx_mc/_argpack.abi3.so", tmp_path)
    probe = textwrap.dedent("""\
        import importlib.util, struct, sys
        spec = importlib.util.spec_from_file_location("flagcx_mc._argpack", sys.argv[1])
        m = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(m)
        values = [0, 1, 2**30 - 1, 2**30, 2**45 + 7, 2**60 - 1, 2**60, 2**64 - 1]
        packed, n, total = m.pack3(values, tuple(values), [4096] * len(values))
        assert struct.unpack(f"={3 * n}Q", packed) == (*values, *values, *[4096] * n) and total == 4096 * n
        print(sys.version_info[:2])
        """)
    ran = []
    for python in others:
        kind = "import sys; print(sys.implementation.name, sys.version_info >= (3, 10))"
        version = subprocess.run([python, "-c", kind], capture_output=True, text=True, timeout=30).stdout.split()
        if version != ["cpython", "True"]:
            continue  # a launcher that does not run (an unset pyenv shim) or another implementation
        ran.append(_run([python, "-c", probe, str(tmp_path / "flagcx_mc" / "_argpack.abi3.so")], tmp_path, 60).strip())
    if not ran:
        pytest.skip(f"none of {others} runs as CPython 3.10+")
    print(ran)
