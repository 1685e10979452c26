"""What many peers cost one process (``flagcx-mc bench --peers 1,8,64,256``).

A deployment's worker talks to tens or hundreds of peers.  For each count N and direction, one
engine in a process of its own (the *measured* process) exchanges one write of ``block`` bytes
with each of N engines of the other side, hosted a few to a process (``PeerGroup``), and the row
reports the aggregate rate and what the measured process holds once every session is open: its
threads, its open fds and its resident memory, beside what it held with the engine started and
no peer yet (``idle_*``), and the most threads it held while the timed rounds ran
(``peak_threads``, sampled every millisecond).

- ``out``: the measured engine writes to N targets (one batch to each, all in flight at once).
- ``in``: N initiators write into the measured engine, each to its own range, all at once.

A first-contact row (``measure_first_contact``) times N initiators reaching one target at once:
each engine's first call (4 KiB), which opens its session (the handshake, then TCP or the
same-host path, whichever the engines pick), released together within each helper process.

A round is timed after a first, untimed one that opens the sessions; the best of ``trials``
rounds is the row's rate.  Every range is verified by sha256 afterwards.  Mooncake's engine
(``mooncake.engine``, where it imports) runs the same rows.

``python -m flagcx_mc.tools.bench.peers`` is the child side: one process holding ``count``
engines, each with one region, driven by JSON lines (``_process``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..._process import GUARD_BYTES, EngineProcess, EngineServer, GuardedRegion
from ...buffers import HostBuffer

__all__ = ["PEER_COUNTS", "PeerGroup", "measure_first_contact", "measure_peers", "print_first_contact_report",
           "print_peers_report"]

PEER_COUNTS = (1, 8, 64, 256)
ENGINES_PER_PROCESS = 32  # engines of the other side hosted by one helper process
_MODULE = "flagcx_mc.tools.bench.peers"


def process_resources() -> dict:
    """This process's threads, open fds and resident memory (MiB)."""
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    return {"threads": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd")),
            "rss_mib": round(rss_pages * os.sysconf("SC_PAGE_SIZE") / (1 << 20), 1)}


class _Peers(EngineServer):
    """Child side: ``count`` engines of one kind, engine i owning region i."""

    COMMANDS = EngineServer.COMMANDS | {"init", "write", "first_contact", "resources", "digests", "watch_threads",
                                        "peak_threads"}

    def __init__(self) -> None:
        super().__init__()
        self.engines: list[Any] = []
        self._watch: tuple[threading.Thread, threading.Event, list[int]] | None = None

    def init(self, engine: str = "flagcx_mc", count: int = 1, size: int = 1 << 20, config: dict | None = None,
             host: str = "127.0.0.1") -> dict:
        sessions = []
        for _ in range(count):
            self.engine = None
            sessions.append(self.start_engine(host, engine, config))
            self.engines.append(self.engine)
            self.add(GuardedRegion(HostBuffer(size + 2 * GUARD_BYTES), size))
        return {"session": sessions[0], "sessions": sessions, "pid": os.getpid(), "regions": self.region_list()}

    def write(self, plan: list[list[Any]], timeout: float = 120.0) -> dict:
        """Each ``[engine, region, offset, length, target, remote]`` of ``plan``: engine ``engine``
        writes ``length`` bytes at ``offset`` of region ``region`` to ``remote`` of session
        ``target``, all started before any is waited for (one thread: the engines' own threads
        move the bytes).  Answers ``{"rc", "seconds"}``."""
        start = time.perf_counter()
        started = []
        for engine, region, offset, length, target, remote in plan:
            eng = self.engines[engine]
            batch = eng.batch_transfer_async_write(target, [self.regions[region].addr + offset], [remote], [length])
            if batch == 0:
                return {"rc": -1, "seconds": time.perf_counter() - start}
            started.append((eng, batch))
        rc = 0
        for eng, batch in started:
            status = eng.get_batch_transfer_status([batch])
            rc = rc or status
        return {"rc": rc, "seconds": time.perf_counter() - start}

    def first_contact(self, target: str, remote: int, length: int) -> dict:
        """Engine i writes ``length`` bytes of region i to ``remote + i * length`` of ``target``,
        every engine from a thread of its own, all released at once: for each, its first call
        (which opens its session).  Answers ``{"rc": [...], "seconds": [...]}``."""
        n = len(self.engines)
        barrier = threading.Barrier(n)
        rcs, seconds = [-1] * n, [0.0] * n

        def one(i: int) -> None:
            barrier.wait()
            start = time.perf_counter()
            rcs[i] = self.engines[i].transfer_sync_write(target, self.regions[i].addr, remote + i * length, length)
            seconds[i] = time.perf_counter() - start

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return {"rc": rcs, "seconds": seconds}

    def resources(self) -> dict:
        return process_resources()

    def watch_threads(self) -> dict:
        """Sample this process's thread count every millisecond until ``peak_threads``."""
        stop, peak = threading.Event(), [0]

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], len(os.listdir("/proc/self/task")))
                stop.wait(0.001)

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        self._watch = (thread, stop, peak)
        return {}

    def peak_threads(self) -> dict:
        """The most threads seen since ``watch_threads``, the sampling thread left out."""
        if self._watch is None:
            return {"peak": None}
        thread, stop, peak = self._watch
        stop.set()
        thread.join()
        self._watch = None
        return {"peak": peak[0] - 1}

    def digests(self, ranges: list[list[int]]) -> dict:
        return {"digests": [self.regions[r].digest(off, n) for r, off, n in ranges]}

    def exit(self) -> dict:
        for eng in self.engines:
            close = getattr(eng, "close", None)
            if close is not None:
                close()
        return {}


class PeerGroup(EngineProcess):
    """Parent side of a ``_Peers`` process: ``sessions[i]`` names its engine i, which owns region i."""

    def __init__(self, engine: str, count: int, size: int, config: dict | None = None,
                 env: dict[str, str] | None = None) -> None:
        super().__init__(_MODULE, {"engine": engine, "count": count, "size": size, "config": config}, env=env,
                         start_timeout=60.0 + count)
        self.sessions: list[str] = self.init_reply["sessions"]


@contextlib.contextmanager
def _groups(engine: str, n: int, size: int, config: dict | None, env: dict | None) -> Iterator[list[PeerGroup]]:
    """N engines of the other side, ENGINES_PER_PROCESS to a process."""
    groups: list[PeerGroup] = []
    try:
        left = n
        while left:
            k = min(ENGINES_PER_PROCESS, left)
            groups.append(PeerGroup(engine, k, size, config, env))
            left -= k
        yield groups
    finally:
        for g in groups:
            g.close()


def measure_peers(engine: str, direction: str, n: int, block: int, trials: int = 3, config: dict | None = None,
                  env: dict | None = None, on_idle: Callable[[int, dict], None] | None = None) -> dict:
    """One row: ``{"engine", "direction", "peers", "block", "gbps", "trials_gbps", "threads", "fds",
    "rss_mib", "idle_threads", "idle_fds", "idle_rss_mib", "peak_threads", "verified", "error"}``.  ``on_idle``
    is called with the measured process's pid and its idle resources before any peer starts
    (to confine it, for example)."""
    row: dict = {"engine": engine, "direction": direction, "peers": n, "block": block, "gbps": 0.0,
                 "trials_gbps": [], "verified": False, "error": None}
    timeout = 120.0 + n * block / 50e6
    measured_size = block if direction == "out" else n * block
    try:
        with contextlib.ExitStack() as stack:
            measured = PeerGroup(engine, 1, measured_size, config, env)
            stack.callback(measured.close)
            idle = measured.call("resources")
            if on_idle is not None:
                on_idle(measured.pid, idle)
            others = stack.enter_context(_groups(engine, n, block, config, env))
            pool = stack.enter_context(concurrent.futures.ThreadPoolExecutor(len(others)))
            if direction == "out":
                want = measured.call("fill", region=0)["digest"]
                plan = [[0, 0, 0, block, session, g.addr(i)] for g in others for i, session in enumerate(g.sessions)]

                def one_round() -> float:
                    answer = measured.call("write", timeout=timeout, plan=plan)
                    if answer["rc"] != 0:
                        raise RuntimeError(f"a write failed ({answer['rc']})")
                    return answer["seconds"]
            else:
                want_each = [g.call("fill", region=i)["digest"] for g in others for i in range(len(g.sessions))]
                target, base = measured.session, measured.addr(0)
                plans, k = [], 0
                for g in others:
                    plans.append([[i, i, 0, block, target, base + (k + i) * block] for i in range(len(g.sessions))])
                    k += len(g.sessions)

                def one_round() -> float:
                    futures = [pool.submit(g.call, "write", timeout, plan=p)
                               for g, p in zip(others, plans, strict=True)]
                    answers = [f.result() for f in futures]
                    if any(a["rc"] != 0 for a in answers):
                        raise RuntimeError("a write failed")
                    return max(a["seconds"] for a in answers)

            one_round()  # opens every session
            measured.call("watch_threads")
            seconds = [one_round() for _ in range(trials)]
            row["peak_threads"] = measured.call("peak_threads")["peak"]
            row["trials_gbps"] = [round(n * block / s / 1e9, 3) for s in seconds]
            row["gbps"] = max(row["trials_gbps"])
            busy = measured.call("resources")
            row.update(threads=busy["threads"], fds=busy["fds"], rss_mib=busy["rss_mib"],
                       idle_threads=idle["threads"], idle_fds=idle["fds"], idle_rss_mib=idle["rss_mib"])
            if direction == "out":
                got = [d for g in others for d in g.call("digests", ranges=[[i, 0, block] for i in
                                                                              range(len(g.sessions))])["digests"]]
                row["verified"] = all(d == want for d in got) and len(got) == n
            else:
                got = measured.call("digests", ranges=[[0, k * block, block] for k in range(n)])["digests"]
                row["verified"] = got == want_each
    except Exception as exc:  # noqa: BLE001 -- reported in the row; the run's verdict fails on it
        row["error"] = f"{type(exc).__name__}: {exc}"
    return row


def measure_first_contact(engine: str, n: int, length: int = 4096, config: dict | None = None,
                          env: dict | None = None) -> dict:
    """N initiators' first calls into one target at once: ``{"engine", "peers", "seconds" (the
    slowest call), "p50_s", "verified", "error"}``."""
    row: dict = {"engine": engine, "peers": n, "seconds": 0.0, "p50_s": 0.0, "verified": False, "error": None}
    try:
        with contextlib.ExitStack() as stack:
            target = PeerGroup(engine, 1, n * length, config, env)
            stack.callback(target.close)
            others = stack.enter_context(_groups(engine, n, length, config, env))
            want = [g.call("fill", region=i)["digest"] for g in others for i in range(len(g.sessions))]
            pool = stack.enter_context(concurrent.futures.ThreadPoolExecutor(len(others)))
            futures, k = [], 0
            for g in others:
                futures.append(pool.submit(g.call, "first_contact", 120.0, target=target.session,
                                           remote=target.addr(0) + k * length, length=length))
                k += len(g.sessions)
            answers = [f.result() for f in futures]
            if any(rc != 0 for a in answers for rc in a["rc"]):
                raise RuntimeError("a first call failed")
            seconds = [s for a in answers for s in a["seconds"]]
            row["seconds"] = round(max(seconds), 4)
            row["p50_s"] = round(statistics.median(seconds), 4)
            got = target.call("digests", ranges=[[0, i * length, length] for i in range(n)])["digests"]
            row["verified"] = got == want
    except Exception as exc:  # noqa: BLE001 -- reported in the row; the run's verdict fails on it
        row["error"] = f"{type(exc).__name__}: {exc}"
    return row


def print_first_contact_report(rows: list[dict], out: Any = None) -> None:
    if not rows:
        return
    print(f"\n{'first contact':<13} {'peers':>5} {'slowest s':>10} {'p50 s':>8}  verified", file=out)
    for r in rows:
        if r["error"]:
            print(f"{r['engine']:<13} {r['peers']:>5}  error: {r['error']}", file=out)
            continue
        print(f"{r['engine']:<13} {r['peers']:>5} {r['seconds']:>10.3f} {r['p50_s']:>8.3f}  "
              f"{'yes' if r['verified'] else 'NO'}", file=out)
    print("(N initiators in helper processes each make their first call, 4 KiB, into one target at once)", file=out)


def print_peers_report(rows: list[dict], cpus: int, out: Any = None) -> None:
    """The peers table: per engine, direction and count, the rate and what the measured process
    holds, beside the budget the targets set (idle + 2 x CPUs + 8 threads, idle + 4 fds per peer)."""
    print(f"\n{'peers':<13} {'dir':>3} {'peers':>5} {'block':>6} {'GB/s':>7} {'threads':>12} {'peak':>10} "
          f"{'fds':>13} {'RSS MiB':>8}  verified", file=out)
    for r in rows:
        if r["error"]:
            print(f"{r['engine']:<13} {r['direction']:>3} {r['peers']:>5} {r['block'] >> 10:>5}K  error: {r['error']}",
                  file=out)
            continue
        threads = f"{r['threads']} (+{r['threads'] - r['idle_threads']})"
        peak = r.get("peak_threads")
        peak_text = "-" if peak is None else f"{peak} (+{peak - r['idle_threads']})"
        fds = f"{r['fds']} (+{r['fds'] - r['idle_fds']})"
        print(f"{r['engine']:<13} {r['direction']:>3} {r['peers']:>5} {r['block'] >> 10:>5}K {r['gbps']:>7.2f} "
              f"{threads:>12} {peak_text:>10} {fds:>13} {r['rss_mib']:>8.1f}  {'yes' if r['verified'] else 'NO'}",
              file=out)
    print(f"(the measured process's threads and fds once every session is open, and its most threads while the "
          f"timed rounds ran (peak); in brackets what it gained over the engine alone; budget with {cpus} CPUs: "
          f"idle + {2 * cpus + 8} threads, idle + 4 fds per peer)", file=out)


if __name__ == "__main__":
    _Peers().serve()
