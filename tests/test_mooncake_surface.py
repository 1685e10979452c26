"""Every Mooncake method beyond the spine: success and failure, verified by content."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import subprocess
import sys
import textwrap

import pytest

import flagcx_mc
from flagcx_mc import (
    HostBuffer,
    TransferEngine,
    TransferNotify,
    TransferOpcode,
    errors,
)


@pytest.fixture(scope="module")
def pair():
    """Two sync engines in this process (the node fixture gives the cross-process cases)."""
    a, b = TransferEngine(transfer_timeout=10.0), TransferEngine(transfer_timeout=10.0)
    assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    abuf, bbuf = HostBuffer(8 << 20), HostBuffer(8 << 20)
    assert a.register_memory(abuf.addr, abuf.size) == 0 and b.register_memory(bbuf.addr, bbuf.size) == 0
    yield a, abuf, b, bbuf
    a.close()
    b.close()
    abuf.close()
    bbuf.close()


def test_module_names():
    assert TransferOpcode.Read == 0 and TransferOpcode.Write == 1
    assert flagcx_mc.Read is TransferOpcode.Read and TransferEngine.TransferOpcode is TransferOpcode
    n = TransferNotify("k", "v")
    assert (n.name, n.msg) == ("k", "v") and (TransferNotify().name, TransferNotify().msg) == ("", "")
    assert flagcx_mc.SUPPORT_EFA is False and isinstance(flagcx_mc.SUPPORT_CUDA, bool)


def test_async_batches_write_and_read(pair, node):
    a, abuf, _, _ = pair
    digest = abuf.fill_random(0, 4 << 20)
    ids = [a.batch_transfer_async_write(node.session, [abuf.addr + i * (1 << 20)], [node.addr(0, i << 20)], [1 << 20])
           for i in range(4)]
    assert all(isinstance(i, int) and i > 0 for i in ids) and len(set(ids)) == 4
    assert a.get_batch_transfer_status(ids) == 0
    assert node.call("digest", region=0, offset=0, length=4 << 20)["digest"] == digest
    assert a.get_batch_transfer_status(ids) == -1  # already completed and freed

    remote = node.call("fill", region=1)["digest"]
    size = node.regions[1][1]
    bid = a.batch_transfer_async_read(node.session, [abuf.addr], [node.addr(1)], [size])
    assert bid and a.get_batch_transfer_status([bid]) == 0 and abuf.digest(0, size) == remote
    bid = a.batch_transfer_async(node.session, [abuf.addr], [node.addr(1)], [size], TransferOpcode.Write)
    assert bid and a.get_batch_transfer_status([bid]) == 0


def test_async_batch_failures_return_mooncake_values(pair, node, caplog):
    a, abuf, _, _ = pair
    with caplog.at_level(logging.ERROR, logger="flagcx_mc"):
        assert a.batch_transfer_async_write(node.session, [abuf.addr], [16], [8]) == 0
        assert a.batch_transfer_async_write("127.0.0.1:1", [abuf.addr], [16], [8]) == 0
        assert a.batch_transfer_async(node.session, [abuf.addr], [node.addr(1)], [8], 7) == 0
        assert a.get_batch_transfer_status([123456789]) == -1
        assert a.transfer_check_status(987654321) == -1
    assert "unknown batch id" in caplog.text


def test_submit_and_check_status(pair, node):
    a, abuf, _, _ = pair
    digest = abuf.fill_random(0, 1 << 20)
    bid = a.transfer_submit_write(node.session, abuf.addr, node.addr(0), 1 << 20)
    assert bid > 0
    seen = set()
    for _ in range(10_000):
        status = a.transfer_check_status(bid)
        seen.add(status)
        if status != 0:
            break
    assert status == 1 and seen <= {0, 1}
    assert node.call("digest", region=0, offset=0, length=1 << 20)["digest"] == digest
    assert a.transfer_check_status(bid) == -1  # freed once reported complete


def test_transfer_sync_with_notify_arrives_after_data(pair):
    a, abuf, b, bbuf = pair
    digest = abuf.fill_random(0, 1 << 20)
    note = TransferNotify("req-7", "kv ready")
    assert a.transfer_sync(b.session_name, abuf.addr, bbuf.addr, 1 << 20, TransferOpcode.Write, note) == 0
    got = b.get_notifies()
    assert got == [note] and bbuf.digest(0, 1 << 20) == digest
    assert b.get_notifies() == []
    bbuf.fill_random(0, 1 << 20)
    assert a.batch_transfer_sync(b.session_name, [abuf.addr], [bbuf.addr], [1 << 20], TransferOpcode.Read) == 0
    assert abuf.digest(0, 1 << 20) == bbuf.digest(0, 1 << 20)
    assert a.transfer_sync(b.session_name, abuf.addr, bbuf.addr, 8, 5) == -1  # bad opcode


def test_managed_buffers(pair):
    a, abuf, b, bbuf = pair
    addrs = [a.allocate_managed_buffer(n) for n in (1, 8192, 100_000, 300 << 20)]
    assert all(addrs) and len(set(addrs)) == 4
    payload = bytes(range(256)) * 40
    assert a.write_bytes_to_buffer(addrs[2], payload, len(payload)) == 0
    assert a.read_bytes_from_buffer(addrs[2], len(payload)) == payload
    # Managed memory is registered: a peer can write into it.
    digest = bbuf.fill_random(0, 100_000)
    assert b.transfer_sync_write(a.session_name, bbuf.addr, addrs[2], 100_000) == 0
    assert hashlib.sha256(a.read_bytes_from_buffer(addrs[2], 100_000)).hexdigest() == digest
    assert b.transfer_sync_write(a.session_name, bbuf.addr, addrs[3], 1 << 20) == 0  # the dedicated mapping
    for addr, n in zip(addrs, (1, 8192, 100_000, 300 << 20), strict=True):
        assert a.free_managed_buffer(addr, n) == 0
    assert a.free_managed_buffer(addrs[0], 1) == -1  # double free is an error, not a crash
    assert a.allocate_managed_buffer(0) == 0 and a.allocate_managed_buffer(-5) == 0
    # Freed dedicated memory is unregistered: remote writes to it are refused.
    assert b.transfer_sync_write(a.session_name, bbuf.addr, addrs[3], 4096) == -3


def test_bytes_helpers_refuse_unregistered_memory(pair):
    a, abuf, _, _ = pair
    assert a.write_bytes_to_buffer(abuf.addr + abuf.size - 2, b"abcd", 4) == -3
    assert a.write_bytes_to_buffer(abuf.addr, b"ab", 4) == -1  # longer than the source
    assert a.read_bytes_from_buffer(0x1000, 16) == b""
    assert a.write_bytes_to_buffer(abuf.addr, b"wxyz", 4) == 0 and abuf.read(0, 4) == b"wxyz"


def test_first_buffer_address_probe_topology(pair, node):
    a, _, b, bbuf = pair
    assert a.get_first_buffer_address(node.session) == node.regions[0][0]
    assert a.get_first_buffer_address("127.0.0.1:1") == 0
    assert a.send_probe(b.session_name) == 0
    assert a.send_probe("127.0.0.1:1") == -102
    topo = json.loads(a.get_local_topology())
    assert "cpu:0" in topo and topo["cpu:0"] == [[], []]
    assert a.warmup_efa_segment(b.session_name) == 0
    assert a.get_engine_ptr() == 0 and a.get_engine() is None
    with pytest.raises(RuntimeError):
        a.transfer_write_on_cuda(b.session_name, bbuf.addr, bbuf.addr, 8)


def test_low_level_api(pair, node):
    a, abuf, _, _ = pair
    conn = a.get_conn(node.session)
    desc = a.make_desc(conn, node.addr(1, 4096), 8192)
    assert (desc.region_base, desc.addr, desc.size) == (node.regions[1][0], node.addr(1, 4096), 8192) and desc.key
    with pytest.raises(errors.AddressNotRegisteredError):
        a.make_desc(conn, node.addr(1, node.regions[1][1] - 8), 16)
    digest = abuf.fill_random(0, 8192)
    assert a.write_vector_sync(conn, [abuf.addr, abuf.addr + 4096], [desc, a.make_desc(conn, node.addr(1, 8192), 4096)],
                               [4096, 4096]) == 0
    assert node.call("digest", region=1, offset=4096, length=8192)["digest"] == digest
    xid = a.read_vector(conn, [abuf.addr + (1 << 20)], [desc], [8192])
    while (status := a.xfer_status(xid)) == 0:
        pass
    assert status == 1 and abuf.digest(1 << 20, 8192) == digest
    assert a.write_vector(conn, [abuf.addr], [desc], [desc.size + 1]) == 0  # larger than its descriptor


async def test_async_surface_raises_typed_errors(engine, node, local_buf):
    with pytest.raises(errors.InvalidArgumentError):
        await engine.batch_transfer_async(node.session, [local_buf.addr], [node.addr(1)], [8], 3)
    bid = await engine.batch_transfer_async_write(node.session, [local_buf.addr], [node.addr(1)], [64])
    await engine.get_batch_transfer_status([bid])
    with pytest.raises(errors.InvalidArgumentError):
        await engine.get_batch_transfer_status([bid])
    with pytest.raises(errors.PeerConnectionError):
        await engine.send_probe("127.0.0.1:1")
    with pytest.raises(errors.InvalidArgumentError):
        await engine.allocate_managed_buffer(0)
    with pytest.raises(errors.NotSupportedError):
        await engine.transfer_write_on_cuda(node.session, 0, 0, 0)


def test_import_alias_runs_unmodified_mooncake_code(tmp_path, node):
    script = tmp_path / "mooncake_user.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        from mooncake.engine import TransferEngine, TransferOpcode
        import mooncake.engine
        assert getattr(mooncake.engine, "__flagcx_mc__", False)
        from flagcx_mc import HostBuffer
        engine = TransferEngine()
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
        buf = HostBuffer(1 << 16)
        assert engine.batch_register_memory([buf.addr], [buf.size]) == 0
        digest = buf.fill_random()
        rc = engine.batch_transfer_sync_write({node.session!r}, [buf.addr], [{node.addr(1)}], [buf.size])
        print("rc", rc, digest)
    """))
    out = subprocess.run([sys.executable, "-m", "flagcx_mc.compat", str(script)], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    rc, digest = out.stdout.split()[1:3]
    assert rc == "0"
    assert node.call("digest", region=1, offset=0, length=1 << 16)["digest"] == digest


_ALIAS_CHECKS = textwrap.dedent("""
    import importlib.util, sys
    spec = importlib.util.find_spec("mooncake.engine")   # SGLang's availability check
    assert spec is not None and spec.name == "mooncake.engine", spec
    from mooncake.engine import TransferEngine
    assert TransferEngine.__module__.startswith("flagcx_mc."), TransferEngine
    import mooncake
    real = not getattr(mooncake, "__flagcx_mc__", False)
    print("real" if real else "placeholder")
    if real:
        import mooncake.store, mooncake.buffer_pool   # the rest of Mooncake still imports
        assert not getattr(mooncake.store, "__flagcx_mc__", False)
    else:
        try:
            import mooncake.store
        except ModuleNotFoundError:
            pass
        else:
            raise AssertionError("a placeholder package invented mooncake.store")
""")


def test_alias_replaces_mooncake_engine_alone(tmp_path):
    script = tmp_path / "checks.py"
    script.write_text(_ALIAS_CHECKS)
    out = subprocess.run([sys.executable, "-m", "flagcx_mc.compat", str(script)], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    if importlib.util.find_spec("mooncake") is not None:
        assert out.stdout.split() == ["real"]


def test_alias_without_mooncake_installed(tmp_path):
    """Where no real Mooncake exists, an empty package with a proper spec holds the stand-in."""
    script = tmp_path / "checks.py"
    script.write_text("import importlib.machinery, sys\n"
                      "from flagcx_mc import compat\n"
                      "compat._MooncakeEngineFinder._real_package_spec = lambda self: None  # hide a real one\n"
                      "compat.install_mooncake_alias()\n" + _ALIAS_CHECKS)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["placeholder"]


def test_alias_refuses_to_replace_an_imported_real_mooncake_engine(tmp_path):
    if importlib.util.find_spec("mooncake") is None:
        pytest.skip("Mooncake's wheel is not installed here (the [test] extra installs it)")
    script = tmp_path / "checks.py"
    script.write_text(textwrap.dedent("""
        import mooncake.engine as real
        from flagcx_mc import compat
        try:
            compat.install_mooncake_alias()
        except RuntimeError:
            pass
        else:
            raise AssertionError("replaced an imported mooncake.engine without force")
        assert compat.install_mooncake_alias(force=True).__flagcx_mc__
        import mooncake.engine
        assert mooncake.engine is not real and mooncake.engine.__flagcx_mc__
        compat.uninstall_mooncake_alias()
        import importlib
        assert not getattr(importlib.import_module("mooncake.engine"), "__flagcx_mc__", False)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
