"""Real servers the tests start on 127.0.0.1 (a pytest plugin: see conftest.py)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def need_redis_package() -> None:
    if not _HAVE_REDIS_PACKAGE:
        pytest.skip("the 'redis' package is not installed (pip install redis)")


@pytest.fixture(scope="module")
def redis_port(tmp_path_factory):
    """A private redis-server on 127.0.0.1 that requires ``REDIS_PASSWORD``."""
    need_redis_package()
    if _REDIS_SERVER is None:
        pytest.skip("the redis-server binary is not installed (apt-get install redis-server)")
    workdir = tmp_path_factory.mktemp("redis")
    for _ in range(3):  # the free port may be taken between probing and binding
        port = free_port()
        proc = subprocess.Popen(
            [_REDIS_SERVER, "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no",
             "--dir", str(workdir), "--requirepass", REDIS_PASSWORD, "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
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
        pytest.fail("redis-server did not start")
    try:
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
