"""Load and soak: 64 peer engines (16 in each of 4 processes, tests/helpers/soak_child.py) make 10,048
verified transfers against one target engine; none may fail, and the target's open file
descriptors and resident memory must be as flat after the last thousand as after the first.

About 5-10 s on 2 cores.  CI runs it by default; skip it with ``pytest -m "not soak"``.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time

import pytest

from flagcx_mc._testing.node import NodeProcess

PROCESSES, ENGINES_PER_PROCESS = 4, 16
PEERS = PROCESSES * ENGINES_PER_PROCESS
SLOT = 64 << 10                         # each peer's slot on the target; blocks are 1 B .. 64 KiB
FIRST = LAST = 16                       # per peer: 16 * 64 = 1,024 transfers
MIDDLE = 125                            # per peer: 8,000
RSS_TOLERANCE_KIB = 4 << 10
SOAK_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers", "soak_child.py")


def read_reply(node: NodeProcess, timeout: float) -> dict:
    """The answer to a command written straight to the node's stdin."""
    ready, _, _ = select.select([node.proc.stdout], [], [], timeout)
    assert ready, f"no answer within {timeout} s"
    line = node.proc.stdout.readline()
    assert line, "a soak process died"
    return json.loads(line)


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.soak
def test_64_peers_10000_verified_transfers_with_flat_fds_and_rss():
    target = NodeProcess(regions=[PEERS * SLOT])
    children = []
    try:
        config = {"transfer_timeout": 20.0, "streams_per_peer": 2, "wait_threads": 2}
        for i in range(PROCESSES):
            children.append(NodeProcess(config=config, argv_prefix=[sys.executable, SOAK_CHILD]))
            slots = [[target.addr(0, (i * ENGINES_PER_PROCESS + k) * SLOT), SLOT] for k in range(ENGINES_PER_PROCESS)]
            assert children[-1].call("start", target=target.session, slots=slots)["engines"] == ENGINES_PER_PROCESS

        def run(per_peer: int) -> int:
            for child in children:  # all processes work at once; each answers when done
                child.proc.stdin.write(json.dumps({"cmd": "run", "count": per_peer}) + "\n")
                child.proc.stdin.flush()
            done = 0
            for child in children:
                reply = read_reply(child, 90)
                assert reply.get("error") is None, reply
                assert reply["error_count"] == 0 and reply["wrong"] == 0, reply
                done += reply["ok"]
            assert done == per_peer * PEERS
            return done

        start = time.monotonic()
        total = run(FIRST)
        fds_first, rss_first = fd_count(target.pid), rss_kib(target.pid)
        peer_fds_first = [fd_count(c.pid) for c in children]
        total += run(MIDDLE)
        total += run(LAST)
        fds_last, rss_last = fd_count(target.pid), rss_kib(target.pid)
        peer_fds_last = [fd_count(c.pid) for c in children]
        elapsed = time.monotonic() - start
        assert total >= 10_000
        assert target.call("stats")["requests_refused"] == 0
        assert target.call("guards")["intact"]
        assert fds_last == fds_first, (fds_first, fds_last)
        assert peer_fds_last == peer_fds_first, (peer_fds_first, peer_fds_last)  # initiators too
        assert rss_last - rss_first <= RSS_TOLERANCE_KIB, (rss_first, rss_last)
        print(f"{total} verified transfers in {elapsed:.1f} s; target fds {fds_first} -> {fds_last}, "
              f"RSS {rss_first} -> {rss_last} KiB")
    finally:
        for child in children:
            child.close(timeout=30)
        target.close()
