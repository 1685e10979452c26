"""Side channel: blocks land verified by content, and every request ends (done or failed) in bounded time."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import time
from types import SimpleNamespace

import numpy as np
import orjson
import pytest
import zmq
import zmq.asyncio
from helpers.kv_peer_child import PeerProcess, block_digest

from flagcx_mc import AsyncTransferEngine, TransferEngine
from flagcx_mc.errors import InvalidArgumentError
from flagcx_mc.kv import (
    KV_FIRST,
    BootstrapRegistry,
    HeadSplit,
    KVLayout,
    KVReceiver,
    KVSender,
    LayoutError,
    RegistryError,
    SideChannelError,
    Status,
    WorkerKey,
    bind_free,
    check_disjoint,
    fixed_port,
    lookup_workers,
    planes_of,
    port_span,
    register_worker,
)
from flagcx_mc.kv.messages import ErrorReply, Ping, Pong, Result, decode, encode

# Event-loop networking: these tests run on uvloop too (tests/conftest.py says why).
pytestmark = pytest.mark.uvloop

NB, LAYERS, BLOCK = 32, 3, 4096


class KV:
    """One worker's paged KV cache: LAYERS tensors [2, NB, BLOCK] of random bytes."""

    def __init__(self, seed: int, block_shape=(BLOCK,), dtype=np.uint8) -> None:
        rng = np.random.default_rng(seed)
        high = 256 if dtype == np.uint8 else 1 << 16
        self.caches = [rng.integers(0, high, size=(2, NB, *block_shape), dtype=dtype) for _ in range(LAYERS)]
        self.layout = KVLayout.single([p for c in self.caches for p in planes_of(c, NB, KV_FIRST)])

    def digest(self, blocks) -> str:
        h = hashlib.sha256()
        for c in self.caches:
            for kv in (0, 1):
                for b in blocks:
                    h.update(c[kv, b].tobytes())
        return h.hexdigest()


@pytest.fixture
async def engines():
    async with AsyncTransferEngine(transfer_timeout=5.0) as pe, AsyncTransferEngine(transfer_timeout=5.0) as de:
        await pe.initialize("127.0.0.1")
        await de.initialize("127.0.0.1")
        yield pe, de


@contextlib.asynccontextmanager
async def registered(engine, *kvs):
    addrs = [a for kv in kvs for a in kv.layout.spans()[0]]
    lens = [n for kv in kvs for n in kv.layout.spans()[1]]
    await engine.batch_register_memory(addrs, lens)
    try:
        yield
    finally:
        await engine.batch_unregister_memory(addrs)


@pytest.fixture
async def pair(engines):
    pe, de = engines
    src, dst = KV(1), KV(2)
    async with registered(pe, src), registered(de, dst):
        async with KVSender(pe, src.layout, session=pe.session_name) as sender, \
                KVReceiver(de.session_name, dst.layout, ttl=2.0, grace=1.0) as receiver:
            endpoint = await sender.start()
            yield SimpleNamespace(src=src, dst=dst, sender=sender, receiver=receiver, endpoint=endpoint, pe=pe, de=de)


@contextlib.asynccontextmanager
async def fake_prefill(answer=None, endpoint=None):
    """A bare ROUTER standing in for prefill: records what arrives, answers ``answer(payload)`` frames."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    if endpoint is None:
        endpoint = bind_free(sock)
    else:
        sock.bind(endpoint)
    received = []

    async def serve():
        while True:
            frames = await sock.recv_multipart()
            received.append(frames[-1])
            for reply in (answer(frames[-1]) if answer else []):
                await sock.send_multipart([frames[0], reply])

    task = asyncio.get_running_loop().create_task(serve())
    try:
        yield endpoint, received
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        sock.close(0)
        ctx.destroy(0)


async def ask_raw(endpoint, *frames, timeout=5.0):
    """Send raw frames from a bare DEALER and decode the one reply."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        await sock.send_multipart(list(frames))
        assert await sock.poll(timeout * 1000, zmq.POLLIN), "no reply"
        return decode(await sock.recv())
    finally:
        sock.close(0)
        ctx.destroy(0)


def _free_endpoint() -> str:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        return bind_free(sock)
    finally:
        sock.close(0)
        ctx.term()


# ---------------------------------------------------------------------------------- happy paths


async def test_fetch_lands_every_block_verified_by_checksum(pair):
    requests = {"r1": ([3, 4, 5, 20], [0, 1, 2, 3]), "r2": ([9], [31]), "r3": ([10, 11, 12, 13], [12, 13, 7, 8])}
    untouched = sorted(set(range(NB)) - {b for _, dst in requests.values() for b in dst})
    before = pair.dst.digest(untouched)
    done = {rid: pair.sender.publish(rid, [src]) for rid, (src, _) in requests.items()}
    out = await pair.receiver.fetch(pair.endpoint, {rid: [dst] for rid, (_, dst) in requests.items()})
    assert {rid: o.status for rid, o in out.items()} == {rid: Status.DONE for rid in requests}
    for rid, (src, dst) in requests.items():
        assert pair.dst.digest(dst) == pair.src.digest(src), rid
        assert out[rid].nbytes == len(src) * 2 * LAYERS * BLOCK
        assert await done[rid] is True
    assert pair.dst.digest(untouched) == before, "blocks nobody asked for changed"
    # the fewest triplets went through the engine: r1 has 2 runs, r2 1, r3 2; 6 planes each
    assert pair.sender.stats["triplets"] == (2 + 1 + 2) * 2 * LAYERS


async def test_request_published_after_the_ask_is_served(pair):
    task = asyncio.ensure_future(pair.receiver.fetch(pair.endpoint, {"late": [[1, 2]]}))
    await asyncio.sleep(0.3)
    assert pair.sender.waiting == 1
    assert not task.done()
    done = pair.sender.publish("late", [[5, 6]])
    out = await task
    assert out["late"].ok and pair.dst.digest([1, 2]) == pair.src.digest([5, 6])
    assert await done is True and pair.sender.waiting == 0


async def test_many_concurrent_requests(pair):
    rng = np.random.default_rng(7)
    dst_perm = rng.permutation(NB)
    requests = {}
    for i in range(16):
        src = rng.choice(NB, size=2, replace=False).tolist()
        requests[f"c{i}"] = (src, dst_perm[2 * i:2 * i + 2].tolist())
        pair.sender.publish(f"c{i}", [src])
    results = await asyncio.gather(*(pair.receiver.fetch(pair.endpoint, {rid: [dst]})
                                     for rid, (_, dst) in requests.items()))
    assert all(r[rid].ok for r, rid in zip(results, requests, strict=True))
    for rid, (src, dst) in requests.items():
        assert pair.dst.digest(dst) == pair.src.digest(src), rid


async def test_sync_mooncake_style_engine_behind_the_sender(engines):
    _, de = engines
    src, dst = KV(3), KV(4)
    sync = TransferEngine(transfer_timeout=5.0)
    try:
        assert await asyncio.to_thread(sync.initialize, "127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert await asyncio.to_thread(sync.batch_register_memory, *src.layout.spans()) == 0
        async with registered(de, dst), KVSender(sync, src.layout) as sender, \
                KVReceiver(de.session_name, dst.layout, ttl=2.0, grace=1.0) as receiver:
            endpoint = await sender.start()
            sender.publish("s", [[0, 1, 2, 3, 4]])
            out = await receiver.fetch(endpoint, {"s": [[10, 11, 12, 13, 14]]})
            assert out["s"].ok, out["s"].reason
            assert dst.digest([10, 11, 12, 13, 14]) == src.digest([0, 1, 2, 3, 4])
    finally:
        await asyncio.to_thread(sync.close)


def _real_mooncake():
    try:
        os.environ.setdefault("MC_FORCE_TCP", "1")
        from mooncake.engine import TransferEngine as MooncakeEngine
    except Exception as exc:  # the wheel, or libibverbs1 for its import, is missing
        pytest.skip(f"Mooncake's wheel is not importable here: {exc}")
    return MooncakeEngine


async def test_real_mooncake_engine_behind_the_sender(engines):
    """The engine is passed in: Mooncake's own engine on the prefill side works as well (it
    writes into our decode engine in Mooncake's TCP framing)."""
    MooncakeEngine = _real_mooncake()
    _, de = engines
    src, dst = KV(5), KV(6)
    mc = MooncakeEngine()
    assert await asyncio.to_thread(mc.initialize, "127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert await asyncio.to_thread(mc.batch_register_memory, *src.layout.spans()) == 0
    async with registered(de, dst), KVSender(mc, src.layout) as sender, \
            KVReceiver(de.session_name, dst.layout, ttl=5.0, grace=2.0) as receiver:
        endpoint = await sender.start()
        sender.publish("m", [[0, 1, 2, 3]])
        out = await receiver.fetch(endpoint, {"m": [[20, 21, 22, 23]]})
        assert out["m"].ok, out["m"].reason
        assert dst.digest([20, 21, 22, 23]) == src.digest([0, 1, 2, 3])


async def test_different_tp_sizes_prefill_tp2_to_decode_tp1(engines):
    pe, de = engines
    split = HeadSplit(num_heads=4, block_size=4, head_bytes=32 * 2)  # HND blocks [heads, 4 tokens, 32 x u16]
    ranks = [KV(10 + r, block_shape=(2, 4, 32), dtype=np.uint16) for r in range(2)]
    dst = KV(20, block_shape=(4, 4, 32), dtype=np.uint16)
    async with registered(pe, *ranks), registered(de, dst), \
            KVReceiver(de.session_name, dst.layout, tp=(1, 0), ttl=2.0, grace=1.0) as receiver:
        senders = [KVSender(pe, kv.layout, tp=(2, r), split=split) for r, kv in enumerate(ranks)]
        try:
            endpoints = [await s.start() for s in senders]
            sources = split.sources(2, 1, 0)
            assert [r for r, _ in sources] == [0, 1]
            for s in senders:
                s.publish("h", [[7, 8, 3]])
            out = await receiver.fetch([endpoints[r] for r, _ in sources], {"h": [[0, 1, 2]]})
            assert out["h"].ok, out["h"].reason
            for got, r0, r1 in zip(dst.caches, ranks[0].caches, ranks[1].caches, strict=True):
                assert np.array_equal(got[:, [0, 1, 2], 0:2], r0[:, [7, 8, 3]])
                assert np.array_equal(got[:, [0, 1, 2], 2:4], r1[:, [7, 8, 3]])
        finally:
            for s in senders:
                await s.close()


async def test_publish_rules(pair):
    fut = pair.sender.publish("p", [[1]])
    with pytest.raises(SideChannelError, match="already published"):
        pair.sender.publish("p", [[2]])
    assert pair.sender.cancel("p") and await fut is False
    assert not pair.sender.cancel("p")
    with pytest.raises(LayoutError, match="beyond"):
        pair.sender.publish("q", [[NB]])
    expiring = pair.sender.publish("e", [[1]], expire=0.1)
    assert await asyncio.wait_for(expiring, 2) is False
    async with KVReceiver(pair.de.session_name, pair.dst.layout, ttl=0.2, grace=1.0) as receiver:
        out = await receiver.fetch(pair.endpoint, {"e": [[1]]})
    assert out["e"].status is Status.FAILED and "not published" in out["e"].reason


# ---------------------------------------------------------------------------------- failures


async def test_prefill_answers_an_engine_error_with_a_reason(engines):
    pe, de = engines
    src, dst = KV(5), KV(6)  # dst is NOT registered with the decode engine
    before = dst.digest(range(NB))
    async with registered(pe, src), KVSender(pe, src.layout) as sender, \
            KVReceiver(de.session_name, dst.layout, ttl=2.0, grace=1.0) as receiver:
        endpoint = await sender.start()
        done = sender.publish("x", [[1, 2]])
        t0 = time.monotonic()
        out = await receiver.fetch(endpoint, {"x": [[3, 4]]})
        assert out["x"].status is Status.FAILED
        assert "AddressNotRegistered" in out["x"].reason and "-3" in out["x"].reason
        assert time.monotonic() - t0 < 2.0, "an answered failure must not wait for the timeout"
        assert await done is False
    assert dst.digest(range(NB)) == before


async def test_sync_engine_failure_code_becomes_the_reason(pair):
    class Failing:
        def batch_transfer_sync_write(self, target, src, dst, lengths):
            return -105

    async with KVSender(Failing(), pair.src.layout) as sender:
        endpoint = await sender.start()
        sender.publish("f", [[0]])
        out = await pair.receiver.fetch(endpoint, {"f": [[0]]})
        assert out["f"].status is Status.FAILED and "returned -105" in out["f"].reason


async def test_layout_mismatch_fails_the_request(pair):
    other = KVLayout.single(pair.dst.layout.planes[:2])  # decode with fewer planes than prefill
    async with KVReceiver(pair.de.session_name, other, ttl=2.0, grace=1.0) as receiver:
        pair.sender.publish("m", [[0]])
        out = await receiver.fetch(pair.endpoint, {"m": [[0]]})
    assert out["m"].status is Status.FAILED and "layouts do not match" in out["m"].reason


async def test_prefill_that_never_answers_times_out_in_bounded_time(pair):
    async with fake_prefill() as (endpoint, received), \
            KVReceiver(pair.de.session_name, pair.dst.layout, ttl=0.4, grace=0.3) as receiver:
        t0 = time.monotonic()
        out = await receiver.fetch(endpoint, {"a": [[0]], "b": [[1]]})
        elapsed = time.monotonic() - t0
    assert {o.status for o in out.values()} == {Status.TIMEOUT}
    assert 0.65 < elapsed < 3.0
    assert len(received) == 1 and decode(received[0]).ttl_ms == 400


async def test_unreachable_prefill_times_out_and_is_never_delivered_late(pair):
    endpoint = _free_endpoint()
    async with KVReceiver(pair.de.session_name, pair.dst.layout, ttl=0.3, grace=0.2) as receiver:
        out = await receiver.fetch(endpoint, {"a": [[0]]})
        assert out["a"].status is Status.TIMEOUT and "unreachable" in out["a"].reason
        # A prefill that comes up on that port afterwards must not get the abandoned request.
        async with fake_prefill(endpoint=endpoint) as (_, received):
            await asyncio.sleep(0.6)
            assert received == []


async def test_error_reply_fails_the_message_at_once(pair):
    def refuse(payload):
        msg_id = orjson.loads(payload)["id"]
        return [encode(ErrorReply(msg_id, "version 1 is not supported (speaks [2])", (2,)))]

    async with fake_prefill(refuse) as (endpoint, _):
        t0 = time.monotonic()
        out = await pair.receiver.fetch(endpoint, {"a": [[0]], "b": [[1]]})
    assert {o.status for o in out.values()} == {Status.REJECTED}
    assert "not supported" in out["a"].reason and time.monotonic() - t0 < 1.0
    assert out["a"].quiet_at == 0  # prefill refused the whole message: it started nothing


async def test_reply_in_an_unknown_version_or_for_unknown_requests(pair):
    def newer(payload):
        msg_id = orjson.loads(payload)["id"]
        return [encode(Result(msg_id, "nobody", True)),  # unknown request: ignored
                b"\x00garbage",  # unreadable and uncorrelated: ignored
                encode(Result(msg_id, "a", True), version=2)]  # our message, but unreadable: rejected

    async with fake_prefill(newer) as (endpoint, _):
        out = await pair.receiver.fetch(endpoint, {"a": [[0]]})
    assert out["a"].status is Status.REJECTED and "unreadable reply" in out["a"].reason


async def test_sender_close_answers_waiting_requests_at_once(pair):
    futures = await pair.receiver.submit(pair.endpoint, {"w": [[0]]})
    for _ in range(100):
        if pair.sender.waiting:
            break
        await asyncio.sleep(0.01)
    assert pair.sender.waiting == 1
    t0 = time.monotonic()
    await pair.sender.close()
    outcome = await asyncio.wait_for(futures["w"], 1)
    assert outcome.status is Status.FAILED and "shutting down" in outcome.reason and outcome.quiet_at == 0
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(SideChannelError, match="closed"):
        pair.sender.publish("late", [[0]])


async def test_close_ends_pending_requests(pair):
    async with fake_prefill() as (endpoint, _):
        receiver = KVReceiver(pair.de.session_name, pair.dst.layout, ttl=30, grace=30)
        futures = await receiver.submit(endpoint, {"a": [[0]]})
        await asyncio.sleep(0.1)
        await receiver.close()
        outcome = await asyncio.wait_for(futures["a"], 1)
    assert outcome.status is Status.CLOSED and outcome.quiet_at > 0
    with pytest.raises(SideChannelError):
        await receiver.submit(endpoint, {"b": [[0]]})


async def test_malformed_and_unknown_messages_get_error_replies(pair):
    xfer = orjson.loads(encode(Ping("x")))
    cases = [
        ([b"garbage"], None, "not JSON"),
        ([b"[1, 2]"], None, "JSON object"),
        ([orjson.dumps({**xfer, "v": 7, "id": "v7"})], "v7", "version 7 is not supported"),
        ([orjson.dumps({"v": 1, "type": "xfer", "id": "bad", "session": "h:1"})], "bad", "missing field"),
        ([orjson.dumps({**xfer, "type": "teleport", "id": "t"})], "t", "unknown message type"),
        ([encode(Result("res", "r", True))], "res", "does not answer 'result'"),
        ([b"one", b"two"], None, "expected one frame"),
    ]
    for frames, msg_id, reason in cases:
        reply = await ask_raw(pair.endpoint, *frames)
        assert isinstance(reply, ErrorReply), frames
        assert reply.msg_id == msg_id and reason in reply.reason and reply.supported == (1,)
    pong = await ask_raw(pair.endpoint, encode(Ping("alive")))
    assert isinstance(pong, Pong) and pong.msg_id == "alive" and pong.session == pair.pe.session_name
    assert pair.sender.stats["refused"] == len(cases) - 1  # the two-frame case is refused before decoding
    # and it still moves data
    pair.sender.publish("after", [[2]])
    assert (await pair.receiver.fetch(pair.endpoint, {"after": [[2]]}))["after"].ok
    assert pair.dst.digest([2]) == pair.src.digest([2])


# ---------------------------------------------------------------------------------- other processes


@pytest.fixture
def prefill_child():
    child = PeerProcess("prefill", "--layers", "2", "--blocks", str(NB), "--block-len", str(BLOCK))
    yield child
    child.close()


class ChildKV:
    """Decode memory matching helpers/kv_peer_child.py's prefill layout (2 layers, K/V planes)."""

    def __init__(self) -> None:
        self.caches = [np.zeros((2, NB, BLOCK), dtype=np.uint8) for _ in range(2)]
        self.layout = KVLayout.single([p for c in self.caches for p in planes_of(c, NB, KV_FIRST)])

    def digest(self, blocks):
        return block_digest([SimpleNamespace(size=c.nbytes, view=memoryview(c).cast("B")) for c in self.caches],
                            BLOCK, list(blocks))


async def test_cross_process_fetch_verified_by_checksum(engines, prefill_child):
    _, de = engines
    dst = ChildKV()
    async with registered(de, dst), KVReceiver(de.session_name, dst.layout, ttl=5, grace=5) as receiver:
        digest = prefill_child.call("fill", blocks=[4, 5, 6, 30])["digest"]
        prefill_child.call("publish", rid="x", blocks=[[4, 5, 6, 30]])
        out = await receiver.fetch(prefill_child.endpoint, {"x": [[0, 1, 2, 3]]})
        assert out["x"].ok, out["x"].reason
        assert dst.digest([0, 1, 2, 3]) == digest
        assert prefill_child.call("finished")["finished"] == {"x": True}
        pong = await receiver.ping(prefill_child.endpoint)
        assert pong.session == prefill_child.session


async def _pending_on(child, receiver, endpoint, rid):
    futures = await receiver.submit(endpoint, {rid: [[0]]})
    for _ in range(100):
        if child.call("stats")["waiting"] == 1:
            return futures[rid]
        await asyncio.sleep(0.05)
    raise AssertionError("the prefill child never saw the request")


async def test_prefill_killed_mid_request_fails_fast(engines, prefill_child):
    _, de = engines
    dst = ChildKV()
    async with registered(de, dst), KVReceiver(de.session_name, dst.layout, ttl=30, grace=30) as receiver:
        pending = await _pending_on(prefill_child, receiver, prefill_child.endpoint, "k")
        t0 = time.monotonic()
        os.kill(prefill_child.pid, signal.SIGKILL)
        outcome = await asyncio.wait_for(pending, 10)
        assert outcome.status is Status.DISCONNECTED, outcome
        assert time.monotonic() - t0 < 3.0, "a dead prefill must not cost the full deadline"
        # decode cannot tell a dead prefill from a cut cable: it is told when the blocks are quiet
        assert asyncio.get_running_loop().time() + 50 < outcome.quiet_at
    prefill_child.kill()


async def test_frozen_prefill_is_detected_by_heartbeats(engines, prefill_child):
    _, de = engines
    dst = ChildKV()
    async with registered(de, dst), \
            KVReceiver(de.session_name, dst.layout, ttl=30, grace=30, heartbeat=0.2) as receiver:
        pending = await _pending_on(prefill_child, receiver, prefill_child.endpoint, "z")
        os.kill(prefill_child.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            outcome = await asyncio.wait_for(pending, 10)
            assert outcome.status is Status.DISCONNECTED, outcome
            assert time.monotonic() - t0 < 3.0
        finally:
            os.kill(prefill_child.pid, signal.SIGCONT)


# ---------------------------------------------------------------------------------- ports


def test_fixed_port_scheme_is_unique_across_dp_pp_tp():
    sizes = dict(pp_size=2, tp_size=2)
    ports = [fixed_port(20000, dp, pp, tp, **sizes) for dp in range(2) for pp in range(2) for tp in range(2)]
    assert len(set(ports)) == 8 == port_span(2, 2, 2) and min(ports) == 20000 and max(ports) == 20007
    # vLLM's base + tp_rank: both pipeline stages of a DP rank land on the same port
    assert len({20000 + tp for pp in range(2) for tp in range(2)}) == 2
    check_disjoint([(20000, port_span(2, 2, 2)), (20008, port_span(2, 2, 2))])  # prefill and decode on one host
    with pytest.raises(InvalidArgumentError, match="overlap"):
        check_disjoint([(20000, 8), (20004, 8)])
    with pytest.raises(InvalidArgumentError, match="outside"):
        fixed_port(20000, 0, 2, 0, **sizes)
    with pytest.raises(InvalidArgumentError, match="outside"):
        fixed_port(65534, 1, 1, 1, **sizes)


async def test_dp2_pp2_tp2_workers_on_one_host_never_collide():
    async with BootstrapRegistry() as registry:
        endpoint = await registry.start()
        keys = [WorkerKey("prefill", dp, pp, tp) for dp in range(2) for pp in range(2) for tp in range(2)]
        starts = [asyncio.to_thread(PeerProcess, "worker", "--registry", endpoint, "--instance", k.instance,
                                    "--dp", str(k.dp), "--pp", str(k.pp), "--tp", str(k.tp), "--tp-size", "2")
                  for k in keys]
        results = await asyncio.gather(*starts, return_exceptions=True)
        children = [r for r in results if isinstance(r, PeerProcess)]
        try:
            assert len(children) == 8, [r for r in results if not isinstance(r, PeerProcess)]
            table = await lookup_workers(endpoint, "prefill", expect=8, timeout=10)
            assert set(table) == set(keys)
            ports = {int(ep.rsplit(":", 1)[1]) for ep in table.values()}
            assert len(ports) == 8, "two workers got the same side-channel port"
            assert len({c.session for c in children}) == 8, "two engines got the same rpc port"
            async with KVReceiver("127.0.0.1:1", KVLayout()) as probe:
                for key, ep in table.items():
                    assert (await probe.ping(ep)).worker == key  # each port reaches its own worker
            # the registry refuses a second worker claiming a live endpoint
            with pytest.raises(RegistryError, match="already registered"):
                await register_worker(endpoint, WorkerKey("prefill", 9, 0, 0), table[keys[0]])
        finally:
            for child in children:
                child.close()


async def test_registry_rules():
    key = WorkerKey("decode", 0, 1, 1)
    async with BootstrapRegistry() as registry:
        endpoint = await registry.start()
        await register_worker(endpoint, key, "tcp://127.0.0.1:1000")
        await register_worker(endpoint, key, "tcp://127.0.0.1:1001")  # a restarted worker replaces its entry
        assert await lookup_workers(endpoint, "decode") == {key: "tcp://127.0.0.1:1001"}
        assert await lookup_workers(endpoint, "prefill") == {}
        t0 = time.monotonic()
        with pytest.raises(RegistryError, match="1 of 2 workers"):
            await lookup_workers(endpoint, "decode", expect=2, timeout=0.3)
        assert time.monotonic() - t0 < 5.0  # bounded (loose: the suite shares 2 cores)
        reply = await ask_raw(endpoint, b"junk")
        assert isinstance(reply, ErrorReply) and "not JSON" in reply.reason
        assert registry.table == {key: "tcp://127.0.0.1:1001"}
    with pytest.raises(RegistryError, match="did not answer"):
        await register_worker(_free_endpoint(), key, "tcp://127.0.0.1:1", timeout=0.3)
