"""Handshake codec and segment descriptor tests; no sockets."""
from __future__ import annotations

import copy
import re
from dataclasses import replace

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flagcx_mc.config import EngineConfig, handshake_max_length
from flagcx_mc.control.codec import (
    DEFAULT_MAX_LENGTH,
    FrameDecoder,
    Message,
    MessageType,
    encode_message,
)
from flagcx_mc.errors import LocalProtocolError, MalformedJsonError, RemoteProtocolError
from flagcx_mc.metadata.descriptor import (
    BufferDesc,
    GpuShare,
    NativeInfo,
    RegionDesc,
    SegmentDesc,
    now_timestamp,
)


def raw_frame(type_byte: int, body: bytes, length: int | None = None) -> bytes:
    n = 1 + len(body) if length is None else length
    return n.to_bytes(8, "little") + bytes([type_byte]) + body


# ---- framing -------------------------------------------------------------------------


def test_encode_layout_matches_mooncake():
    frame = encode_message(MessageType.PROBE, {})
    assert frame == (4).to_bytes(8, "little") + b"\x03{}\n"


@pytest.mark.parametrize("mtype", list(MessageType))
def test_round_trip_every_type(mtype):
    payload = {"name": "10.0.0.5:15873", "n": 2**64 - 1, "l": [1, "x", None], "ok": True}
    assert FrameDecoder().feed(encode_message(mtype, payload)) == [Message(mtype, payload)]


def test_one_byte_at_a_time():
    first = encode_message(MessageType.NOTIFY, {"name": "a", "notify_msg": "hi"})
    stream = first + encode_message(MessageType.PROBE, {})
    dec = FrameDecoder()
    out = []
    for i in range(len(stream)):
        out += dec.feed(stream[i : i + 1])
        assert dec.has_partial == (i + 1 not in (len(first), len(stream)))
    assert [m.type for m in out] == [MessageType.NOTIFY, MessageType.PROBE]
    assert out[0].payload == {"name": "a", "notify_msg": "hi"}
    assert not dec.has_partial


def test_several_frames_in_one_chunk_and_split_tail():
    frames = [encode_message(MessageType(i % 4), {"i": i}) for i in range(10)]
    blob = b"".join(frames)
    dec = FrameDecoder()
    first = dec.feed(blob[:-3])
    assert [m.payload["i"] for m in first] == list(range(9))
    assert dec.has_partial
    assert dec.feed(blob[-3:]) == [Message(MessageType.METADATA, {"i": 9})]
    assert dec.feed(b"") == []


def test_empty_feed_and_header_only_partial():
    dec = FrameDecoder()
    assert dec.feed(b"") == [] and not dec.has_partial
    assert dec.feed((10).to_bytes(8, "little")) == []
    assert dec.has_partial


def test_oversized_length_rejected_from_header_alone():
    dec = FrameDecoder(max_length=DEFAULT_MAX_LENGTH)
    header = (DEFAULT_MAX_LENGTH + 1).to_bytes(8, "little")
    assert dec.feed(header[:7]) == []
    with pytest.raises(RemoteProtocolError, match="exceeds"):
        dec.feed(header[7:])  # no body byte sent: rejected before any buffering


def test_max_length_boundary_is_inclusive():
    body = b'{"a":"' + b"x" * 100 + b'"}\n'
    frame = raw_frame(1, body)
    assert len(FrameDecoder(max_length=len(body) + 1).feed(frame)) == 1
    with pytest.raises(RemoteProtocolError):
        FrameDecoder(max_length=len(body)).feed(frame)


def test_huge_chunk_never_buffers_beyond_limit():
    dec = FrameDecoder(max_length=64)
    good = encode_message(MessageType.PROBE, {}, max_length=64)
    assert len(dec.feed(good * 1000)) == 1000
    assert len(dec._buf) <= 64 + 8
    dec.feed(good[:-1])
    assert dec.has_partial and len(dec._buf) <= 64 + 8


def test_zero_length_rejected():
    with pytest.raises(RemoteProtocolError, match="zero"):
        FrameDecoder().feed(bytes(8))


@pytest.mark.parametrize("type_byte", [4, 0x7B, 0xFE, 0xFF])
def test_unknown_type_rejected(type_byte):
    with pytest.raises(RemoteProtocolError, match="type"):
        FrameDecoder().feed(raw_frame(type_byte, b"{}\n"))


@pytest.mark.parametrize(
    "body",
    [b"{", b"", b"\xff\xfe", b'{"a":1,}', b"nul", b"{}\n{}"],
    ids=["truncated", "empty", "bad-utf8", "trailing-comma", "bad-literal", "two-values"],
)
def test_bad_json_rejected(body):
    with pytest.raises(MalformedJsonError):
        FrameDecoder().feed(raw_frame(1, body))


@pytest.mark.parametrize("body", [b"[]", b"[1,2]\n", b'"s"', b"3", b"null"])
def test_json_that_is_not_an_object_rejected(body):
    with pytest.raises(MalformedJsonError, match="not an object"):
        FrameDecoder().feed(raw_frame(2, body))


def test_decoder_is_poisoned_after_error():
    dec = FrameDecoder()
    with pytest.raises(MalformedJsonError):
        dec.feed(raw_frame(1, b"{oops"))
    good = encode_message(MessageType.PROBE, {})
    for _ in range(2):
        with pytest.raises(RemoteProtocolError, match="earlier error"):
            dec.feed(good)
    assert not dec.has_partial


def test_encode_rejects_bad_input():
    with pytest.raises(LocalProtocolError):
        encode_message(MessageType.PROBE, [1, 2])  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError):
        encode_message(9, {})
    with pytest.raises(LocalProtocolError):
        encode_message(MessageType.PROBE, {1: "non-str key"})
    with pytest.raises(LocalProtocolError):
        encode_message(MessageType.PROBE, {"x": object()})
    with pytest.raises(LocalProtocolError, match="exceeds"):
        encode_message(MessageType.METADATA, {"x": "y" * DEFAULT_MAX_LENGTH})
    assert len(encode_message(MessageType.PROBE, {"x": "y" * 90}, max_length=100)) == 108


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, 1 << 20),
        ("4194304", 4 << 20),
        (" 2097152 ", 2 << 20),
        ("10", 1 << 20),
        ("-5", 1 << 20),
        (str(1 << 40), 128 << 20),
        ("lots", 1 << 20),
        ("", 1 << 20),
    ],
)
def test_handshake_max_length_from_env(monkeypatch, raw, expected):
    if raw is None:
        monkeypatch.delenv("MC_HANDSHAKE_MAX_LENGTH", raising=False)
    else:
        monkeypatch.setenv("MC_HANDSHAKE_MAX_LENGTH", raw)
    assert handshake_max_length() == expected
    assert EngineConfig.from_env().handshake_max_length == expected
    # The codec itself never reads the environment: its default is Mooncake's 1 MiB.
    assert FrameDecoder().max_length == 1 << 20


@settings(max_examples=300, deadline=None)
@given(
    chunks=st.lists(
        st.one_of(
            st.binary(max_size=40),
            st.builds(
                lambda t, p: encode_message(t, p),
                st.sampled_from(MessageType),
                st.dictionaries(st.text(max_size=5), st.integers(0, 2**64 - 1), max_size=3),
            ),
            st.integers(0, 2**64 - 1).map(lambda n: n.to_bytes(8, "little")),
        ),
        max_size=8,
    )
)
def test_fuzz_decoder_raises_only_protocol_errors(chunks):
    dec = FrameDecoder(max_length=256)
    for chunk in chunks:
        try:
            for msg in dec.feed(chunk):
                assert isinstance(msg.type, MessageType) and isinstance(msg.payload, dict)
        except (RemoteProtocolError, MalformedJsonError):
            pass
        assert len(dec._buf) <= 256 + 8


# ---- segment descriptor --------------------------------------------------------------

NATIVE = NativeInfo(
    version=1,
    data_port=16011,
    regions=(
        RegionDesc(0x1000, 4096, 7),
        RegionDesc(2**63, 2**63, 2**32 - 1),
        # GPU regions: a legacy IPC handle; VMM chunks covering a region that starts inside the
        # first; GPU memory that cannot be shared
        RegionDesc(0x7F00_0000_0000, 1 << 20, 8, cuda=GpuShare(0, ipc="ab" * 64, base=0x7F00_0000_0000)),
        RegionDesc(0x7E00_0010_0000, 40 << 20, 9,
                   cuda=GpuShare(1, vmm=((0x7E00_0000_0000, 20 << 20, 31), (0x7E00_0140_0000, 20 << 20, 32),
                                         (0x7E00_0280_0000, 20 << 20, 33)))),
        RegionDesc(0x7D00_0000_0000, 4096, 10, cuda=GpuShare(2)),
    ),
    boot_id="3f1c-boot",
    pid=4242,
)
SEG = SegmentDesc(
    name="10.0.0.5:15873",
    tcp_data_port=16011,
    timestamp="2026-08-22 10:00:00.123456",
    buffers=(BufferDesc("10.0.0.5:15873", 139872312000512, 1 << 30),),
    native=NATIVE,
)


def test_segment_json_matches_mooncake_keys():
    d = SEG.to_json_dict()
    assert set(d) == {
        "name", "protocol", "tcp_data_port", "tcp_proto_version", "timestamp", "buffers",
        "flagcx_mc",
    }
    assert d["buffers"] == [{"name": "10.0.0.5:15873", "addr": 139872312000512, "length": 1 << 30}]
    assert d["protocol"] == "tcp" and d["tcp_proto_version"] == 2
    assert set(d["flagcx_mc"]) == {"version", "data_port", "regions", "boot_id", "pid"}
    assert d["flagcx_mc"]["regions"][0] == {"addr": 0x1000, "length": 4096, "key": 7}
    assert "flagcx_mc" not in SegmentDesc(name="x", tcp_data_port=1).to_json_dict()


def test_segment_round_trip_through_frame():
    frame = encode_message(MessageType.METADATA, SEG.to_json_dict())
    [msg] = FrameDecoder().feed(frame)
    assert SegmentDesc.from_json_dict(msg.payload) == SEG


def test_timestamp_filled_in_when_empty():
    ts = SegmentDesc(name="n", tcp_data_port=1).to_json_dict()["timestamp"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}", ts)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}", now_timestamp())


def test_plain_mooncake_descriptor_decodes():
    text = (
        b'{"buffers":[{"addr":139872312000512,"length":1073741824,"name":"10.0.0.5:15873"}],'
        b'"name":"10.0.0.5:15873","protocol":"tcp","tcp_data_port":16011,'
        b'"timestamp":"2026-08-22 10:00:00.123456","rdma_server_name":"x","devices":[]}'
    )
    seg = SegmentDesc.from_json_dict(orjson.loads(text))
    assert seg.native is None
    assert seg.tcp_proto_version == 1  # absent => 1, as Mooncake reads it
    assert seg.buffers == (BufferDesc("10.0.0.5:15873", 139872312000512, 1 << 30),)


def test_non_tcp_descriptor_needs_no_data_port():
    seg = SegmentDesc.from_json_dict({"name": "n", "protocol": "rdma", "buffers": []})
    assert seg.protocol == "rdma" and seg.tcp_data_port == 0


def _mutate(path, value):
    d = copy.deepcopy(SEG.to_json_dict())
    target = d
    for key in path[:-1]:
        target = target[key]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return d


_DELETE = object()

BAD_DESCRIPTORS = {
    "missing-name": (("name",), _DELETE),
    "missing-protocol": (("protocol",), _DELETE),
    "missing-buffers": (("buffers",), _DELETE),
    "missing-tcp-port": (("tcp_data_port",), _DELETE),
    "name-int": (("name",), 5),
    "protocol-list": (("protocol",), ["tcp", "rdma"]),
    "buffers-dict": (("buffers",), {}),
    "port-bool": (("tcp_data_port",), True),
    "port-float": (("tcp_data_port",), 16011.0),
    "port-too-big": (("tcp_data_port",), 65536),
    "port-negative": (("tcp_data_port",), -1),
    "version-str": (("tcp_proto_version",), "2"),
    "timestamp-int": (("timestamp",), 0),
    "buffer-not-object": (("buffers", 0), "buf"),
    "buffer-empty-name": (("buffers", 0, "name"), ""),
    "buffer-zero-addr": (("buffers", 0, "addr"), 0),
    "buffer-zero-length": (("buffers", 0, "length"), 0),
    "buffer-negative-addr": (("buffers", 0, "addr"), -4096),
    "buffer-addr-u64": (("buffers", 0, "addr"), 2**64),
    "buffer-length-bool": (("buffers", 0, "length"), True),
    "buffer-missing-addr": (("buffers", 0, "addr"), _DELETE),
    "buffer-wraps": (("buffers", 0, "length"), 2**64 - 139872312000512 + 1),
    "native-not-object": (("flagcx_mc",), []),
    "native-null": (("flagcx_mc",), None),
    "native-missing-pid": (("flagcx_mc", "pid"), _DELETE),
    "native-missing-regions": (("flagcx_mc", "regions"), _DELETE),
    "native-port-big": (("flagcx_mc", "data_port"), 70000),
    "native-version-bool": (("flagcx_mc", "version"), False),
    "native-boot-id-int": (("flagcx_mc", "boot_id"), 1),
    "native-pid-negative": (("flagcx_mc", "pid"), -1),
    "region-key-u32": (("flagcx_mc", "regions", 0, "key"), 2**32),
    "region-key-negative": (("flagcx_mc", "regions", 0, "key"), -1),
    "region-addr-u64": (("flagcx_mc", "regions", 0, "addr"), 2**64),
    "region-length-str": (("flagcx_mc", "regions", 0, "length"), "4096"),
    "region-overflow": (("flagcx_mc", "regions", 1, "length"), 2**63 + 1),
    "region-not-object": (("flagcx_mc", "regions", 0), 3),
    "gpu-no-device": (("flagcx_mc", "regions", 4, "cuda", "dev"), _DELETE),
    "gpu-device-big": (("flagcx_mc", "regions", 4, "cuda", "dev"), 5000),
    "gpu-ipc-short": (("flagcx_mc", "regions", 2, "cuda", "ipc"), "ab" * 32),
    "gpu-ipc-not-hex": (("flagcx_mc", "regions", 2, "cuda", "ipc"), "zz" * 64),
    "gpu-ipc-no-base": (("flagcx_mc", "regions", 2, "cuda", "base"), _DELETE),
    "gpu-ipc-and-vmm": (("flagcx_mc", "regions", 2, "cuda", "vmm"), [[0x7F00_0000_0000, 1 << 20, 3]]),
    "gpu-vmm-empty": (("flagcx_mc", "regions", 3, "cuda", "vmm"), []),
    "gpu-vmm-not-list": (("flagcx_mc", "regions", 3, "cuda", "vmm"), {"base": 1}),
    "gpu-vmm-pair": (("flagcx_mc", "regions", 3, "cuda", "vmm", 0), [0x7E00_0000_0000, 20 << 20]),
    "gpu-vmm-bool": (("flagcx_mc", "regions", 3, "cuda", "vmm", 0, 2), True),
    "gpu-vmm-fd-big": (("flagcx_mc", "regions", 3, "cuda", "vmm", 0, 2), 2**31),
    "gpu-vmm-zero-size": (("flagcx_mc", "regions", 3, "cuda", "vmm", 1, 1), 0),
    "gpu-vmm-gap": (("flagcx_mc", "regions", 3, "cuda", "vmm", 1, 0), 0x7E00_0140_1000),
    "gpu-vmm-short": (("flagcx_mc", "regions", 3, "cuda", "vmm", 2, 1), 512 << 10),
    "gpu-vmm-starts-late": (("flagcx_mc", "regions", 3, "cuda", "vmm", 0),
                            [0x7E00_0020_0000, (20 << 20) - (2 << 20), 31]),
    "gpu-vmm-too-many": (("flagcx_mc", "regions", 3, "cuda", "vmm"),
                         [[0x7E00_0000_0000 + i * 4096, 4096, 3] for i in range(8193)]),
}


@pytest.mark.parametrize("case", list(BAD_DESCRIPTORS))
def test_descriptor_validation(case):
    d = _mutate(*BAD_DESCRIPTORS[case])
    with pytest.raises(MalformedJsonError):
        SegmentDesc.from_json_dict(d)


@pytest.mark.parametrize("bad", [None, [], "seg", 3])
def test_descriptor_must_be_object(bad):
    with pytest.raises(MalformedJsonError):
        SegmentDesc.from_json_dict(bad)


def test_gpu_regions_round_trip_with_how_to_map_them():
    regions = SegmentDesc.from_json_dict(SEG.to_json_dict()).native.regions
    assert regions[2].cuda == GpuShare(0, ipc="ab" * 64, base=0x7F00_0000_0000)
    assert [chunk[2] for chunk in regions[3].cuda.vmm] == [31, 32, 33]
    assert regions[4].cuda == GpuShare(2) and regions[0].cuda is None
    assert SEG.to_json_dict()["flagcx_mc"]["regions"][4]["cuda"] == {"dev": 2}


def test_region_edges_accepted():
    d = _mutate(("flagcx_mc", "regions", 1, "length"), 2**63)  # ends exactly at 2**64
    assert SegmentDesc.from_json_dict(d).native.regions[1].length == 2**63
    d = _mutate(("tcp_data_port",), 65535)
    assert SegmentDesc.from_json_dict(d).tcp_data_port == 65535


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**65), 2**65) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)
_keys = st.sampled_from(
    ["name", "protocol", "tcp_data_port", "tcp_proto_version", "timestamp", "buffers", "flagcx_mc"]
)


@settings(max_examples=300, deadline=None)
@given(
    base=st.sampled_from(["empty", "valid"]),
    edits=st.lists(
        st.tuples(st.sampled_from(["top", "buffer", "native", "region"]), _keys | st.text(max_size=6), json_values),
        max_size=4,
    ),
)
def test_fuzz_descriptor_raises_only_malformed_json(base, edits):
    d = {} if base == "empty" else SEG.to_json_dict()
    for where, key, value in edits:
        target = d
        if where == "buffer" and isinstance(d.get("buffers"), list) and d["buffers"]:
            target = d["buffers"][0]
        elif where in ("native", "region") and isinstance(d.get("flagcx_mc"), dict):
            target = d["flagcx_mc"]
            regions = target.get("regions")
            if where == "region" and isinstance(regions, list) and regions and isinstance(regions[0], dict):
                target = regions[0]
        if isinstance(target, dict):
            target[key] = value
    try:
        seg = SegmentDesc.from_json_dict(d)
    except MalformedJsonError:
        return
    again = SegmentDesc.from_json_dict(seg.to_json_dict())
    assert replace(again, timestamp=seg.timestamp) == seg
