"""The README's main job and the examples run and verify what they move (small sizes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    # Run outside the source tree so the installed package (with its compiled core) is imported.
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, cwd=ROOT / "examples")


def test_demo_command_verifies_both_directions():
    out = _run(sys.executable, "-m", "flagcx_mc", "demo", "--shape", "4kx64", "--shape", "1mx4", "--repeat", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line for line in out.stdout.splitlines() if line.split()[:1] in (["write"], ["read"], ["peer-write"])]
    assert len(rows) == 6 and all(line.endswith("yes") for line in rows), out.stdout
    assert "all transfers verified by sha256" in out.stdout


def test_version_command():
    out = _run(sys.executable, "-m", "flagcx_mc", "version")
    assert out.returncode == 0 and out.stdout.startswith("flagcx_mc ")


def test_examples_run():
    for example in sorted((ROOT / "examples").glob("*.py")):
        out = _run(sys.executable, str(example))
        assert out.returncode == 0, f"{example.name}: {out.stdout}{out.stderr}"
        assert "verified" in out.stdout, example.name


def test_metadata_server_command_serves_and_stops():
    import json
    import signal
    import urllib.request

    proc = subprocess.Popen([sys.executable, "-m", "flagcx_mc", "metadata-server", "--port", "0"],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT / "examples")
    try:
        port = int(proc.stdout.readline().strip().split()[-1])
        url = f"http://127.0.0.1:{port}/metadata?key=k"
        req = urllib.request.Request(url, data=json.dumps({"a": 1}).encode(), method="PUT")
        assert urllib.request.urlopen(req, timeout=5).status == 200
        assert json.loads(urllib.request.urlopen(url, timeout=5).read()) == {"a": 1}
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        proc.stdout.close()


def test_async_example_compares_with_the_sync_facade():
    out = _run(sys.executable, str(ROOT / "examples" / "async_transfers.py"), "--blocks", "16", "--rounds", "1",
               "--compare-sync")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("async / sync:") == 2 and "MISMATCH" not in out.stdout
