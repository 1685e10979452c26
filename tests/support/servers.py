"""Real servers the tests start on 127.0.0.1 (a pytest plugin, loaded by tests/conftest.py)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

import flagcx_mc

HOST = "127.0.0.1"
# Child Pythons started by tests run here, so `-m flagcx_mc...` / `-c` import the same flagcx_mc
# as the tests (the installed one), not a source tree without the compiled core.
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(flagcx_mc.__file__)))
REDIS_PASSWORD = "s3cret"
_HAVE_REDIS_PACKAGE = importlib.util.find_spec("redis") is not None
_REDIS_SERVER = shutil.which("redis-server")
_ETCD = shutil.which("etcd")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def mooncake_missing() -> str:
    """Why Mooncake's wheel cannot be imported here ('' when it can), asked in a child process."""
    probe = subprocess.run([sys.executable, "-c", "import mooncake.engine"], capture_output=True, text=True,
                           timeout=60, cwd=PACKAGE_PARENT)
    return "" if probe.returncode == 0 else (probe.stderr.strip().splitlines() or ["import failed"])[-1]


def need_redis_package() -> None:
    if not _HAVE_REDIS_PACKAGE:
        pytest.skip("the 'redis' package is not installed (pip install redis)")


def _serve(name: str, argv_for):
    """Start ``argv_for(port, spare_port)`` until it accepts connections on ``port``; yields the
    port, then stops the server.  The free ports may be taken between probing and binding."""
    for _ in range(3):
        port, spare = free_port(), free_port()
        proc = subprocess.Popen(argv_for(port, spare), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                socket.create_connection((HOST, port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.05)
        if proc.poll() is None and time.monotonic() < deadline:
            break
        proc.kill()
        proc.wait(timeout=10)
    else:
        pytest.fail(f"{name} did not start")
    try:
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def redis_port(tmp_path_factory):
    """A private redis-server on 127.0.0.1 that requires ``REDIS_PASSWORD``."""
    need_redis_package()
    if _REDIS_SERVER is None:
        pytest.skip("the redis-server binary is not installed (apt-get install redis-server)")
    workdir = tmp_path_factory.mktemp("redis")
    yield from _serve("redis-server", lambda port, _spare: [
        _REDIS_SERVER, "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no",
        "--dir", str(workdir), "--requirepass", REDIS_PASSWORD, "--loglevel", "warning"])


@pytest.fixture(scope="module")
def etcd_port(tmp_path_factory):
    """A private single-member etcd on 127.0.0.1 (Debian's etcd-server; its client port)."""
    if _ETCD is None:
        pytest.skip("the etcd binary is not installed (apt-get install etcd-server)")
    workdir = tmp_path_factory.mktemp("etcd")
    yield from _serve("etcd", lambda port, peer: [
        _ETCD, "--name", "flagcx-test", "--data-dir", str(workdir / f"data-{port}"),
        "--listen-client-urls", f"http://{HOST}:{port}", "--advertise-client-urls", f"http://{HOST}:{port}",
        "--listen-peer-urls", f"http://{HOST}:{peer}", "--initial-advertise-peer-urls", f"http://{HOST}:{peer}",
        "--initial-cluster", f"flagcx-test=http://{HOST}:{peer}", "--log-level", "error"])
