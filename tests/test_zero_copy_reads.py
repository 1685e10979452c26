"""Read answers of 128 KiB or more leave the target zero-copy (fmc_wire.h, fmc_server.c): the
initiator copies them out of the target's registered pages only when it reads its socket.  These
tests hold the protocol to what makes that safe:

- the initiator acknowledges what it consumed, so unregister returns at once after reads;
- a target that must release a region with answers still unread resets the connection first,
  and the reset is visible to a reader even after it has taken the queued bytes, which is the
  check the initiator makes before a zero-copy answer counts;
- a bogus acknowledgement drops the connection;
- the bytes read are the same with the feature on and off.

The wire-level tests speak the native framing through raw sockets, so they can leave answers
unread on purpose."""
from __future__ import annotations

import select
import socket
import struct
import threading
import time

import pytest

from flagcx_mc import HostBuffer, TransferEngine
from flagcx_mc._core import CoreEngine
from flagcx_mc._testing.node import NodeProcess

KIB, MIB = 1 << 10, 1 << 20
REQ = struct.Struct("<BBHIQQQ")   # opcode, flags, reserved, key, id, addr, len
RESP = struct.Struct("<QiIQ")     # id, status, flags, len
OP_READ, OP_ACK = 2, 5
PREAMBLE_VECTORS, PREAMBLE_READ_ACKS = 2, 4
CAP_ZC_READS, RESP_ZC = 2, 1
UNREGISTER_GRACE_S = 0.2          # fmc_engine.c: in-progress operations get this long


@pytest.fixture
def core():
    engine = CoreEngine("127.0.0.1")
    yield engine
    engine.close()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise EOFError(f"connection closed after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)


def _connect(core: CoreEngine, flags: int) -> tuple[socket.socket, int]:
    """A data connection with our preamble; returns it and the target's capability bits."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 * MIB)  # room for unread answers
    s.settimeout(10)
    s.connect(("127.0.0.1", core.data_port))
    s.sendall(b"FMCNATV1" + struct.pack("<II", 1, flags))
    answer = _recv_exactly(s, 16)
    assert answer[:8] == b"FMCNATOK" and struct.unpack("<i", answer[8:12])[0] == 0
    return s, struct.unpack("<I", answer[12:16])[0]


def _read_request(key: int, ident: int, addr: int, length: int) -> bytes:
    return REQ.pack(OP_READ, 0, 0, key, ident, addr, length)


def _wait_readable(sock: socket.socket, nbytes: int, timeout: float = 5.0) -> None:
    """Until the kernel holds `nbytes` for us (the target has sent them), without taking any."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if len(sock.recv(nbytes, socket.MSG_PEEK | socket.MSG_DONTWAIT)) >= nbytes:
                return
        except BlockingIOError:
            pass
        time.sleep(0.01)
    raise AssertionError(f"the target did not send {nbytes} bytes")


def _reset_seen(sock: socket.socket) -> bool:
    poller = select.poll()
    poller.register(sock, 0)
    return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))


def test_only_initiators_that_acknowledge_get_zero_copy_answers(core):
    old, old_caps = _connect(core, PREAMBLE_VECTORS)
    new, new_caps = _connect(core, PREAMBLE_READ_ACKS)
    with old, new:
        assert not old_caps & CAP_ZC_READS
        assert new_caps & CAP_ZC_READS


def test_an_acknowledged_answer_lets_unregister_return_at_once(core):
    size = 2 * MIB
    buf, other = HostBuffer(size), HostBuffer(size)
    try:
        buf.fill_random()
        original = buf.read(0, size)
        other.fill(0x3C)
        key = core.register(buf.addr, size)
        other_key = core.register(other.addr, size)
        with _connect(core, PREAMBLE_READ_ACKS)[0] as s:
            s.sendall(_read_request(key, 1, buf.addr, size))
            ident, status, flags, length = RESP.unpack(_recv_exactly(s, RESP.size))
            assert (ident, status, length) == (1, 0, size) and flags & RESP_ZC
            assert _recv_exactly(s, size) == original
            s.sendall(REQ.pack(OP_ACK, 0, 0, 0, 0, 0, 1))
            time.sleep(0.05)  # the ack is read by the connection's thread
            started = time.monotonic()
            core.unregister(buf.addr)
            assert time.monotonic() - started < UNREGISTER_GRACE_S * 0.75
            # The connection was not cut: it still serves a small (copied) read.
            s.sendall(_read_request(other_key, 2, other.addr, 4 * KIB))
            ident, status, flags, length = RESP.unpack(_recv_exactly(s, RESP.size))
            assert (ident, status, flags, length) == (2, 0, 0, 4 * KIB)
            assert _recv_exactly(s, 4 * KIB) == b"\x3c" * (4 * KIB)
        assert core.stats()["zero_copy_answers"] >= 1
        assert core.stats()["zero_copy_resets"] == 0
    finally:
        buf.close()
        other.close()


def test_unread_answers_make_unregister_reset_the_connection_before_it_returns(core):
    size = 2 * MIB
    buf = HostBuffer(size)
    try:
        buf.fill_random()
        key = core.register(buf.addr, size)
        with _connect(core, PREAMBLE_READ_ACKS)[0] as s:
            s.sendall(_read_request(key, 1, buf.addr, size))
            _wait_readable(s, RESP.size + 64 * KIB)  # sent, not taken: the pages are still referenced
            started = time.monotonic()
            core.unregister(buf.addr)
            assert time.monotonic() - started >= UNREGISTER_GRACE_S * 0.9  # it waited for an ack first
            buf.fill(0xEE)  # the caller may reuse its memory once unregister returned
            try:
                assert RESP.unpack(_recv_exactly(s, RESP.size))[2] & RESP_ZC
                _recv_exactly(s, size)
            except (ConnectionResetError, EOFError):
                pass  # the kernel dropped the queued bytes with the reset, or the answer was cut
            # Whatever was taken, the reset shows after it: the initiator discards such an answer.
            assert _reset_seen(s)
        assert core.stats()["zero_copy_resets"] == 1
        assert any("unacknowledged" in line for line in core.drain_log())
    finally:
        buf.close()


def test_acknowledging_more_answers_than_were_sent_drops_the_connection(core):
    buf = HostBuffer(1 * MIB)
    try:
        key = core.register(buf.addr, buf.size)
        with _connect(core, PREAMBLE_READ_ACKS)[0] as s:
            s.sendall(_read_request(key, 1, buf.addr, buf.size))
            _recv_exactly(s, RESP.size + buf.size)
            s.sendall(REQ.pack(OP_ACK, 0, 0, 0, 0, 0, 2))  # one was sent
            try:
                assert s.recv(1) == b""
            except ConnectionResetError:
                pass
        assert core.stats()["protocol_errors"] >= 1
        assert any("acknowledged 2 zero-copy answers, 1 outstanding" in line for line in core.drain_log())
    finally:
        buf.close()


@pytest.mark.parametrize("zero_copy", ["0", "1"])
def test_reads_bring_the_same_bytes_with_zero_copy_on_and_off(zero_copy):
    size = 24 * MIB
    target = NodeProcess(regions=[size], env={"FLAGCX_MC_ZEROCOPY": zero_copy})
    eng = TransferEngine(transfer_timeout=10.0)
    buf = HostBuffer(size)
    try:
        assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert eng.register_memory(buf.addr, size) == 0
        digest = target.call("fill", region=0, offset=0, length=size)["digest"]
        # 1 MiB slices, then 4 KiB ones (vectors), then ragged ones: every shape of answer.
        shapes = [(0, 8 * MIB, 1 * MIB), (8 * MIB, 8 * MIB, 4 * KIB), (16 * MIB, 8 * MIB, 200 * KIB + 8)]
        for start, span, block in shapes:
            offs = list(range(start, start + span - block + 1, block))
            assert eng.batch_transfer_sync_read(target.session, [buf.addr + o for o in offs],
                                                [target.addr(0, o) for o in offs], [block] * len(offs)) == 0
        tail = offs[-1] + block
        assert eng.transfer_sync_read(target.session, buf.addr + tail, target.addr(0, tail), size - tail) == 0
        assert buf.digest(0, size) == digest
        served = target.call("stats")
        assert (served["zero_copy_answers"] > 0) == (zero_copy == "1"), served
        # Every answer was acknowledged: the target lets the region go at once.
        started = time.monotonic()
        target.call("unregister", region=0)
        assert time.monotonic() - started < UNREGISTER_GRACE_S * 0.75 + 0.1
        assert target.call("stats")["zero_copy_resets"] == 0
    finally:
        eng.close()
        buf.close()
        target.close()


@pytest.mark.parametrize("block,per_call,size", [(4 * KIB, 256 * KIB, 2 * MIB), (1 * MIB, 4 * MIB, 16 * MIB)],
                         ids=["small-call-one-vector", "shares-of-1MiB"])
def test_reads_whose_caller_takes_the_answers_still_acknowledge_them(block, per_call, size):
    """A synchronous read's caller reads zero-copy answers itself: a small call's whole answer
    (one stream, one vector of 64 blocks), or a share of a larger call's (1 MiB per stream).
    The acknowledgements it owes still go out once the streams are idle, so the target lets the
    region go at once."""
    target = NodeProcess(regions=[size], config={"transport": "tcp"})
    eng = TransferEngine(transfer_timeout=10.0, transport="tcp", streams_per_peer=4)
    buf = HostBuffer(size)
    try:
        assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert eng.register_memory(buf.addr, size) == 0
        digest = target.call("fill", region=0, offset=0, length=size)["digest"]
        for i, start in enumerate(range(0, size, per_call)):
            offs = list(range(start, start + per_call, block))
            assert eng.batch_transfer_sync_read(target.session, [buf.addr + o for o in offs],
                                                [target.addr(0, o) for o in offs], [block] * len(offs)) == 0
            # Quiet gaps longer than the acknowledgement's 2 ms: any timer queued before the call
            # fires in the gap after it, so the last answer's ack needs its own (the caller's).
            time.sleep(0.02 if i == 0 else 0.005)
        assert buf.digest(0, size) == digest
        assert target.call("stats")["zero_copy_answers"] > 0
        time.sleep(0.05)  # idle for longer than the acknowledgement's 2 ms
        started = time.monotonic()
        target.call("unregister", region=0)
        assert time.monotonic() - started < UNREGISTER_GRACE_S * 0.5  # not the grace of an unacknowledged one
        assert target.call("stats")["zero_copy_resets"] == 0
    finally:
        eng.close()
        buf.close()
        target.close()


def test_a_read_cut_by_a_dying_target_never_reports_success_with_wrong_bytes():
    """The target dies (its kernel resets the connection) while its answers are in flight."""
    size = 32 * MIB
    block = 1 * MIB
    offs = list(range(0, size, block))
    eng = TransferEngine(transfer_timeout=10.0)
    buf = HostBuffer(size)
    try:
        assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert eng.register_memory(buf.addr, size) == 0
        for attempt in range(3):
            target = NodeProcess(regions=[size])
            try:
                digest = target.call("fill", region=0, offset=0, length=size)["digest"]
                buf.fill(0)
                assert eng.transfer_sync_read(target.session, buf.addr, target.addr(0), 4 * KIB) == 0
                result = {}
                reader = threading.Thread(target=lambda result=result, target=target: result.update(
                    rc=eng.batch_transfer_sync_read(target.session, [buf.addr + o for o in offs],
                                                    [target.addr(0, o) for o in offs], [block] * len(offs))))
                reader.start()
                time.sleep(0.002 * attempt)
                target.kill()
                reader.join(20)
                assert not reader.is_alive()
                assert result["rc"] != 0 or buf.digest(0, size) == digest
            finally:
                target.close()
    finally:
        eng.close()
        buf.close()
