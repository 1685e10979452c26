"""A shaped link between two network namespaces, for ``flagcx-mc bench --link``.

Two namespaces ("initiator" and "target") joined by one veth pair, MTU 1500, addresses
10.78.<n>.1 (initiator) and 10.78.<n>.2 (target).  Each direction can be limited in rate (a
``tbf`` qdisc on the sending end) and lose a share of its packets (an nftables rule on the
receiving end's input hook: ``numgen random mod 100000 < N drop``).  GRO is off on both ends and
TSO/GSO too, so that a veth hands over MTU-sized packets and a drop loses one packet, not a 64 KB
super-frame.  Nothing is created outside the two namespaces, so no packet can leave the machine.

``tcp_counters(ns)`` reads the namespace's TCP counters (retransmits, timeouts, loss probes,
DSACKs): they are per namespace, so deltas around a trial count that trial's events only.

Building it needs root, ``ip`` (iproute2), ``tc``, ``nft`` (nftables) and ``ethtool``;
``unavailable()`` says which is missing.
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import shutil
import subprocess

__all__ = ["COUNTERS", "LinkSpec", "ShapedLink", "parse_link", "tcp_counters", "unavailable"]

_TIMEOUT = 15.0

# The namespace counters a link row reports (TcpExt from /proc/net/netstat, Tcp from /proc/net/snmp).
COUNTERS = {
    "retrans_segs": ("Tcp", "RetransSegs"),          # every segment sent again
    "rto": ("TcpExt", "TCPTimeouts"),                 # retransmission timeouts (the stalls)
    "loss_probes": ("TcpExt", "TCPLossProbes"),       # tail loss probes sent
    "fast_retrans": ("TcpExt", "TCPFastRetrans"),     # losses repaired without a timeout
    "spurious_rtos": ("TcpExt", "TCPSpuriousRTOs"),
    "dsack_recv": ("TcpExt", "TCPDSACKRecv"),         # the peer got a segment twice
}


class LinkError(RuntimeError):
    """A command building or shaping the link failed."""


@dataclasses.dataclass(frozen=True)
class LinkSpec:
    """What a link does to each direction: ``rate`` (tc's syntax, e.g. ``10gbit``; ``None``: as fast
    as the veth goes) and ``loss`` (a fraction of packets dropped, 0..0.5)."""

    rate: str | None = None
    loss: float = 0.0

    @property
    def kind(self) -> str:
        """``clean``, ``shaped`` (rate only) or ``lossy``: what a target in the targets file names."""
        return "lossy" if self.loss > 0 else "shaped" if self.rate else "clean"

    def __str__(self) -> str:
        parts = [self.rate] if self.rate else []
        if self.loss:
            parts.append(f"loss {self.loss * 100:g}%")
        return " + ".join(parts) if parts else "clean"


_RATE = re.compile(r"^\d+(\.\d+)?([kmgt]?(bit|bps))$", re.IGNORECASE)


def parse_link(text: str) -> LinkSpec:
    """``clean``, ``10gbit``, ``loss=0.1%``, ``10gbit,loss=1%`` (loss also as a fraction: ``0.001``).

    Raises:
        ValueError: anything else.
    """
    rate, loss = None, 0.0
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if part.lower() == "clean":
            continue
        if part.lower().startswith("loss="):
            value = part[5:].strip()
            try:
                loss = float(value[:-1]) / 100 if value.endswith("%") else float(value)
            except ValueError:
                raise ValueError(f"loss must be a percentage (0.1%) or a fraction (0.001), not {value!r}") from None
            if not 0 <= loss <= 0.5:
                raise ValueError(f"loss must be between 0 and 50%, not {value}")
        elif _RATE.match(part):
            rate = part.lower()
        else:
            raise ValueError(f"a link is 'clean', a rate such as 10gbit, loss=N% or both, comma-separated; "
                             f"not {part!r}")
    return LinkSpec(rate, loss)


def _run(argv: list[str], *, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    proc = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=_TIMEOUT, env=env)
    if check and proc.returncode != 0:
        raise LinkError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def unavailable() -> str | None:
    """Why a shaped link cannot be built here, or None."""
    if os.geteuid() != 0:
        return "a shaped link needs root (network namespaces, tc and nftables)"
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("nft", "nftables"), ("ethtool", "ethtool")):
        if shutil.which(tool) is None:
            return f"a shaped link needs the {tool} command (apt-get install {package})"
    return None


def _parse_counter_file(text: str) -> dict[tuple[str, str], int]:
    """``/proc/net/netstat`` and ``/proc/net/snmp`` come as pairs of lines: names, then values."""
    out: dict[tuple[str, str], int] = {}
    lines = text.splitlines()
    for names, values in zip(lines[0::2], lines[1::2], strict=False):
        group, _, fields = names.partition(":")
        group2, _, numbers = values.partition(":")
        if group != group2:
            continue
        for name, number in zip(fields.split(), numbers.split(), strict=False):
            try:
                out[(group, name)] = int(number)
            except ValueError:
                pass
    return out


def tcp_counters(ns: str) -> dict[str, int]:
    """The namespace's TCP counters named in ``COUNTERS`` (cumulative since it was made)."""
    text = _run(["ip", "netns", "exec", ns, "cat", "/proc/net/netstat", "/proc/net/snmp"]).stdout
    found = _parse_counter_file(text)
    return {key: found.get(where, 0) for key, where in COUNTERS.items()}


class ShapedLink:
    """Two namespaces on one veth pair; ``shape`` sets rate and loss, ``close`` removes it all."""

    def __init__(self) -> None:
        why = unavailable()
        if why:
            raise LinkError(why)
        tag = f"fmcl{os.getpid() % 100000}{secrets.token_hex(2)}"
        subnet = f"10.78.{secrets.randbelow(250) + 1}"
        self.initiator_ns, self.target_ns = f"{tag}-i", f"{tag}-t"
        self.initiator_addr, self.target_addr = f"{subnet}.1", f"{subnet}.2"
        self.spec = LinkSpec()
        self._made: list[str] = []
        try:
            for ns in (self.initiator_ns, self.target_ns):
                _run(["ip", "netns", "add", ns])
                self._made.append(ns)
            _run(["ip", "-n", self.initiator_ns, "link", "add", "veth0", "type", "veth", "peer", "name", "veth0",
                  "netns", self.target_ns])
            for ns, addr in ((self.initiator_ns, self.initiator_addr), (self.target_ns, self.target_addr)):
                _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "veth0"])
                _run(["ip", "-n", ns, "link", "set", "veth0", "mtu", "1500", "up"])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
                # One MTU-sized packet per drop: no receive coalescing, no segmentation offload.
                _run(["ip", "netns", "exec", ns, "ethtool", "-K", "veth0", "gro", "off", "tso", "off", "gso", "off"])
                _run(["ip", "netns", "exec", ns, "nft", "-f", "-"],
                     input="table inet fmc_link {\n chain input {\n  type filter hook input priority 0;\n }\n}\n")
        except BaseException:
            self.close()
            raise

    @property
    def prefixes(self) -> tuple[list[str], list[str]]:
        """argv prefixes that run a command on the initiator's and on the target's side."""
        return (["ip", "netns", "exec", self.initiator_ns], ["ip", "netns", "exec", self.target_ns])

    def shape(self, spec: LinkSpec) -> None:
        """Apply ``spec`` to both directions (replacing what was set)."""
        for ns in (self.initiator_ns, self.target_ns):
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "veth0", "root"], check=False)
            if spec.rate:
                # A bucket of 1 ms at the rate (at least 64 KiB) and a queue of 10 ms before drops.
                _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "veth0", "root", "tbf",
                      "rate", spec.rate, "burst", "1mb", "latency", "10ms"])
            rule = ""
            if spec.loss > 0:
                rule = f"add rule inet fmc_link input numgen random mod 100000 < {round(spec.loss * 100000)} drop\n"
            _run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input="flush chain inet fmc_link input\n" + rule)
        self.spec = spec

    def counters(self) -> dict[str, int]:
        """Both namespaces' TCP counters added up (each side retransmits what it sends)."""
        a, b = tcp_counters(self.initiator_ns), tcp_counters(self.target_ns)
        return {k: a[k] + b[k] for k in a}

    def close(self) -> None:
        """Kill what still runs inside and delete both namespaces (the veth pair goes with them)."""
        for ns in self._made:
            pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
        for ns in reversed(self._made):
            _run(["ip", "netns", "del", ns], check=False)
        self._made.clear()

    def __enter__(self) -> ShapedLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
