"""The engine's handshake server: Mooncake's messages, its segment descriptor, hostile frames."""

from __future__ import annotations

import asyncio
import struct

import pytest

from flagcx_mc import errors
from flagcx_mc.control.codec import MessageType
from flagcx_mc.control.handshake import request
from flagcx_mc.metadata.descriptor import SegmentDesc

# Event-loop networking: these tests run on uvloop too (tests/conftest.py says why).
pytestmark = pytest.mark.uvloop


async def test_metadata_reply_is_a_mooncake_tcp_descriptor(engine, local_buf):
    host, port = "127.0.0.1", await engine.get_rpc_port()
    reply = await request(host, port, MessageType.METADATA, {"name": "someone"})
    assert reply["name"] == engine.session_name and reply["protocol"] == "tcp"
    assert reply["tcp_proto_version"] == 2 and reply["tcp_data_port"] > 0
    assert reply["buffers"] == [{"name": engine.session_name, "addr": local_buf.addr, "length": local_buf.size}]
    desc = SegmentDesc.from_json_dict(reply)
    assert desc.native is not None and [r.addr for r in desc.native.regions] == [local_buf.addr]


async def test_probe_notify_connection(engine):
    port = await engine.get_rpc_port()
    assert await request("127.0.0.1", port, MessageType.PROBE, {}) == {"status": "success"}
    assert await request("127.0.0.1", port, MessageType.NOTIFY, {"name": "req-1", "notify_msg": "done"}) == {
        "name": "", "notify_msg": "success"}
    assert [(n.name, n.msg) for n in engine.get_notifies()] == [("req-1", "done")]
    assert engine.get_notifies() == []
    reply = await request("127.0.0.1", port, MessageType.CONNECTION, {"payload": ""})
    assert reply["reply_msg"] == "" and reply["qp_num"] == []
    with pytest.raises(errors.HandshakeRejectedError):
        await request("127.0.0.1", port, MessageType.NOTIFY, {"name": 5})


@pytest.mark.parametrize("junk", [
    b"\x00" * 8,                                  # zero length
    struct.pack("<Q", 1 << 40) + b"\x01",         # absurd length
    struct.pack("<Q", 3) + b"\x09{}",             # unknown type
    struct.pack("<Q", 5) + b"\x01{no}",           # bad JSON
    b"GET / HTTP/1.1\r\n\r\n",                    # wrong protocol
])
async def test_malformed_frames_do_not_hurt_the_engine(engine, node, local_buf, junk):
    port = await engine.get_rpc_port()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(junk)
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 6) == b""  # closed on us, nothing else
    writer.close()
    # The engine still answers and still moves data.
    assert await request("127.0.0.1", port, MessageType.PROBE, {}) == {"status": "success"}
    digest = local_buf.fill_random(0, 4096)
    await engine.transfer_sync_write(node.session, local_buf.addr, node.addr(1), 4096)
    assert node.call("digest", region=1, offset=0, length=4096)["digest"] == digest
