"""Incast over a shaped link (``flagcx-mc bench --link SPEC --incast N``): N initiators, each an
engine in a process of its own, write to one target at once through the one link, as prefill
workers write to a decode worker through its switch port.

Each initiator writes its own 64 MiB range of the target's region in calls of ``block`` bytes x
``count``; trial by trial, one initiator alone and then all N at once, so the two figures are
taken seconds apart.  The aggregate rate of N over the rate of one says whether the link is
shared or collapses into retransmission timeouts; the namespaces' TCP counters of the N-at-once
trials say why.  Every range is verified by sha256 after the trials.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Iterator

from ..._process import EngineProcessError
from .link import ShapedLink
from .worker import WorkerProcess

__all__ = ["measure_incast"]


@contextlib.contextmanager
def _processes(engine: str, n: int, span: int, link: ShapedLink, config: dict | None, env: dict,
               launcher: list[str]) -> Iterator[tuple[WorkerProcess, list[WorkerProcess]]]:
    initiator_prefix, target_prefix = (p + launcher for p in link.prefixes)
    started: list[WorkerProcess] = []
    try:
        target = WorkerProcess(engine=engine, size=n * span, config=config, env=env, host=link.target_addr,
                               argv_prefix=target_prefix)
        started.append(target)
        for _ in range(n):
            started.append(WorkerProcess(engine=engine, size=span, config=config, env=env,
                                         host=link.initiator_addr, argv_prefix=initiator_prefix))
        yield target, started[1:]
    finally:
        for proc in reversed(started):
            proc.close()


def _write_all(pool: concurrent.futures.Executor, target: WorkerProcess, initiators: list[WorkerProcess],
               block: int, count: int, reps: int) -> tuple[int, float]:
    """All ``initiators`` run ``reps`` timed calls at once, each to its own range; (first failing
    return code or 0, the longest timed loop in seconds)."""
    span = block * count
    timeout = 120.0 + span * reps * len(initiators) / 10e6
    futures = [pool.submit(i.call, "run", timeout=timeout, op="write", target=target.session,
                           remote=target.addr(0) + k * span, block=block, count=count, reps=reps, trials=1, warmup=0)
               for k, i in enumerate(initiators)]
    answers = [f.result() for f in futures]
    rc = next((a["rc"] for a in answers if a["rc"] != 0), 0)
    return rc, max((a["trials"][0]["seconds"] for a in answers if a["trials"]), default=0.0)


def measure_incast(engine: str, n: int, block: int, count: int, reps: int, trials: int, link: ShapedLink,
                   config: dict | None = None, env: dict | None = None, launcher: list[str] | None = None) -> dict:
    """One incast row: ``{"engine", "initiators", "block", "count", "reps", "gbps" (N at once, best
    trial), "single_gbps" (one alone, best trial), "trials_gbps", "single_trials_gbps", "vs_single",
    "verified", "error", "link_per_call"}``."""
    span = block * count
    row: dict = {"engine": engine, "initiators": n, "block": block, "count": count, "reps": reps, "verified": False,
                 "error": None, "trials_gbps": [], "single_trials_gbps": []}
    events: dict[str, int] = {}
    calls = 0
    try:
        with _processes(engine, n, span, link, config, dict(env or {}), list(launcher or [])) as (target, initiators), \
                concurrent.futures.ThreadPoolExecutor(n) as pool:
            digests = [i.call("fill", region=0, offset=0, length=span)["digest"] for i in initiators]
            target.call("set", region=0, byte=0, offset=0, length=n * span)
            rc, _ = _write_all(pool, target, initiators, block, count, 1)  # first contact, untimed
            for _ in range(trials if rc == 0 else 0):
                rc, seconds = _write_all(pool, target, initiators[:1], block, count, reps)
                if rc != 0:
                    break
                row["single_trials_gbps"].append(span * reps / seconds / 1e9 if seconds > 0 else 0.0)
                before = link.counters()
                rc, seconds = _write_all(pool, target, initiators, block, count, reps)
                after = link.counters()
                if rc != 0:
                    break
                row["trials_gbps"].append(n * span * reps / seconds / 1e9 if seconds > 0 else 0.0)
                for key in after:
                    events[key] = events.get(key, 0) + after[key] - before[key]
                calls += n * reps
            if rc != 0:
                row["error"] = f"return code {rc}"
            else:
                landed = [target.call("digest", region=0, offset=k * span, length=span)["digest"] for k in range(n)]
                bad = sum(1 for got, want in zip(landed, digests, strict=True) if got != want)
                if bad:
                    row["error"] = f"{bad} of {n} ranges differ from their sources"
                elif not target.call("guards")["intact"]:
                    row["error"] = "bytes written outside the target range"
                row["verified"] = row["error"] is None
    except (EngineProcessError, OSError) as exc:
        row["error"] = str(exc)
    row["gbps"] = max(row["trials_gbps"], default=0.0)
    row["single_gbps"] = max(row["single_trials_gbps"], default=0.0)
    row["vs_single"] = row["gbps"] / row["single_gbps"] if row["single_gbps"] else None
    row["link_per_call"] = {k: v / calls for k, v in events.items()} if calls else {}
    return row
