"""Several hosts on one machine: network namespaces joined by a bridge (a pytest plugin, loaded by
tests/conftest.py).

``make_network(n)`` builds, for one test, ``n`` namespaces ("hosts") with one interface each
(``eth0``, address ``10.77.0.<i+1>/24``) plugged into a bridge that lives in one more namespace
(the "switch").  Every interface, address, route and nftables table is created inside those
namespaces, so nothing touches the machine's own network and no packet can leave it.  Names
carry the pid and a random token, so parallel test sessions on one machine never clash.  The
fixture removes everything afterwards, also when the test failed; a process still running in a
namespace at that point is killed and the teardown fails, so leaks are seen.

Where namespaces cannot be created (not root, no ``ip``), the tests that use the fixture are
skipped with the reason.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import os
import secrets
import shutil
import signal
import socket
import subprocess
import threading
from collections.abc import Callable
from typing import Any

import pytest

from flagcx_mc._testing.node import NodeProcess
from support.sanitizer import environ_without_sanitizer

SUBNET = "10.77.0"
NETNS_RUN_DIR = "/var/run/netns"
_CLONE_NEWNET = 0x40000000
_COMMAND_TIMEOUT = 15.0
_counter = itertools.count()
_libc = ctypes.CDLL(None, use_errno=True)


class NetnsError(RuntimeError):
    """A namespace command failed."""


def _run(argv: list[str], *, check: bool = True, input: str | None = None,
         timeout: float = _COMMAND_TIMEOUT) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout,
                          env=environ_without_sanitizer())
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def run_tool(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    """A system tool run on this machine itself (outside any test namespace), as ``_run`` runs
    them: without a preloaded sanitizer runtime."""
    return _run(list(argv), check=check)


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip"] + (["-n", ns] if ns else []) + list(args), check=check)


def enter_netns(ns: str) -> None:
    """Move the calling thread (only it) into namespace ``ns``; use it in a thread of your own.

    Sockets a thread creates belong to its namespace for their whole life, so they may be used
    from any thread afterwards.
    """
    fd = os.open(os.path.join(NETNS_RUN_DIR, ns), os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({ns}): {os.strerror(err)}")
    finally:
        os.close(fd)


def in_netns(ns: str, fn: Callable[..., Any], *args: Any, timeout: float = 30.0) -> Any:
    """Run ``fn(*args)`` in a fresh thread that joined namespace ``ns``; return its result."""
    out: dict[str, Any] = {}

    def main() -> None:
        try:
            enter_netns(ns)
            out["value"] = fn(*args)
        except BaseException as exc:  # handed to the caller
            out["error"] = exc

    thread = threading.Thread(target=main, name=f"netns-{ns}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"{getattr(fn, '__name__', fn)} in {ns} did not finish within {timeout} s")
    if "error" in out:
        raise out["error"]
    return out["value"]


def _connect_status(addr: str, port: int, timeout: float) -> str:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect((addr, port))
    except TimeoutError:
        return "timeout"
    except OSError as exc:
        return "refused" if exc.errno == errno.ECONNREFUSED else errno.errorcode.get(exc.errno, str(exc))
    return "open"


class Host:
    """One namespace acting as a machine on the test network."""

    def __init__(self, net: Network, index: int) -> None:
        self.net = net
        self.index = index
        self.ns = f"{net.tag}-h{index}"
        self.addr = f"{SUBNET}.{index + 1}"
        self.ifname = "eth0"
        self.switch_port = f"p{index}"  # our cable's other end, on the bridge

    def __repr__(self) -> str:
        return f"Host({self.ns}, {self.addr})"

    @property
    def prefix(self) -> list[str]:
        """argv prefix that runs a command inside this host (``NodeProcess(argv_prefix=...)``)."""
        return ["ip", "netns", "exec", self.ns]

    def node(self, regions: list[int] = (), config: dict | None = None, host: str | None = None,
             **kwargs: Any) -> NodeProcess:
        """An engine process on this host, bound to its address (or ``host``)."""
        return NodeProcess(host=host or self.addr, regions=list(regions), config=config,
                           argv_prefix=self.prefix, **kwargs)

    def run(self, *argv: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
        return _run(self.prefix + list(argv), check=check, input=input)

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float = 30.0) -> Any:
        """Run ``fn(*args)`` inside this host's network (a thread, not a process)."""
        return in_netns(self.ns, fn, *args, timeout=timeout)

    def connect_status(self, addr: str, port: int, timeout: float = 1.0) -> str:
        """From this host: "open", "refused", "timeout" or an errno name."""
        return self.call(_connect_status, addr, port, timeout)

    def add_address(self, cidr: str, dev: str | None = None) -> None:
        _ip("addr", "add", cidr, "dev", dev or self.ifname, ns=self.ns)

    def set_link(self, up: bool) -> None:
        """Unplug (or plug back) this host's cable at the switch: nothing passes either way."""
        _ip("link", "set", self.switch_port, "up" if up else "down", ns=self.net.switch)

    def nft(self, script: str) -> str:
        """Apply an nftables script inside this host; returns nft's output."""
        return _run(self.prefix + ["nft", "-f", "-"], input=script).stdout

    def listening(self) -> list[tuple]:
        """(local address, port, pid) of every listening TCP socket in this host."""
        out = self.run("ss", "-Hltnp").stdout
        found = []
        for line in out.splitlines():
            fields = line.split()
            if len(fields) < 4:
                continue
            local = fields[3]
            addr, _, port = local.rpartition(":")
            pids = [int(p.split("=")[1]) for p in line.split(",") if p.startswith("pid=")]
            found.append((addr.strip("[]"), int(port), pids[0] if pids else None))
        return found


class Network:
    """``hosts`` namespaces on one bridge; ``close()`` removes all of it."""

    def __init__(self, hosts: int) -> None:
        self.tag = f"fmc{os.getpid()}{secrets.token_hex(2)}{next(_counter)}"
        self.switch = f"{self.tag}-sw"
        self.hosts: list[Host] = []
        self._namespaces: list[str] = []
        try:
            self._add_namespace(self.switch)
            _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
            _ip("link", "set", "br0", "up", ns=self.switch)
            for i in range(hosts):
                host = Host(self, i)
                self._add_namespace(host.ns)
                _ip("link", "add", host.switch_port, "type", "veth", "peer", "name", host.ifname, "netns", host.ns,
                    ns=self.switch)
                _ip("link", "set", host.switch_port, "master", "br0", "up", ns=self.switch)
                _ip("addr", "add", f"{host.addr}/24", "dev", host.ifname, ns=host.ns)
                _ip("link", "set", host.ifname, "up", ns=host.ns)
                _ip("link", "set", "lo", "up", ns=host.ns)
                self.hosts.append(host)
        except BaseException:
            self.close()
            raise

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._namespaces.append(name)

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def crash(self, host: Host, nodes: list[NodeProcess] = ()) -> None:
        """The host's machine dies: its cable is cut, its processes (``nodes``) are killed, then its
        namespace goes with every socket it had, so no FIN or RST ever reaches anyone."""
        host.set_link(False)
        for node in nodes:
            node.kill()
        _ip("netns", "del", host.ns)
        self._namespaces.remove(host.ns)

    def close(self) -> list[int]:
        """Delete every namespace (with its links and nftables tables); returns the pids that
        were still running inside and had to be killed."""
        killed: list[int] = []
        for name in self._namespaces:
            pids = _run(["ip", "netns", "pids", name], check=False).stdout.split()
            for pid in map(int, pids):
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
        for name in reversed(self._namespaces):
            _ip("netns", "del", name, check=False)
        self._namespaces.clear()
        return killed


def _netns_unavailable() -> str | None:
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"fmcprobe{os.getpid()}{secrets.token_hex(2)}"
    proc = _run(["ip", "netns", "add", probe], check=False)
    if proc.returncode != 0:
        return f"cannot create network namespaces here (`ip netns add` failed: {proc.stderr.strip()}); needs root"
    try:
        proc = _run(["ip", "netns", "exec", probe, "true"], check=False)
        if proc.returncode != 0:
            return f"cannot run commands in a network namespace here (`ip netns exec`: {proc.stderr.strip()})"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


_availability: dict[str, str | None] = {}


def require_netns() -> None:
    """Skip the calling test where namespaces cannot be created (checked once per session)."""
    if "reason" not in _availability:
        _availability["reason"] = _netns_unavailable()
    if _availability["reason"]:
        pytest.skip(_availability["reason"])


def require_tool(name: str, package: str) -> None:
    if shutil.which(name) is None:
        pytest.skip(f"the {name} command is not installed (apt-get install {package})")


@pytest.fixture
def make_network():
    """Factory: ``make_network(n)`` gives a Network of n hosts, removed after the test."""
    require_netns()
    networks: list[Network] = []

    def make(hosts: int) -> Network:
        net = Network(hosts)
        networks.append(net)
        return net

    yield make
    leaked = []
    for net in networks:
        leaked += net.close()
    assert not leaked, f"processes were still running in the test's namespaces and were killed: {leaked}"
