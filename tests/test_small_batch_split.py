"""Small synchronous TCP batches of several blocks split over several streams (``split_streams``):
every block lands where it belongs, both ways, and the shares really travel on several of the
target's connections.  The default splits only on hosts of 8 CPUs or more, so the engines here
ask for it."""
from __future__ import annotations

import random
import shutil
import subprocess

import pytest
from support.nodes import wait_all_streams

from flagcx_mc import HostBuffer, TransferEngine
from flagcx_mc.config import EngineConfig
from flagcx_mc.errors import InvalidArgumentError

pytestmark = pytest.mark.timeout(60)
REGION = 4 << 20


def _bytes_in_per_connection(port: int) -> list[int]:
    """bytes_received of each established connection to ``port`` on this host (``ss -ti``)."""
    out = subprocess.run(["ss", "-tinH", "state", "established", f"sport = :{port}"],
                         capture_output=True, text=True, check=True).stdout
    return [int(tok.split(":")[1]) for tok in out.split() if tok.startswith("bytes_received:")]


@pytest.fixture
def pair():
    target, initiator = TransferEngine(transport="tcp"), TransferEngine(transport="tcp", split_streams=4)
    there, here = HostBuffer(REGION), HostBuffer(REGION)
    try:
        assert target.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert initiator.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert target.register_memory(there.addr, REGION) == 0
        assert initiator.register_memory(here.addr, REGION) == 0
        session = f"127.0.0.1:{target.get_rpc_port()}"
        # One large write connects the session's other streams.
        assert initiator.transfer_sync_write(session, here.addr, there.addr, 2 << 20) == 0
        assert wait_all_streams(initiator, session) >= 2
        yield target, initiator, session, there, here
    finally:
        initiator.close()
        target.close()
        there.close()
        here.close()


@pytest.mark.parametrize("block", [4096, 16384])
def test_split_batches_land_every_block_both_ways(pair, block):
    target, initiator, session, there, here = pair
    rng = random.Random(block)
    n = (256 << 10) // block  # a whole small batch: 64 blocks of 4 KiB, 16 of 16 KiB
    slots = REGION // block
    for _ in range(20):
        src, dst = rng.sample(range(slots), n), rng.sample(range(slots), n)
        payload = rng.randbytes(n * block)
        for i, s in enumerate(src):
            here.view[s * block:(s + 1) * block] = payload[i * block:(i + 1) * block]
        rc = initiator.batch_transfer_sync_write(session, [here.addr + s * block for s in src],
                                                 [there.addr + d * block for d in dst], [block] * n)
        assert rc == 0
        got = b"".join(bytes(there.view[d * block:(d + 1) * block]) for d in dst)
        assert got == payload
        # Read them back into other places of the local buffer.
        back = rng.sample(range(slots), n)
        rc = initiator.batch_transfer_sync_read(session, [here.addr + b * block for b in back],
                                                [there.addr + d * block for d in dst], [block] * n)
        assert rc == 0
        assert b"".join(bytes(here.view[b * block:(b + 1) * block]) for b in back) == payload


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to count bytes per connection")
def test_a_split_batch_travels_on_several_connections(pair):
    target, initiator, session, there, here = pair
    port = target._state.require_core().data_port
    before = _bytes_in_per_connection(port)
    assert len(before) >= 2
    n, block = 64, 4096
    for _ in range(50):
        assert initiator.batch_transfer_sync_write(session, [here.addr + i * block for i in range(n)],
                                                   [there.addr + i * block for i in range(n)], [block] * n) == 0
    after = _bytes_in_per_connection(port)
    assert len(after) == len(before)
    grown = sorted(a - b for a, b in zip(after, before, strict=True))
    # 50 calls of 256 KiB: with four shares of 64 KiB, at least two connections carried a quarter.
    busy = [g for g in grown if g >= 50 * (64 << 10)]
    assert len(busy) >= 2, grown


def test_split_streams_is_checked():
    with pytest.raises(InvalidArgumentError, match="split_streams"):
        EngineConfig(split_streams=5).validate()
    EngineConfig(split_streams=0).validate()  # 0: the default by the host's CPUs
