"""Where a transfer's time goes, from the core's event trace.

A core built with ``CFLAGS=-DFMC_TRACE pip install .`` timestamps the data path's steps (the
events of ``enum fmc_trace_event`` in ``_cffi_build/src/fmc_internal.h``: calls, the GPU send
pipeline's gathers and sends, a target's requests, pieces received and landed, answers) and,
with ``FMC_TRACE_FILE=PREFIX`` set, writes them at exit to ``PREFIX.<pid>``, one file per
process.  This reads those files::

    python -m flagcx_mc.tools.trace_report PREFIX [--call N]

and prints each call's duration, how long the paired steps took (wait for a gather, send a
piece, receive a piece, wait for its copy, send answers), how the GPU send pipeline's streams
shared each call (when the first and the last stream started and finished, how much of the call
they spent sending) and the timeline of one call (the middle one unless ``--call`` says which),
every process's events on one clock.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import glob
import statistics
import sys
from collections import defaultdict
from typing import IO

__all__ = ["EVENTS", "Event", "calls", "main", "read_events", "report", "step_durations", "stream_spread"]

# enum fmc_trace_event, by value (tests/test_trace_report.py keeps them in step).
EVENTS = {
    1: "CALL", 2: "CALL_END",
    10: "GATHER", 11: "FENCE_WAIT", 12: "FENCED", 13: "SENT", 14: "ROUND", 15: "HANDOFF", 16: "ROUND_END",
    17: "RESUME",
    20: "REQUEST", 21: "RECV", 22: "RECEIVED", 23: "LAND_WAIT", 24: "LANDED", 25: "ANSWER", 26: "ANSWERED",
    27: "SERVE", 28: "SPIN", 29: "YIELD",
    30: "WAKE", 31: "FINISH", 32: "READ_MORE", 33: "PARKED",
}
# Steps timed from one event to the next of the other kind on the same thread.
STEPS = {
    "wait for a gather": ("FENCE_WAIT", "FENCED"),
    "send a piece": ("FENCED", "SENT"),
    "receive a piece": ("RECV", "RECEIVED"),
    "wait for a copy to the GPU": ("LAND_WAIT", "LANDED"),
    "send answers": ("ANSWER", "ANSWERED"),
    "send a round": ("ROUND", "ROUND_END"),
}


@dataclasses.dataclass(frozen=True)
class Event:
    t_ns: int
    pid: int
    thread: int
    name: str
    a: int
    b: int


def read_events(prefix: str) -> list[Event]:
    """Every ``PREFIX.<pid>`` file's events, in time order (one clock: CLOCK_MONOTONIC)."""
    events = []
    for path in glob.glob(glob.escape(prefix) + ".*"):
        suffix = path.rsplit(".", 1)[1]
        if not suffix.isdigit():
            continue
        with open(path) as f:
            for line in f:
                if line.startswith("#"):
                    continue
                t, thread, event, a, b = (int(x) for x in line.split())
                events.append(Event(t, int(suffix), thread, EVENTS.get(event, str(event)), a, b))
    events.sort(key=lambda e: e.t_ns)
    return events


def calls(events: list[Event]) -> list[tuple[Event, Event]]:
    """(start, end) of each synchronous call, matched per thread."""
    open_calls: dict[tuple[int, int], Event] = {}
    out = []
    for e in events:
        key = (e.pid, e.thread)
        if e.name == "CALL":
            open_calls[key] = e
        elif e.name == "CALL_END" and key in open_calls:
            out.append((open_calls.pop(key), e))
    return out


def step_durations(events: list[Event]) -> dict[str, list[float]]:
    """Microseconds of each STEPS pair, per thread in order."""
    started: dict[tuple[str, int, int], int] = {}
    out: dict[str, list[float]] = defaultdict(list)
    for e in events:
        for step, (first, last) in STEPS.items():
            key = (step, e.pid, e.thread)
            if e.name == first:
                started[key] = e.t_ns
            elif e.name == last and key in started:
                out[step].append((e.t_ns - started.pop(key)) / 1e3)
    return out


# The send pipeline's events, which name their stream's socket in ``a``.
_SEND_EVENTS = ("GATHER", "FENCE_WAIT", "FENCED", "SENT")


def stream_spread(events: list[Event], spans: list[tuple[Event, Event]]) -> dict[str, float]:
    """How the send pipeline's streams shared the calls: the median over calls (those with
    pipeline events) of each figure, in microseconds from the call's start, or as a share.

    ``first stream starts`` / ``last stream starts``: a stream's first gather queued;
    ``first stream done`` / ``last stream done``: its last piece sent; ``sending share``: the
    time its streams spent sending pieces (gather landed to piece sent), summed and divided by
    streams x the call's duration.  Streams that finish far apart, or a small share, mean the
    call waited on a few slow streams or on the gathers rather than on the wire."""
    figures: dict[str, list[float]] = defaultdict(list)
    send = [e for e in events if e.name in _SEND_EVENTS]  # in time order, as events are
    times = [e.t_ns for e in send]
    for start, end in spans:
        per_stream: dict[tuple[int, int], list[Event]] = defaultdict(list)
        for e in send[bisect.bisect_left(times, start.t_ns):bisect.bisect_right(times, end.t_ns)]:
            per_stream[(e.pid, e.a)].append(e)
        starts, finishes, busy_us = [], [], 0.0
        for stream_events in per_stream.values():
            gathers = [e.t_ns for e in stream_events if e.name == "GATHER"]
            sent = [e.t_ns for e in stream_events if e.name == "SENT"]
            if not gathers or not sent:
                continue
            starts.append(min(gathers) - start.t_ns)
            finishes.append(max(sent) - start.t_ns)
            busy_us += sum(step_durations(stream_events).get("send a piece", ()))
        if not starts:
            continue
        figures["first stream starts"].append(min(starts) / 1e3)
        figures["last stream starts"].append(max(starts) / 1e3)
        figures["first stream done"].append(min(finishes) / 1e3)
        figures["last stream done"].append(max(finishes) / 1e3)
        figures["sending share"].append(busy_us * 1e3 / (len(starts) * (end.t_ns - start.t_ns)))
        figures["streams"].append(len(starts))
    return {name: statistics.median(values) for name, values in figures.items()}


def report(events: list[Event], call: int | None = None, out: IO[str] | None = None) -> None:
    out = out or sys.stdout
    spans = calls(events)
    print(f"{len(events)} events, {len(spans)} calls", file=out)
    if spans:
        print("call durations, us: " + " ".join(f"{(b.t_ns - a.t_ns) / 1e3:.0f}" for a, b in spans), file=out)
    for step, values in step_durations(events).items():
        print(f"{step:28s} n={len(values):<7d} median {statistics.median(values):9.1f} us  "
              f"mean {statistics.mean(values):9.1f}  max {max(values):9.1f}", file=out)
    if not spans:
        return
    spread = stream_spread(events, spans)
    if spread:
        print(f"send pipeline, median of calls: {spread['streams']:.0f} streams; they start at "
              f"{spread['first stream starts']:.0f}-{spread['last stream starts']:.0f} us, finish at "
              f"{spread['first stream done']:.0f}-{spread['last stream done']:.0f} us, "
              f"sending {spread['sending share']:.0%} of the call", file=out)
    index = len(spans) // 2 if call is None else call
    start, end = spans[index]
    print(f"--- call {index}: {(end.t_ns - start.t_ns) / 1e3:.0f} us, time from its start", file=out)
    labels: dict[tuple[int, int], str] = {}
    for e in events:
        if start.t_ns <= e.t_ns <= end.t_ns:
            label = labels.setdefault((e.pid, e.thread), f"{e.pid}/{len(labels)}")
            print(f"{(e.t_ns - start.t_ns) / 1e3:9.1f}  {label:10s} {e.name:11s} {e.a} {e.b}", file=out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flagcx_mc.tools.trace_report", description=__doc__.split("\n")[0])
    parser.add_argument("prefix", help="FMC_TRACE_FILE of the traced run")
    parser.add_argument("--call", type=int, help="which call's timeline to print (default: the middle one)")
    args = parser.parse_args(argv)
    events = read_events(args.prefix)
    if not events:
        print(f"no trace files {args.prefix}.<pid> (was the core built with -DFMC_TRACE?)", file=sys.stderr)
        return 1
    report(events, args.call)
    return 0


if __name__ == "__main__":
    sys.exit(main())
