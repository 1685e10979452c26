"""The core's diagnostic event trace: its report reads what a -DFMC_TRACE build writes, with the
same event names, and such a build still compiles."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from flagcx_mc.tools import trace_report as tr

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "_cffi_build" / "src"


def test_event_names_are_the_cores():
    header = (SRC / "fmc_internal.h").read_text()
    enum = re.search(r"enum fmc_trace_event \{(.*?)\};", header, re.S)
    assert enum is not None
    in_c = {int(value): name for name, value in re.findall(r"FMC_TR_(\w+) = (\d+)", enum.group(1))}
    assert in_c == tr.EVENTS


def _dump(path: Path, lines: list[tuple[int, int, int, int, int]], dropped: int = 0) -> None:
    text = f"# dropped {dropped} events past FMC_TRACE_EVENTS\n" if dropped else ""
    path.write_text(text + "".join(" ".join(str(x) for x in line) + "\n" for line in lines))


def test_two_processes_make_one_timeline(tmp_path, capsys):
    prefix = str(tmp_path / "trace")
    # Initiator (pid 100): two calls on thread 1; its sender thread 2 waits for a gather and sends.
    _dump(tmp_path / "trace.100", [
        (1_000, 1, 1, 64, 0), (5_000, 2, 11, 7, 0), (9_000, 2, 12, 7, 0), (30_000, 2, 13, 7, 3),
        (60_000, 1, 2, 0, 0),
        (100_000, 1, 1, 64, 0), (160_000, 1, 2, 0, 0),
    ])
    # Target (pid 200): receives a piece and waits for its copy, then answers.
    _dump(tmp_path / "trace.200", [
        (12_000, 9, 20, 8, 64), (13_000, 9, 21, 8, 32), (29_000, 9, 22, 8, 524288),
        (31_000, 9, 23, 8, 0), (35_000, 9, 24, 8, 0), (40_000, 9, 25, 8, 1), (41_000, 9, 26, 8, 0),
    ], dropped=5)
    (tmp_path / "trace.txt").write_text("not a dump\n")  # only PREFIX.<pid> files are read
    events = tr.read_events(prefix)
    assert [e.t_ns for e in events] == sorted(e.t_ns for e in events) and len(events) == 14
    assert {e.pid for e in events} == {100, 200}
    spans = tr.calls(events)
    assert [(a.t_ns, b.t_ns) for a, b in spans] == [(1_000, 60_000), (100_000, 160_000)]
    steps = tr.step_durations(events)
    assert steps == {"wait for a gather": [4.0], "send a piece": [21.0], "receive a piece": [16.0],
                     "wait for a copy to the GPU": [4.0], "send answers": [1.0]}
    out = io.StringIO()
    tr.report(events, call=0, out=out)
    text = out.getvalue()
    assert "14 events, 2 calls" in text and "call durations, us: 59 60" in text
    assert "--- call 0: 59 us" in text
    timeline = text.split("--- call 0")[1].splitlines()[1:]
    assert len(timeline) == 12  # every event of both processes within the first call
    assert timeline[0].split()[2] == "CALL" and timeline[-1].split()[2] == "CALL_END"
    assert any("RECEIVED" in line and "524288" in line for line in timeline)
    assert tr.main([prefix]) == 0 and "--- call 1: 60 us" in capsys.readouterr().out


def test_stream_spread_shows_slow_streams(tmp_path):
    # One 100 us call; stream 7 starts at 5 us and sends 10-40, stream 8 starts at 20 and
    # sends 50-60 and 70-90 (two pieces).  Events outside the call do not count.
    _dump(tmp_path / "t.1", [
        (0, 1, 1, 2, 0),
        (5_000, 2, 10, 7, 1), (10_000, 2, 12, 7, 0), (40_000, 2, 13, 7, 1),
        (20_000, 3, 10, 8, 1), (21_000, 3, 10, 8, 1), (50_000, 3, 12, 8, 0), (60_000, 3, 13, 8, 1),
        (70_000, 3, 12, 8, 0), (90_000, 3, 13, 8, 1),
        (100_000, 1, 2, 0, 0),
        (150_000, 2, 10, 7, 1), (160_000, 2, 13, 7, 1),
    ])
    events = tr.read_events(str(tmp_path / "t"))
    spread = tr.stream_spread(events, tr.calls(events))
    assert spread == {"first stream starts": 5.0, "last stream starts": 20.0, "first stream done": 40.0,
                      "last stream done": 90.0, "sending share": (30 + 10 + 20) / (2 * 100), "streams": 2}
    out = io.StringIO()
    tr.report(events, out=out)
    assert "2 streams; they start at 5-20 us, finish at 40-90 us, sending 30% of the call" in out.getvalue()
    assert tr.stream_spread(events[:1] + events[10:11], tr.calls(events)) == {}  # no pipeline events


def test_no_trace_files_says_why(tmp_path, capsys):
    assert tr.main([str(tmp_path / "none")]) == 1
    assert "built with -DFMC_TRACE" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc on this machine")
def test_the_core_compiles_with_the_trace():
    includes = [f"-I{d}" for d in (ROOT / "_cffi_build", SRC, *sorted(p for p in SRC.iterdir() if p.is_dir()))]
    for source in sorted(SRC.rglob("fmc_*.c")):
        proc = subprocess.run(["gcc", "-fsyntax-only", "-std=gnu11", "-Wall", "-Wextra", "-Werror",
                               "-Wno-unused-parameter", "-DFMC_TRACE", '-DFMC_VERSION="trace"', *includes,
                               str(source)], capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 0, f"{source.name}: {proc.stderr}"
