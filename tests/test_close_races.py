"""close() while other threads are inside the engine: every racing call returns, with a failure,
within the transfer timeout (never later, never without bound), and the process survives.
Dropping the last reference to an engine shuts it down as close() does."""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from flagcx_mc import FlagcxMcError, HostBuffer, TransferEngine
from flagcx_mc._testing.node import NodeProcess

TIMEOUT = 3.0
BIG = 32 << 20


@pytest.fixture(scope="module")
def frozen_target():
    """A target that stops answering mid-test (SIGSTOP), so calls are certainly in flight at close."""
    proc = NodeProcess(regions=[BIG, 1 << 20], config={"transfer_timeout": 30.0})
    yield proc
    proc.close()


def _calls(eng: TransferEngine, buf: HostBuffer, node: NodeProcess) -> dict:
    target = node.session
    return {
        "sync write": lambda: eng.transfer_sync_write(target, buf.addr, node.addr(0), BIG),
        "sync read": lambda: eng.transfer_sync_read(target, buf.addr + BIG, node.addr(0), BIG),
        "batch write": lambda: eng.batch_transfer_sync_write(target, [buf.addr + i * (1 << 20) for i in range(16)],
                                                             [node.addr(0, i * (1 << 20)) for i in range(16)],
                                                             [1 << 20] * 16),
        "async batch": lambda: eng.get_batch_transfer_status(
            [eng.batch_transfer_async_write(target, [buf.addr], [node.addr(0)], [BIG])]),
        "small write": lambda: eng.transfer_sync_write(target, buf.addr, node.addr(1), 4096),
        "vector": lambda: _vector_write(eng, target, buf, node),
    }


def _vector_write(eng: TransferEngine, target: str, buf: HostBuffer, node: NodeProcess) -> int:
    conn = eng.get_conn(target)
    if conn is None:  # get_conn failed (logged): Mooncake's None
        return -1
    return eng.write_vector_sync(conn, [buf.addr], [eng.make_desc(conn, node.addr(0), BIG)], [BIG])


def test_close_while_calls_wait_on_a_frozen_peer(frozen_target):
    node = frozen_target
    eng = TransferEngine(transfer_timeout=TIMEOUT)
    buf = HostBuffer(2 * BIG)
    results: dict = {}
    try:
        assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert eng.register_memory(buf.addr, buf.size) == 0
        assert eng.transfer_sync_write(node.session, buf.addr, node.addr(1), 4096) == 0  # session open
        node.freeze()
        threads = []
        for name, call in _calls(eng, buf, node).items():
            def run(name=name, call=call):
                start = time.monotonic()
                rc = call()
                results[name] = (rc, time.monotonic() - start)
            threads.append(threading.Thread(target=run, daemon=True))
        for t in threads:
            t.start()
        time.sleep(0.5)
        assert not results, f"calls returned against a frozen peer: {results}"
        start = time.monotonic()
        eng.close()
        for t in threads:
            t.join(TIMEOUT + 5)
        assert time.monotonic() - start <= TIMEOUT + 5, results
        everything = set(_calls(eng, buf, node))
        assert set(results) == everything, f"still blocked: {everything - set(results)}"
        for name, (rc, took) in results.items():
            assert rc != 0 and rc is not None, (name, rc)
            assert took <= TIMEOUT + 5, (name, took)
        # After close every call fails at once.
        assert eng.transfer_sync_write(node.session, buf.addr, node.addr(1), 4096) < 0
    finally:
        os.kill(node.pid, signal.SIGCONT)
        eng.close()
        buf.close()


def test_close_while_many_threads_transfer_to_a_live_peer(frozen_target):
    node = frozen_target
    eng = TransferEngine(transfer_timeout=TIMEOUT)
    buf = HostBuffer(2 * BIG)
    stop = threading.Event()
    outcomes: list = []
    try:
        assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert eng.register_memory(buf.addr, buf.size) == 0
        calls = list(_calls(eng, buf, node).values())

        def hammer(call):
            while not stop.is_set():
                outcomes.append(call())

        threads = [threading.Thread(target=hammer, args=(c,), daemon=True) for c in calls]
        for t in threads:
            t.start()
        time.sleep(1.0)
        start = time.monotonic()
        eng.close()
        stop.set()
        for t in threads:
            t.join(TIMEOUT + 5)
        assert not any(t.is_alive() for t in threads)
        assert time.monotonic() - start <= TIMEOUT + 5
        assert 0 in outcomes  # calls succeeded before the close
    finally:
        stop.set()
        eng.close()
        buf.close()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _settle(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_dropped_sync_engine_is_shut_down(frozen_target):
    """Code written for Mooncake never calls close(): dropping the engine must stop its servers,
    free its threads and fds, and fence its memory (a peer's write then fails)."""
    node = frozen_target
    buf = HostBuffer(1 << 20)
    try:
        fds, threads = _fds(), _threads()
        eng = TransferEngine(transfer_timeout=TIMEOUT)
        assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert eng.register_memory(buf.addr, buf.size) == 0
        name = eng.session_name
        assert node.call("transfer", op="write", target=name, items=[[1, 0, buf.addr, 4096]])["rc"] == 0
        assert eng.transfer_sync_write(node.session, buf.addr, node.addr(1), 4096) == 0
        assert _fds() > fds and _threads() > threads
        del eng
        assert _settle(lambda: _fds() <= fds and _threads() <= threads), (_fds(), fds, _threads(), threads)
        buf.fill(0x77, 0, 4096)
        assert node.call("transfer", op="write", target=name, items=[[1, 0, buf.addr, 4096]])["rc"] < 0
        assert buf.read(0, 4096) == b"\x77" * 4096  # nothing landed in memory the application may reuse
    finally:
        buf.close()


async def test_dropped_async_engine_is_shut_down(frozen_target):
    from flagcx_mc import AsyncTransferEngine

    node = frozen_target
    buf = HostBuffer(1 << 20)
    try:
        async with AsyncTransferEngine() as warm:  # libuv keeps a spare fd once a server has listened
            await warm.initialize("127.0.0.1")
        fds = _fds()
        eng = AsyncTransferEngine(transfer_timeout=TIMEOUT)
        await eng.initialize("127.0.0.1")
        await eng.register_memory(buf.addr, buf.size)
        name = eng.session_name
        reply = await asyncio.to_thread(node.call, "transfer", op="write", target=name, items=[[1, 0, buf.addr, 4096]])
        assert reply["rc"] == 0
        del eng
        for _ in range(200):  # the engine stops on this loop, in the background
            await asyncio.sleep(0.05)
            if _fds() <= fds:
                break
        assert _fds() <= fds
        reply = await asyncio.to_thread(node.call, "transfer", op="write", target=name, items=[[1, 0, buf.addr, 4096]])
        assert reply["rc"] < 0
    finally:
        buf.close()


def test_async_engine_dropped_after_its_loop_ended(frozen_target):
    """asyncio.run() returned with the engine still open: dropping it later still fences its memory."""
    from flagcx_mc import AsyncTransferEngine

    node = frozen_target
    buf = HostBuffer(1 << 20)
    holder: list = []

    async def start() -> str:
        eng = AsyncTransferEngine(transfer_timeout=TIMEOUT)
        await eng.initialize("127.0.0.1")
        await eng.register_memory(buf.addr, buf.size)
        holder.append(eng)
        return eng.session_name

    try:
        name = asyncio.run(start())
        holder.clear()
        buf.fill(0x66, 0, 4096)
        assert node.call("transfer", op="write", target=name, items=[[1, 0, buf.addr, 4096]])["rc"] < 0
        assert buf.read(0, 4096) == b"\x66" * 4096
    finally:
        buf.close()


def test_engines_alive_at_interpreter_exit_shut_down_quietly(tmp_path):
    """A script that ends with an exception while its engines are still referenced (Mooncake's
    API has no close()): their finalizers run at interpreter exit, after the executors stopped
    taking work, and must still stop them without a traceback, keeping the script's exit code."""
    import subprocess
    import sys

    script = tmp_path / "ends_with_an_error.py"
    script.write_text(
        "from flagcx_mc import HostBuffer, TransferEngine\n"
        "a, b = TransferEngine(), TransferEngine()\n"
        "for e in (a, b):\n"
        "    assert e.initialize('127.0.0.1', 'P2PHANDSHAKE', 'tcp', '') == 0\n"
        "src, dst = HostBuffer(1 << 16), HostBuffer(1 << 16)\n"
        "a.register_memory(src.addr, src.size)\n"
        "b.register_memory(dst.addr, dst.size)\n"
        "assert a.transfer_sync_write(f'127.0.0.1:{b.get_rpc_port()}', src.addr, dst.addr, 4096) == 0\n"
        "raise SystemExit(3)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("how", ["cancel", "wait_for"])
async def test_cancelled_async_transfer_touches_no_buffer_after_it_returns(frozen_target, how):
    """A cancelled transfer gives a timed-out one's guarantee: once the coroutine has finished,
    no source byte is read and no destination byte lands."""
    from flagcx_mc import AsyncTransferEngine

    node = frozen_target
    buf = HostBuffer(2 * BIG)
    try:
        async with AsyncTransferEngine(transfer_timeout=TIMEOUT) as eng:
            await eng.initialize("127.0.0.1")
            await eng.register_memory(buf.addr, buf.size)
            await eng.transfer_sync_write(node.session, buf.addr, node.addr(1), 4096)  # session open
            await asyncio.to_thread(node.call, "set", region=0, byte=0x00)
            buf.fill(0x11, 0, BIG)
            buf.fill(0x00, BIG, BIG)
            await asyncio.to_thread(node.freeze)
            try:
                write = asyncio.ensure_future(eng.transfer_sync_write(node.session, buf.addr, node.addr(0), BIG))
                read = asyncio.ensure_future(eng.transfer_sync_read(node.session, buf.addr + BIG, node.addr(0), BIG))
                await asyncio.sleep(0.3)
                assert not write.done() and not read.done()
                if how == "cancel":
                    write.cancel()
                    read.cancel()
                    for task in (write, read):
                        with pytest.raises(asyncio.CancelledError):
                            await task
                else:
                    # The first call's deadline cuts the streams both share, so the second may
                    # already have failed by the time its own wait_for starts.
                    for task in (write, read):
                        with pytest.raises((asyncio.TimeoutError, FlagcxMcError)):
                            await asyncio.wait_for(task, 0.01)
                        assert task.done()
                # The calls are over: rewrite both buffers, then let the target run again.
                buf.fill(0x22, 0, BIG)
                buf.fill(0x44, BIG, BIG)
            finally:
                os.kill(node.pid, signal.SIGCONT)
            await asyncio.sleep(0.5)
            assert (await asyncio.to_thread(node.call, "count_byte", region=0, byte=0x22))["count"] == 0
            assert buf.read(BIG, BIG).count(0x44) == BIG
    finally:
        buf.close()
