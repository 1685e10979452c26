"""The core's settings belong to each engine (EngineConfig → fmc_options), so two engines in one
process can differ, a keyword sets one without touching the environment, and the FLAGCX_MC_*
variables still set the defaults."""
from __future__ import annotations

import socket
import struct

import pytest

from flagcx_mc import HostBuffer
from flagcx_mc._core import OP_WRITE, CoreEngine, CorePeer
from flagcx_mc.config import EngineConfig

PREAMBLE_VECTORS, PREAMBLE_READ_ACKS = 2, 4
CAP_VECTORS, CAP_ZC_READS = 1, 2
KNOBS = ("FLAGCX_MC_LOCAL_CC", "FLAGCX_MC_PREFAULT", "FLAGCX_MC_VECTORS", "FLAGCX_MC_SPIN_US",
         "FLAGCX_MC_COPY_THREADS", "FLAGCX_MC_ZEROCOPY")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in KNOBS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def engines():
    made = []

    def make(**overrides) -> CoreEngine:
        config = None if overrides.pop("_from_env", False) else EngineConfig.from_env(**overrides)
        made.append(CoreEngine("127.0.0.1", config=config))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def _target_caps(core: CoreEngine) -> int:
    """The capability bits a target answers our preamble with (it offers every feature)."""
    with socket.create_connection(("127.0.0.1", core.data_port), timeout=5) as s:
        s.sendall(b"FMCNATV1" + struct.pack("<II", 1, PREAMBLE_VECTORS | PREAMBLE_READ_ACKS))
        answer = b""
        while len(answer) < 16:
            chunk = s.recv(16 - len(answer))
            assert chunk, "the target closed the connection"
            answer += chunk
    assert answer[:8] == b"FMCNATOK"
    return struct.unpack("<I", answer[12:16])[0]


def test_two_engines_in_one_process_differ_in_zero_copy(engines):
    on, off = engines(), engines(zerocopy=False)
    assert _target_caps(on) & CAP_ZC_READS
    assert not _target_caps(off) & CAP_ZC_READS
    assert _target_caps(off) & CAP_VECTORS  # only that setting differs


def test_the_environment_still_sets_the_default_and_a_keyword_wins(engines, monkeypatch):
    monkeypatch.setenv("FLAGCX_MC_ZEROCOPY", "0")
    assert EngineConfig.from_env().zerocopy is False
    assert not _target_caps(engines(_from_env=True)) & CAP_ZC_READS  # CoreEngine without a config
    assert _target_caps(engines(zerocopy=True)) & CAP_ZC_READS


def test_vectors_are_an_initiator_engines_setting(engines):
    """Two initiators in one process write the same 32 small blocks to one target: the one made
    with vectors=False sends single requests, the other vectors."""
    target = engines()
    with HostBuffer(1 << 20) as there, HostBuffer(1 << 20) as here:
        key = target.register(there.addr, there.size)
        served = []
        for vectors in (False, True):
            initiator = engines(vectors=vectors)
            initiator.register(here.addr, here.size)
            peer = CorePeer(initiator, "127.0.0.1", target.data_port, 1, 0)
            try:
                peer.set_regions([(there.addr, there.size, key)])
                peer.connect(5000)
                before = target.stats()
                n, block = 32, 4096
                batch = peer.submit(OP_WRITE, n, [here.addr + i * block for i in range(n)],
                                    [there.addr + i * block for i in range(n)], [block] * n)
                rc, why = batch.wait(10_000)
                assert rc == 0, why
                after = target.stats()
                served.append((after["vectors_served"] - before["vectors_served"],
                               after["requests_served"] - before["requests_served"]))
            finally:
                peer.close()
    (single_vectors, single_requests), (vector_vectors, vector_requests) = served
    assert single_vectors == 0 and single_requests == 32
    assert vector_vectors >= 1 and vector_requests < 32


def test_settings_read_from_the_environment_as_the_core_read_them(monkeypatch):
    assert EngineConfig.from_env() == EngineConfig.from_env(
        local_cc="reno", prefault=True, vectors=True, spin_us=30, copy_threads=0, zerocopy=True)
    for name, value in [("FLAGCX_MC_LOCAL_CC", ""), ("FLAGCX_MC_PREFAULT", "0"), ("FLAGCX_MC_VECTORS", "0"),
                        ("FLAGCX_MC_SPIN_US", "-5"), ("FLAGCX_MC_COPY_THREADS", "0"),
                        ("FLAGCX_MC_ZEROCOPY", "0")]:
        monkeypatch.setenv(name, value)
    config = EngineConfig.from_env()
    assert (config.local_cc, config.prefault, config.vectors, config.spin_us, config.copy_threads,
            config.zerocopy) == ("", "off", False, 0, 1, False)
    assert EngineConfig.from_env(spin_us=50, zerocopy=True).spin_us == 50  # keywords win
    monkeypatch.setenv("FLAGCX_MC_SPIN_US", "99999")
    assert EngineConfig.from_env().spin_us == 10000
