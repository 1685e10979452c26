"""Side-channel messages: every type round-trips, and no input makes ``decode`` raise anything but MessageError."""

from __future__ import annotations

import copy
import json
import typing

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flagcx_mc.kv import KVLayout, Plane, TPRank, WorkerKey
from flagcx_mc.kv.messages import (
    MAX_MESSAGE_BYTES,
    Ack,
    ErrorReply,
    Lookup,
    Message,
    MessageError,
    Ping,
    Pong,
    Register,
    ReqBlocks,
    Result,
    UnsupportedVersionError,
    Workers,
    Xfer,
    decode,
    encode,
    new_id,
)

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

LAYOUT = KVLayout((
    (Plane(1 << 20, 4096, 64), Plane((1 << 20) + 64 * 4096, 4096, 64)),
    (Plane(1 << 30, 2048, 16, 4096, (1 << 30, 16 * 4096)),),
))
WORKER = WorkerKey("prefill-0", 1, 1, 0)

MESSAGES = [
    Xfer("m1", "10.0.0.5:15123", TPRank(2, 1), LAYOUT,
         (ReqBlocks("req-1", ((1, 2, 3), (0,))), ReqBlocks("req-2", ((), (5,)))), 30000),
    Result("m1", "req-1", True, "", 1 << 20),
    Result("m1", "req-2", False, "engine said -3", 0),
    Ping("p1"),
    Pong("p1", WORKER, "10.0.0.5:15000"),
    Pong("p2", None, ""),
    ErrorReply("m1", "bad"),
    ErrorReply(None, "not JSON"),
    Register("r1", WORKER, "tcp://10.0.0.5:41234"),
    Ack("r1"),
    Lookup("l1", "prefill-0"),
    Workers("l1", ((WORKER, "tcp://10.0.0.5:41234"), (WorkerKey("prefill-0", 0, 0, 0), "tcp://10.0.0.6:1"))),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    assert decode(encode(msg)) == msg


def _xfer_json():
    return orjson.loads(encode(MESSAGES[0]))


def _mutated(path, value):
    obj = _xfer_json()
    target = obj
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return orjson.dumps(obj)


@pytest.mark.parametrize("path,value,match", [
    (("session",), "", "empty"),
    (("session",), 5, "must be str"),
    (("tp",), [2, 2], "rank < size"),
    (("tp",), [2, True], "rank < size"),
    (("ttl_ms",), 0, "outside"),
    (("ttl_ms",), 1.5, "integer"),
    (("reqs", 0, "rid"), "", "empty"),
    (("reqs", 1, "rid"), "req-1", "twice"),
    (("reqs", 0, "blocks"), [[1, 2]], "block lists for 2 layout groups"),
    (("reqs", 0, "blocks", 0), [1, -2], "not an unsigned"),
    (("reqs", 0, "blocks", 0), [1, 2.0], "not an unsigned"),
    (("reqs", 0, "blocks", 0), [True], "not an unsigned"),
    (("reqs", 0), "req-1", "must be an object"),
    (("layout", 0, 0), [1, 2, 3], "plane is"),
    (("layout", 0, 0), [4096, 64, 4, 32, 4096, 1024], "stride"),
    (("layout", 0, 0), [4096, 64, 4, 64, 8192, 1024], "outside its span"),
    (("layout", 0), [], "non-empty"),
    (("layout",), {"a": 1}, "must be list"),
])
def test_invalid_xfer_fields_are_refused_with_the_message_id(path, value, match):
    with pytest.raises(MessageError, match=match) as info:
        decode(_mutated(path, value))
    assert info.value.msg_id == "m1"
    assert not isinstance(info.value, UnsupportedVersionError)


@pytest.mark.parametrize("field", ["session", "tp", "layout", "reqs", "ttl_ms"])
def test_missing_xfer_fields_are_refused(field):
    obj = _xfer_json()
    del obj[field]
    with pytest.raises(MessageError, match=f"missing field '{field}'"):
        decode(orjson.dumps(obj))


@pytest.mark.parametrize("version", [0, 2, 99, -1])
def test_unknown_versions_are_refused_with_the_id(version):
    with pytest.raises(UnsupportedVersionError, match="not supported") as info:
        decode(encode(MESSAGES[0], version=version))
    assert info.value.msg_id == "m1"


@pytest.mark.parametrize("data,match", [
    (b"", "not JSON"),
    (b"\xff\xfe", "not JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"type": "ping", "id": "a"}', "version"),
    (b'{"v": "1", "type": "ping", "id": "a"}', "version"),
    (b'{"v": true, "type": "ping", "id": "a"}', "version"),
    (b'{"v": 1, "type": "ping"}', "'id'"),
    (b'{"v": 1, "type": "ping", "id": ""}', "'id'"),
    (b'{"v": 1, "type": "ping", "id": 7}', "'id'"),
    (b'{"v": 1, "type": "launch", "id": "a"}', "unknown message type"),
    (b'{"v": 1, "type": null, "id": "a"}', "unknown message type"),
    (b'{"v": 1, "type": "error", "id": 3, "reason": ""}', "'id'"),
    (b'{"v": 1, "type": "result", "id": "a", "rid": "r", "ok": 1}', "'ok' must be bool"),
    (b'{"v": 1, "type": "register", "id": "a", "worker": {"instance": "x", "dp": 0, "pp": -1, "tp": 0}, '
     b'"endpoint": "tcp://h:1"}', "outside"),
])
def test_malformed_messages_are_refused(data, match):
    with pytest.raises(MessageError, match=match):
        decode(data)


def test_oversized_message_is_refused_before_parsing():
    with pytest.raises(MessageError, match="exceeds"):
        decode(b" " * (MAX_MESSAGE_BYTES + 1))


def test_unknown_fields_are_ignored_and_error_may_lack_an_id():
    obj = _xfer_json()
    obj["future_field"] = {"x": [1, 2]}
    assert decode(orjson.dumps(obj)) == MESSAGES[0]
    assert decode(b'{"v": 1, "type": "error", "id": null, "reason": "x"}') == ErrorReply(None, "x", ())


def test_message_ids_are_unique():
    ids = {new_id() for _ in range(10000)}
    assert len(ids) == 10000


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=20,
)


def _assert_is_a_valid_message(out) -> None:
    """What ``decode`` accepts is one of the message types and survives its own round trip."""
    assert isinstance(out, typing.get_args(Message)), out
    assert decode(encode(out)) == out


@SETTINGS
@given(st.binary(max_size=256))
def test_random_bytes_raise_only_message_error(data):
    try:
        out = decode(data)
    except MessageError:
        return
    _assert_is_a_valid_message(out)


@SETTINGS
@given(st.sampled_from(["v", "type", "id", "session", "tp", "layout", "reqs", "ttl_ms"]), json_values)
def test_any_value_in_any_xfer_field_raises_only_message_error(field, value):
    obj = _xfer_json()
    obj[field] = value
    try:
        out = decode(json.dumps(obj).encode())  # json, not orjson: it also writes integers beyond 64 bits
    except MessageError:
        return
    _assert_is_a_valid_message(out)


@SETTINGS
@given(st.sampled_from(MESSAGES), st.data())
def test_any_nested_mutation_raises_only_message_error(msg, data):
    obj = orjson.loads(encode(msg))
    target, key = obj, None
    # walk down a random path, then replace what is there
    while True:
        keys = list(target.keys()) if isinstance(target, dict) else list(range(len(target)))
        if not keys:
            break
        key = data.draw(st.sampled_from(keys))
        if not isinstance(target[key], (dict, list)) or data.draw(st.booleans()):
            break
        target = target[key]
    if key is None:
        return
    original = copy.deepcopy(obj)
    target[key] = data.draw(json_values)
    try:
        out = decode(json.dumps(obj).encode())
    except MessageError:
        return
    if obj == original:
        assert out == msg
