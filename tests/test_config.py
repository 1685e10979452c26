"""EngineConfig owns every setting: environment, Mooncake's variables and keywords, per engine."""
from __future__ import annotations

import pytest

from flagcx_mc import AsyncTransferEngine, TransferEngine
from flagcx_mc.config import EngineConfig, usable_cpus
from flagcx_mc.errors import InvalidArgumentError


def test_keywords_win_over_the_environment(monkeypatch):
    monkeypatch.setenv("MC_MIN_RPC_PORT", "16100")
    monkeypatch.setenv("MC_MAX_RPC_PORT", "16120")
    monkeypatch.setenv("FLAGCX_MC_ACCEPT_MOONCAKE_WIRE", "no")
    assert EngineConfig.from_env().rpc_port_range == (16100, 16120)
    assert EngineConfig.from_env().accept_mooncake_wire is False
    config = EngineConfig.from_env(rpc_port_range=[16200, 16201], accept_mooncake_wire=True)
    assert config.rpc_port_range == (16200, 16201) and config.accept_mooncake_wire is True


def test_tcp_timers_default_to_a_datacenters_and_come_from_the_environment(monkeypatch):
    config = EngineConfig.from_env()
    assert (config.rto_min_us, config.delack_max_us) == (5000, 5000)
    monkeypatch.setenv("FLAGCX_MC_RTO_MIN_US", "0")
    monkeypatch.setenv("FLAGCX_MC_DELACK_MAX_US", "20000")
    config = EngineConfig.from_env()
    assert (config.rto_min_us, config.delack_max_us) == (0, 20000)
    assert EngineConfig.from_env(rto_min_us=10000).rto_min_us == 10000


@pytest.mark.parametrize("bad", [
    {"rpc_port_range": (17000, 16000)},
    {"rpc_port_range": 16000},
    {"handshake_max_length": 4096},
    {"accept_mooncake_wire": "yes"},
    {"no_such_setting": 1},
    {"rto_min_us": 500},
    {"rto_min_us": 300_000},
    {"delack_max_us": -1},
    {"delack_max_us": 5.5},
])
def test_bad_settings_are_refused(bad):
    with pytest.raises(InvalidArgumentError):
        EngineConfig.from_env(**bad)
    eng = TransferEngine.__new__(TransferEngine)
    with pytest.raises(InvalidArgumentError):
        eng.__init__(**bad)


async def test_two_engines_in_one_process_differ():
    """Each engine takes its own port range from its keywords; the environment is untouched."""
    async with AsyncTransferEngine(rpc_port_range=(16300, 16310)) as a, \
            AsyncTransferEngine(rpc_port_range=(16400, 16410)) as b:
        await a.initialize("127.0.0.1")
        await b.initialize("127.0.0.1")
        assert 16300 <= await a.get_rpc_port() <= 16310
        assert 16400 <= await b.get_rpc_port() <= 16410
        assert a.config.rpc_port_range != b.config.rpc_port_range


async def test_data_port_range_apart_from_the_rpc_port():
    """A one-port rpc range still leaves the data listener somewhere to bind when it has its own."""
    async with AsyncTransferEngine(rpc_port_range=(16500, 16500), data_port_range=(16501, 16520)) as eng:
        await eng.initialize("127.0.0.1")
        assert await eng.get_rpc_port() == 16500
        assert 16501 <= eng.stats()["data_port"] <= 16520


def test_process_settings_come_from_the_environment(monkeypatch):
    from flagcx_mc.config import ProcessSettings

    for name in ("FLAGCX_MC_LIBCUDA", "FMC_TRACE_FILE", "FMC_TRACE_EVENTS"):
        monkeypatch.delenv(name, raising=False)
    assert ProcessSettings.from_env() == ProcessSettings(None, None, 0)
    monkeypatch.setenv("FLAGCX_MC_LIBCUDA", "/opt/fake/libcuda.so")
    monkeypatch.setenv("FMC_TRACE_FILE", "/tmp/trace")
    monkeypatch.setenv("FMC_TRACE_EVENTS", "5000")
    assert ProcessSettings.from_env() == ProcessSettings("/opt/fake/libcuda.so", "/tmp/trace", 5000)
    monkeypatch.setenv("FMC_TRACE_EVENTS", "lots")
    assert ProcessSettings.from_env().trace_events == 0


def test_streams_for_shares_the_budget_among_open_sessions():
    """A session gets half of the budget the open sessions left, at most streams_per_peer, at
    least one; the budget defaults to 4 x the CPUs this process may use."""
    config = EngineConfig.from_env(streams_per_peer=8, stream_budget=32)
    assert [config.streams_for(n) for n in (0, 8, 16, 24, 28, 30, 31, 32, 300)] == [8, 8, 8, 4, 2, 1, 1, 1, 1]
    used = 0
    for _ in range(64):  # 64 peers opened one after another: about the budget plus one per peer
        used += config.streams_for(used)
    assert used <= 32 + 64
    default = EngineConfig.from_env(streams_per_peer=4)
    assert default.streams_for(0) == min(4, 4 * usable_cpus())
    with pytest.raises(InvalidArgumentError):
        EngineConfig.from_env(stream_budget=-1)
