"""Targets a user holds a benchmark result to: ``flagcx-mc bench --targets FILE``.

A targets file is JSON (or TOML, ``.toml``, Python 3.11+): an object with a ``targets`` list (a
bare JSON list works too) of ``{"name", "metric", "threshold", "better"}``, ``better`` being
``"higher"`` or ``"lower"``, and optionally ``note_steal_from``: the hypervisor steal share from
which a target's line names the steal seen during its worst shape.  A target may also have
``min_block`` and ``max_block`` (bytes): it is then judged on the rows of blocks in that range
only (e.g. a stricter threshold from 1 MiB up); ``count``: it is judged on rows of that many
blocks per call instead of the largest batch; ``min_cpus``: it judges only runs on hosts of at
least that many CPUs (a target that one core per connection makes reachable), N/A elsewhere; and
``link`` (``clean``, ``shaped`` or ``lossy``): it then judges only runs over such a link
(``flagcx-mc bench --link``), which no other target judges.  A metric is a worst case over
measured rows, written ``kind:transport:against``:

- ``throughput_ratio:T:B`` -- GB/s of transport ``T`` over baseline ``B`` (a physical limit of
  ``limits.BASELINES`` or ``mooncake``), at the largest batch of each block size (or at
  ``count``); the lowest;
- ``cpu_ratio:T:mooncake`` -- the initiator's CPU seconds per GiB over Mooncake's on the same
  rows; the highest;
- ``p50_latency_ratio:T:U`` -- median latency of one 4 KiB synchronous write, ``T``'s over
  ``U``'s;
- ``calls_ratio:T:A/B`` -- from ``flagcx-mc bench --async``: calls per second of column ``A``
  over column ``B`` (``sync``, ``async_N``, ``to_thread_N`` for N coroutines) on ``T``'s single
  transfers (one block a call), every block size and event loop; the lowest;
- ``peers:D:M`` -- from ``flagcx-mc bench --peers``, flagcx_mc's rows of direction ``D`` (``in``
  or ``out``): ``threads`` -- the measured process's threads over its budget, idle threads +
  2 x CPUs + 8; ``fds`` -- its fds over idle fds + 4 per peer; both at every count of at least
  ``min_peers`` (a target's key, default 64), the highest; ``rate_N/M`` -- the aggregate rate
  with N peers over that with M; ``first_contact`` (direction ``in``) -- the time N initiators'
  first calls into one target take, flagcx_mc's over Mooncake's, at every N of at least
  ``min_peers``, the highest.

Each target comes out PASS, MISS or N/A (nothing measured it, with the reason) beside the worst
value and the row it came from.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ..._units import fmt_size
from .limits import BASELINES
from .report import throughput_rows

__all__ = ["METRIC_KINDS", "Target", "TargetSet", "TargetsError", "evaluate_targets", "load_targets"]

METRIC_KINDS = ("throughput_ratio", "cpu_ratio", "p50_latency_ratio", "calls_ratio", "peers")
PEER_DIRECTIONS = ("in", "out")
LINK_KINDS = ("clean", "shaped", "lossy")  # link.LinkSpec.kind


class TargetsError(ValueError):
    """A targets file that cannot be read or names a metric this bench does not measure."""


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    metric: str
    threshold: float
    better: str  # "higher" or "lower"
    min_block: int | None = None  # judged on rows of blocks in [min_block, max_block] only
    max_block: int | None = None
    link: str | None = None  # judged on runs over a link of this kind only (LINK_KINDS); None: loopback runs
    min_peers: int = 64  # peers targets: the least peer count judged
    count: int | None = None  # throughput targets: judged on rows of this batch, not the largest
    min_cpus: int | None = None  # judged on hosts of at least this many CPUs only

    def takes_run(self, result: dict) -> bool:
        """Whether this target judges ``result``: a link target a run over a link of its kind, any
        other a run without a link."""
        link = (result.get("options") or {}).get("link")
        return (link or {}).get("kind") == self.link if self.link else not link

    def takes_block(self, block: int) -> bool:
        return (self.min_block is None or block >= self.min_block) and (self.max_block is None or
                                                                       block <= self.max_block)

    def block_range(self) -> str:
        low = fmt_size(self.min_block) if self.min_block is not None else None
        high = fmt_size(self.max_block) if self.max_block is not None else None
        if low and high:
            return f"blocks of {low} to {high}"
        return f"blocks from {low}" if low else f"blocks up to {high}"

    @property
    def parts(self) -> tuple[str, str, str]:
        kind, transport, against = self.metric.split(":", 2)
        return kind, transport, against


@dataclasses.dataclass(frozen=True)
class TargetSet:
    targets: tuple[Target, ...]
    note_steal_from: float | None = None


def _check(target: Target, transports: tuple[str, ...]) -> None:
    parts = target.metric.split(":")
    if len(parts) != 3 or parts[0] not in METRIC_KINDS:
        raise TargetsError(f"{target.name!r}: metric {target.metric!r} is not kind:transport:against with kind one "
                           f"of {', '.join(METRIC_KINDS)}")
    kind, transport, against = parts
    if kind == "peers":
        rate = against.startswith("rate_") and against[5:].count("/") == 1 and all(
            x.isdigit() for x in against[5:].split("/"))
        first = transport == "in" and against == "first_contact"
        if transport not in PEER_DIRECTIONS or not (against in ("threads", "fds") or rate or first):
            raise TargetsError(f"{target.name!r}: peers targets are peers:in|out:threads|fds|rate_N/M or "
                               f"peers:in:first_contact, not {target.metric!r}")
    elif transport not in transports:
        raise TargetsError(f"{target.name!r}: no transport {transport!r} (known: {', '.join(transports)})")
    if kind == "throughput_ratio" and against not in BASELINES:
        raise TargetsError(f"{target.name!r}: no baseline {against!r} (known: {', '.join(BASELINES)})")
    if kind == "cpu_ratio" and against != "mooncake":
        raise TargetsError(f"{target.name!r}: cpu_ratio is measured against mooncake only")
    if kind == "p50_latency_ratio" and against not in transports:
        raise TargetsError(f"{target.name!r}: no transport {against!r} (known: {', '.join(transports)})")
    if kind == "calls_ratio" and (against.count("/") != 1 or not all(against.split("/"))):
        raise TargetsError(f"{target.name!r}: calls_ratio compares two columns, A/B, not {against!r}")
    for bound in (target.min_block, target.max_block):
        if bound is not None and (type(bound) is not int or bound < 0):
            raise TargetsError(f"{target.name!r}: min_block and max_block are block sizes in bytes, not {bound!r}")
    if target.min_block is not None and target.max_block is not None and target.min_block > target.max_block:
        raise TargetsError(f"{target.name!r}: min_block {target.min_block} is above max_block {target.max_block}")
    if (target.min_block is not None or target.max_block is not None) and kind == "p50_latency_ratio":
        raise TargetsError(f"{target.name!r}: a latency target has one size; min_block and max_block do not apply")
    for name, value in (("count", target.count), ("min_cpus", target.min_cpus)):
        if value is not None and (type(value) is not int or value < 1):
            raise TargetsError(f"{target.name!r}: {name} is a positive whole number, not {value!r}")
    if target.count is not None and kind != "throughput_ratio":
        raise TargetsError(f"{target.name!r}: count applies to throughput_ratio targets only")
    if target.link is not None and target.link not in LINK_KINDS:
        raise TargetsError(f"{target.name!r}: link must be one of {', '.join(LINK_KINDS)}, not {target.link!r}")
    if target.better not in ("higher", "lower"):
        raise TargetsError(f"{target.name!r}: better must be 'higher' or 'lower', not {target.better!r}")


def load_targets(path: str, transports: tuple[str, ...]) -> TargetSet:
    """Read and check a targets file; ``transports``: the transport names a metric may use.

    Raises:
        TargetsError: unreadable, malformed, or naming what this bench does not measure.
    """
    try:
        text = Path(path).read_text()
        if path.endswith(".toml"):
            import tomllib  # type: ignore[import-not-found]  # Python 3.11+ (mypy checks as 3.10)

            data: Any = tomllib.loads(text)
        else:
            data = json.loads(text)
    except (OSError, ValueError, ImportError) as exc:
        raise TargetsError(f"cannot read targets from {path}: {exc}") from None
    if isinstance(data, list):
        data = {"targets": data}
    if not isinstance(data, dict) or not isinstance(data.get("targets"), list) or not data["targets"]:
        raise TargetsError(f"{path}: expected a non-empty list of targets (or an object with one under 'targets')")
    found: list[Target] = []
    for item in data["targets"]:
        try:
            target = Target(name=str(item["name"]), metric=str(item["metric"]), threshold=float(item["threshold"]),
                            better=str(item["better"]), min_block=item.get("min_block"),
                            max_block=item.get("max_block"), link=item.get("link"),
                            min_peers=int(item.get("min_peers", 64)), count=item.get("count"),
                            min_cpus=item.get("min_cpus"))
        except (TypeError, KeyError, ValueError) as exc:
            raise TargetsError(f"{path}: a target needs name, metric, threshold (a number) and better: {item!r} "
                               f"({type(exc).__name__}: {exc})") from None
        _check(target, transports)
        found.append(target)
    steal = data.get("note_steal_from")
    if steal is not None and not isinstance(steal, (int, float)):
        raise TargetsError(f"{path}: note_steal_from must be a number (a share of CPU time, e.g. 0.05)")
    return TargetSet(tuple(found), None if steal is None else float(steal))


def _why_not(result: dict, *names: str) -> str:
    """Why a transport or baseline that a metric needs has no measurement."""
    transports, missing = result.get("transports", {}), result.get("baselines_missing", {})
    for name in names:
        if name in missing:
            return f"baseline {name}: not available ({missing[name]})"
        info = transports.get(name)
        if info is not None and not info.get("available"):
            return f"{name}: {info.get('reason', 'not run')}"
        if info is None and name not in BASELINES:
            return f"{name}: not run"
    return f"no {names[-1]} measurement"


def _mooncake_transports(result: dict) -> list[str]:
    return [name for name, info in result.get("transports", {}).items() if name.startswith("mooncake")] or [
        "mooncake-tcp"]


def _values(target: Target, result: dict) -> tuple[list[tuple[float, dict]], str]:
    """(value, row) pairs the target is judged on, and why there are none."""
    kind, transport, against = target.parts
    if kind == "peers":
        return _peer_values(target, result)
    if kind == "p50_latency_ratio":
        lat = {x["transport"]: x for x in result.get("latency", [])
               if x.get("verified") and x.get("op", "write") == "write"}  # entries without "op" are writes
        if transport in lat and against in lat and lat[against].get("p50_us"):
            return [(lat[transport]["p50_us"] / lat[against]["p50_us"], {})], ""
        return [], _why_not(result, transport, against)
    if kind == "calls_ratio":
        top, bottom = against.split("/")
        calls = [r for r in result.get("async_calls", []) if r.get("transport") == transport and r.get("count") == 1
                 and target.takes_block(r.get("block", 0))]
        pairs = [(r["calls_per_s"][top] / r["calls_per_s"][bottom], r) for r in calls
                 if r["calls_per_s"].get(top) and r["calls_per_s"].get(bottom)]
        return pairs, "" if pairs else f"no async calls measured on {transport} (flagcx-mc bench --async)"
    all_rows = throughput_rows(result.get("rows", []), transport, target.count)
    rows = [r for r in all_rows if target.takes_block(r["block"])]

    def value_of(r: dict) -> float | None:
        return r.get("cpu_vs_mooncake") if kind == "cpu_ratio" else r.get("ratios", {}).get(against)

    values = [(v, r) for r in rows if (v := value_of(r)) is not None]
    if not all_rows and target.count is not None and throughput_rows(result.get("rows", []), transport):
        return values, f"no {transport} rows of {target.count} blocks per call"
    if not values and all_rows and not rows:
        return values, f"no {transport} rows of {target.block_range()}"
    others = _mooncake_transports(result) if against == "mooncake" else [against]
    return values, "" if values else _why_not(result, transport, *others)


def _first_contact_values(target: Target, result: dict) -> tuple[list[tuple[float, dict]], str]:
    rows: dict[tuple[str, int], dict] = {(r["engine"], r["peers"]): r for r in result.get("first_contact", [])
                                         if r.get("verified") and r.get("seconds")}
    pairs = [(r["seconds"] / rows[("mooncake", n)]["seconds"], {"direction": "in", "peers": n})
             for (engine, n), r in rows.items()
             if engine == "flagcx_mc" and n >= target.min_peers and ("mooncake", n) in rows]
    return pairs, "" if pairs else (f"no first-contact rows of flagcx_mc and Mooncake with {target.min_peers} "
                                    f"peers or more (flagcx-mc bench --peers)")


def _peer_values(target: Target, result: dict) -> tuple[list[tuple[float, dict]], str]:
    _, direction, measure = target.parts
    if measure == "first_contact":
        return _first_contact_values(target, result)
    rows = {r["peers"]: r for r in result.get("peers", [])
            if r.get("engine") == "flagcx_mc" and r.get("direction") == direction and r.get("verified")}
    if not rows:
        return [], f"no verified flagcx_mc {direction} rows (flagcx-mc bench --peers)"
    if measure.startswith("rate_"):
        top, bottom = (int(x) for x in measure[5:].split("/"))
        if top not in rows or bottom not in rows or not rows[bottom]["gbps"]:
            return [], f"needs {direction} rows of {top} and {bottom} peers"
        return [(rows[top]["gbps"] / rows[bottom]["gbps"], rows[top])], ""
    cpus = _cpus(result) or 1
    judged = [r for n, r in rows.items() if n >= target.min_peers]
    if not judged:
        return [], f"no {direction} row of {target.min_peers} peers or more"
    if measure == "threads":  # the more of at rest and at the peak of the timed rounds (older runs: at rest)
        return [(max(r["threads"], r.get("peak_threads") or 0) / (r["idle_threads"] + 2 * cpus + 8), r)
                for r in judged], ""
    return [(r["fds"] / (r["idle_fds"] + 4 * r["peers"]), r) for r in judged], ""


def _cpus(result: dict) -> int | None:
    """The CPUs of the host a result was measured on: a peers run's own key, or the bench's host."""
    return result.get("cpus") or (result.get("host") or {}).get("cpus")


def evaluate_targets(targets: TargetSet, result: dict) -> list[dict]:
    """Each target against a bench result (rows with their ratios, latencies, transports):
    ``{"name", "metric", "status" (PASS, MISS or N/A), "measured" (the worst value), "threshold",
    "better", "detail", "measured_median", "steal"}``.  Targets that do not judge this run
    (``Target.takes_run``: another kind of link, or loopback) are left out."""
    out = []
    cpus = _cpus(result)
    for t in targets.targets:
        if not t.takes_run(result):
            continue  # a loopback target in a run over a link, or one for another kind of link
        values: list[tuple[float, dict]]
        if t.min_cpus is not None and (cpus or 0) < t.min_cpus:
            values, why = [], f"judged on hosts of {t.min_cpus} CPUs or more; this one has {cpus}"
        else:
            values, why = _values(t, result)
        entry: dict[str, Any] = {"name": t.name, "metric": t.metric, "threshold": t.threshold, "better": t.better,
                                 "measured_median": None, "steal": None}
        if not values:
            entry.update(status="N/A", measured=None, detail=why)
            out.append(entry)
            continue
        worst, row = (min if t.better == "higher" else max)(values, key=lambda v: v[0])
        ok = worst >= t.threshold if t.better == "higher" else worst <= t.threshold
        if "peers" in row:
            detail = f"worst: {row['direction']} with {row['peers']} peers"
        elif "op" in row:
            detail = f"worst: {row['op']} {fmt_size(row['block'])} x{row['count']}"
        elif "loop" in row:
            detail = f"worst: {fmt_size(row['block'])} x{row['count']} on {row['loop']}"
        else:
            detail = ""
        kind, _, against = t.parts
        median = row.get("median_ratios", {}).get(against) if kind == "throughput_ratio" else None
        if median is not None:
            detail += f"; median trials {median:.2f}"
        steal = row.get("steal")
        if steal is not None and targets.note_steal_from is not None and steal >= targets.note_steal_from:
            detail += f"; hypervisor steal {steal:.0%} during that shape"
        entry.update(status="PASS" if ok else "MISS", measured=worst, detail=detail, measured_median=median,
                     steal=steal)
        out.append(entry)
    return out
