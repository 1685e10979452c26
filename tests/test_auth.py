"""Shared-secret authentication: a peer without the secret can neither read nor write registered
memory nor fetch the region table; holders of the secret work as usual."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import socket
import struct

import pytest

from flagcx_mc import AsyncTransferEngine, errors
from flagcx_mc._testing.node import NodeProcess
from flagcx_mc.control.auth import AUTH_KEY, RequestVerifier, _mac, sign_request
from flagcx_mc.control.codec import MessageType
from flagcx_mc.control.handshake import request

# Event-loop networking: these tests run on uvloop too (tests/conftest.py says why).
pytestmark = pytest.mark.uvloop

SECRET = "correct horse battery staple"


@pytest.fixture(scope="module")
def guarded_node():
    proc = NodeProcess(regions=[1 << 20], config={"secret": SECRET})
    yield proc
    proc.close()


async def _engine(local_buf, secret=None) -> AsyncTransferEngine:
    eng = AsyncTransferEngine(transfer_timeout=5.0, secret=secret)
    await eng.initialize("127.0.0.1")
    await eng.register_memory(local_buf.addr, 1 << 20)
    return eng


def _rpc_port(node) -> int:
    return int(node.session.rsplit(":", 1)[1])


async def test_holders_of_the_secret_transfer_normally(guarded_node, local_buf):
    async with await _engine(local_buf, SECRET) as eng:
        digest = local_buf.fill_random(0, 1 << 20)
        await eng.transfer_sync_write(guarded_node.session, local_buf.addr, guarded_node.addr(0), 1 << 20)
        assert guarded_node.call("digest", region=0)["digest"] == digest
        remote = guarded_node.call("fill", region=0)["digest"]
        await eng.transfer_sync_read(guarded_node.session, local_buf.addr, guarded_node.addr(0), 1 << 20)
        assert local_buf.digest(0, 1 << 20) == remote


@pytest.mark.parametrize("secret", [None, "wrong secret"])
async def test_without_the_secret_no_table_and_no_bytes(guarded_node, local_buf, secret):
    before = guarded_node.call("digest", region=0)["digest"]
    async with await _engine(local_buf, secret) as eng:
        with pytest.raises(errors.HandshakeRejectedError):
            await eng.transfer_sync_write(guarded_node.session, local_buf.addr, guarded_node.addr(0), 4096)
    with pytest.raises(errors.HandshakeRejectedError):  # the region table itself is refused
        await request("127.0.0.1", _rpc_port(guarded_node), MessageType.METADATA, {})
    assert guarded_node.call("digest", region=0)["digest"] == before


async def test_a_replayed_request_is_refused(guarded_node):
    signed, _ = sign_request(SECRET.encode(), MessageType.METADATA, {})
    reply = await request("127.0.0.1", _rpc_port(guarded_node), MessageType.METADATA, signed)
    assert reply["buffers"]
    with pytest.raises(errors.HandshakeRejectedError, match="replayed"):
        await request("127.0.0.1", _rpc_port(guarded_node), MessageType.METADATA, signed)


def test_a_timestamp_of_non_decimal_digits_is_malformed():
    # "²" is a digit to str.isdigit but not to int(): a rejection, not a ValueError, even with a valid MAC.
    secret, nonce, ts = SECRET.encode(), "ab" * 16, "\u00b2"
    proof = {"ts": ts, "nonce": nonce, "mac": _mac(secret, "req", MessageType.METADATA, nonce, ts, {})}
    with pytest.raises(errors.HandshakeRejectedError, match="malformed"):
        RequestVerifier(secret).verify(MessageType.METADATA, {AUTH_KEY: proof})


async def test_probe_needs_no_secret(guarded_node):
    assert await request("127.0.0.1", _rpc_port(guarded_node), MessageType.PROBE, {}) == {"status": "success"}


def test_data_port_refuses_unauthenticated_writes_even_with_leaked_keys(guarded_node):
    signed, _ = sign_request(SECRET.encode(), MessageType.METADATA, {})
    desc = asyncio.run(request("127.0.0.1", _rpc_port(guarded_node), MessageType.METADATA, signed))
    region = desc["flagcx_mc"]["regions"][0]  # suppose an attacker learnt address and key
    guarded_node.call("set", region=0, byte=0x42)
    write = struct.pack("<BBHIQQQ", 1, 0, 0, region["key"], 1, region["addr"], 4) + b"evil"
    hello = b"FMCNATV1" + struct.pack("<II", 1, 0)
    mooncake_write = struct.pack("<QQB7x", 4, region["addr"], 0x81) + b"evil"
    forged = b"FMCNATV1" + struct.pack("<II", 1, 1) + bytes(16)
    for payload in (hello + write, mooncake_write, forged + bytes(32) + write):
        with socket.create_connection(("127.0.0.1", desc["tcp_data_port"]), timeout=5) as s:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            answer = b""
            while chunk := s.recv(4096):
                answer += chunk
        if payload.startswith(hello):
            assert struct.unpack("<i", answer[8:12])[0] == -104  # rejected, nothing else answered
        assert b"\x00" * 8 not in answer[16:]  # no success answer for the write
    assert guarded_node.call("count_byte", region=0, byte=0x42)["count"] == 1 << 20


async def test_a_secret_holder_will_not_talk_to_an_unauthenticated_target(node, local_buf):
    async with await _engine(local_buf, SECRET) as eng:
        with pytest.raises(errors.HandshakeRejectedError):
            await eng.transfer_sync_write(node.session, local_buf.addr, node.addr(1), 64)


def test_core_hmac_matches_the_standard():
    from flagcx_mc._core import hmac_sha256

    for key, msg in [(b"key", b"The quick brown fox jumps over the lazy dog"), (b"k" * 100, b""), (b"", b"m" * 1000)]:
        assert hmac_sha256(key, msg) == hmac.new(key, msg, hashlib.sha256).digest()
