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
