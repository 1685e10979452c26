"""Every method refuses bad arguments with a typed error (async) or Mooncake's negative code plus a
logged reason (sync): never a bare TypeError, a crash, or bytes read or written outside registered
memory."""
from __future__ import annotations

import logging

import pytest

from flagcx_mc import HostBuffer, TransferEngine, TransferNotify, errors

BAD_INTS = ["x", 8.5, None, -1, 1 << 64, True, [1]]
BAD_LISTS = [None, "x", 5, [None], ["x"], [-1], [1.5]]


@pytest.fixture
def buf():
    b = HostBuffer(1 << 16)
    yield b
    b.close()


async def _raises_typed(coro_fn, *args):
    try:
        await coro_fn(*args)
    except errors.FlagcxMcError:
        return
    except BaseException as exc:  # noqa: BLE001 - what else it raised is the failure
        pytest.fail(f"{coro_fn.__name__}{args!r} raised {type(exc).__name__}: {exc}")
    pytest.fail(f"{coro_fn.__name__}{args!r} did not raise")


async def test_async_memory_methods_refuse_bad_ints(engine, local_buf):
    for bad in BAD_INTS:
        await _raises_typed(engine.register_memory, bad, 8)
        await _raises_typed(engine.register_memory, local_buf.addr + (1 << 30), bad)
        await _raises_typed(engine.unregister_memory, bad)
        await _raises_typed(engine.read_bytes_from_buffer, local_buf.addr, bad)
        await _raises_typed(engine.read_bytes_from_buffer, bad, 8)
        await _raises_typed(engine.write_bytes_to_buffer, local_buf.addr, b"abcdefgh", bad)
        await _raises_typed(engine.allocate_managed_buffer, bad)
        await _raises_typed(engine.free_managed_buffer, bad, 8)
    await _raises_typed(engine.write_bytes_to_buffer, local_buf.addr, 12345, 8)
    for bad in BAD_LISTS:
        await _raises_typed(engine.batch_register_memory, bad, [8])
        await _raises_typed(engine.batch_unregister_memory, bad)


async def test_negative_length_reads_nothing_outside_the_region(engine, local_buf):
    """A length of -1 once passed the bounds check and read up to the next NUL byte."""
    with pytest.raises(errors.InvalidArgumentError):
        await engine.read_bytes_from_buffer(local_buf.addr + local_buf.size - 8, -1)
    local_buf.fill(0x5A, 0, 16)
    assert await engine.read_bytes_from_buffer(local_buf.addr, 16) == b"\x5a" * 16


async def test_async_transfer_methods_refuse_bad_arguments(engine, node, local_buf):
    target = node.session
    for bad in BAD_INTS:
        await _raises_typed(engine.transfer_sync_write, target, bad, node.addr(1), 8)
        await _raises_typed(engine.transfer_sync_read, target, local_buf.addr, bad, 8)
        await _raises_typed(engine.transfer_submit_write, target, local_buf.addr, node.addr(1), bad)
        await _raises_typed(engine.transfer_check_status, bad)
        await _raises_typed(engine.batch_transfer_sync, target, [local_buf.addr], [node.addr(1)], [8], bad)
        await _raises_typed(engine.transfer_sync, target, local_buf.addr, node.addr(1), bad, 1)
        await _raises_typed(engine.xfer_status, bad)
    for bad in BAD_LISTS:
        await _raises_typed(engine.batch_transfer_sync_write, target, bad, [node.addr(1)], [8])
        await _raises_typed(engine.batch_transfer_async_read, target, [local_buf.addr], bad, [8])
        await _raises_typed(engine.get_batch_transfer_status, bad)
        await _raises_typed(engine.batch_transfer_async_write, target, [local_buf.addr], [node.addr(1)], bad)
    for bad_target in [None, 5, "", "no-port", b"127.0.0.1:1"]:
        await _raises_typed(engine.transfer_sync_write, bad_target, local_buf.addr, node.addr(1), 8)
        await _raises_typed(engine.get_first_buffer_address, bad_target)
        await _raises_typed(engine.send_probe, bad_target)
        await _raises_typed(engine.get_conn, bad_target)
        await _raises_typed(engine.send_notify, bad_target, TransferNotify("n", "m"))
    conn = await engine.get_conn(target)
    desc = engine.make_desc(conn, node.addr(1), 8)
    for bad in [None, "x", 5]:
        await _raises_typed(engine.write_vector_sync, bad, [local_buf.addr], [desc], [8])
        await _raises_typed(engine.write_vector, conn, [local_buf.addr], [bad], [8])
        await _raises_typed(engine.read_vector, conn, [bad], [desc], [8])
        with pytest.raises(errors.FlagcxMcError):
            engine.make_desc(bad, node.addr(1), 8)
    await _raises_typed(engine.batch_transfer_sync, target, [local_buf.addr], [node.addr(1)], [8], 1, "notify")


def test_sync_methods_return_codes_for_bad_arguments(caplog, buf):
    eng = TransferEngine()
    assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    try:
        with caplog.at_level(logging.ERROR, logger="flagcx_mc"):
            assert eng.register_memory("x", 8) == -1
            assert eng.register_memory(buf.addr, -5) == -1
            assert eng.unregister_memory(None) == -1
            assert eng.batch_register_memory([buf.addr], ["x"]) == -1
            assert eng.write_bytes_to_buffer(buf.addr, b"abc", -1) == -1
            assert eng.read_bytes_from_buffer(buf.addr, -1) == b""
            assert eng.transfer_sync_write("127.0.0.1:1", "x", 0, 8) == -1
            assert eng.batch_transfer_sync_write("127.0.0.1:1", None, [0], [8]) == -1
            assert eng.allocate_managed_buffer("x") == 0
        assert caplog.text.count("must be an int") >= 3
    finally:
        eng.close()
