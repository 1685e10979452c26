"""Links that lose packets: two hosts (network namespaces) on one veth pair, shaped by the
bench's own ``ShapedLink`` (tbf rate, nftables drops on each input hook, offloads off so that a
drop is one packet).

Connections to other hosts get short TCP timers (``rto_min_us``, ``delack_max_us``) where the
kernel has them, so a lost packet at a call's tail costs milliseconds instead of the 200 ms
minimum RTO; a kernel without them is no error.  Every transfer is verified by content.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.clibs import build_helper_library

from flagcx_mc._core import lib
from flagcx_mc._testing.node import NodeProcess
from flagcx_mc.tools.bench import link as shaped

MIB = 1 << 20
KERNEL_RTO_MIN_MS = 200  # Linux's TCP_RTO_MIN


@pytest.fixture
def link():
    why = shaped.unavailable()
    if why:
        pytest.skip(why)
    with shaped.ShapedLink() as made:
        yield made


def _pair(link: shaped.ShapedLink, size: int, config: dict | None = None, env: dict | None = None):
    initiator_prefix, target_prefix = link.prefixes
    config = dict(config or {}, transport="tcp")
    target = NodeProcess(host=link.target_addr, regions=[size], config=config, env=env, argv_prefix=target_prefix)
    try:
        initiator = NodeProcess(host=link.initiator_addr, regions=[size], config=config, env=env,
                                argv_prefix=initiator_prefix)
    except BaseException:
        target.close()
        raise
    return initiator, target


def _move_verified(op: str, initiator: NodeProcess, target: NodeProcess, length: int, region: int = 0) -> None:
    """Random bytes from the op's source to its destination (region ``region`` on both sides),
    the destination zeroed first; the call must succeed and the bytes arrive exactly."""
    source, dest = (initiator, target) if op == "write" else (target, initiator)
    digest = source.call("fill", region=region, offset=0, length=length)["digest"]
    dest.call("set", region=region, byte=0, offset=0, length=length)
    remote = target.call("region_info", region=region)["addr"]
    reply = initiator.call("transfer", op=op, target=target.session, items=[[region, 0, remote, length]],
                           timeout=60.0)
    assert reply["rc"] == 0, (op, reply)
    assert dest.call("digest", region=region, offset=0, length=length)["digest"] == digest, op




def _data_connection_rtos(link: shaped.ShapedLink, target: NodeProcess) -> list[float]:
    """The RTO (ms) of every established connection the target holds with the initiator, but the
    handshake's: the data connections, as the kernel reports them."""
    rpc_port = int(target.session.rsplit(":", 1)[1])
    out = subprocess.run(link.prefixes[1] + ["ss", "-tinH", "state", "established", "dst", link.initiator_addr],
                         capture_output=True, text=True, check=True, timeout=10).stdout
    rtos: list[float] = []
    # ss prints each socket as an address line followed by an indented line of its TCP info.
    for head, info in zip(out.splitlines()[0::2], out.splitlines()[1::2], strict=False):
        local = head.split()[2] if len(head.split()) > 2 else ""
        if local.endswith(f":{rpc_port}"):
            continue
        found = re.search(r"\brto:(\d+(?:\.\d+)?)", info)
        if found:
            rtos.append(float(found.group(1)))
    return rtos


def _require_timer_options() -> None:
    if not lib.fmc_tcp_timer_options_supported():
        pytest.skip("this kernel has no per-socket TCP_RTO_MIN_US / TCP_DELACK_MAX_US (Linux 6.15+)")


def _rtos_after_moving(link: shaped.ShapedLink, ops: tuple[str, ...], config: dict | None = None,
                       env: dict | None = None) -> list[float]:
    """The target's data connections' RTOs (ms) after verified calls of ``ops`` of 4 MiB."""
    initiator, target = _pair(link, 4 * MIB, config=config, env=env)
    try:
        for op in ops:
            _move_verified(op, initiator, target, 4 * MIB)
        return _data_connection_rtos(link, target)
    finally:
        initiator.close()
        target.close()


def test_connections_to_another_host_get_the_short_retransmission_timer(link):
    _require_timer_options()
    rtos = _rtos_after_moving(link, ("write",))
    assert len(rtos) >= 4, rtos  # one per stream
    # 5 ms asked for, rounded up to the kernel's timer tick (4 ms at HZ=250): far under 200 ms.
    assert all(r < 50 for r in rtos), rtos


def test_a_zero_setting_keeps_the_kernels_timers(link):
    rtos = _rtos_after_moving(link, ("write",), config={"rto_min_us": 0, "delack_max_us": 0})
    assert rtos and all(r >= KERNEL_RTO_MIN_MS for r in rtos), rtos


def test_a_setting_under_the_kernels_tick_is_rounded_up_not_dropped(link):
    """1 ms is under one tick on most kernels, which refuse it: the next value they take is
    used instead of the 200 ms default."""
    _require_timer_options()
    rtos = _rtos_after_moving(link, ("write",), config={"rto_min_us": 1000, "delack_max_us": 1000})
    assert rtos and all(r < 50 for r in rtos), rtos


@pytest.fixture(scope="module")
def old_kernel_shim(tmp_path_factory) -> str:
    return build_helper_library(tmp_path_factory, "old_kernel_tcp_timers.c", "-ldl")


def test_a_kernel_without_the_timer_options_is_not_an_error(link, old_kernel_shim):
    """Before Linux 6.15 the options are refused: the engines start, move verified data and keep
    the kernel's timers (README: what such kernels need instead)."""
    rtos = _rtos_after_moving(link, ("write", "read"), env={"LD_PRELOAD": old_kernel_shim})
    assert rtos and all(r >= KERNEL_RTO_MIN_MS for r in rtos), rtos


@pytest.mark.parametrize("loss", [0.001, 0.01], ids=["0.1%", "1%"])
def test_a_lossy_link_still_moves_verified_data_within_the_deadline(link, loss):
    """Writes and reads of 16 MiB over a 10 Gbit link that drops packets in both directions, each
    call within a 10 s deadline; the namespaces' counters show that packets were really lost."""
    link.shape(shaped.LinkSpec(rate="10gbit", loss=loss))
    initiator, target = _pair(link, 16 * MIB, config={"transfer_timeout": 10.0})
    try:
        before = link.counters()
        for _ in range(3):
            _move_verified("write", initiator, target, 16 * MIB)
            _move_verified("read", initiator, target, 16 * MIB)
        after = link.counters()
    finally:
        initiator.close()
        target.close()
    assert after["retrans_segs"] > before["retrans_segs"], "no packet was lost: the link is not lossy"


def test_gpu_memory_staged_over_a_lossy_link_arrives_whole(link, request):
    """GPU memory crosses TCP through pinned staging on the same data connections, so it has the
    same timers.  Both sides hold device memory: a real GPU's where there is one, else the fake
    CUDA driver's (lazy copies, as a slow GPU: a chunk reused before its copy was waited for
    shows up as wrong bytes)."""
    from flagcx_mc.buffers import cuda_device_count

    link.shape(shaped.LinkSpec(rate="10gbit", loss=0.01))
    env: dict[str, str] = {}
    if cuda_device_count()[0] == 0:
        env = {"FLAGCX_MC_LIBCUDA": request.getfixturevalue("fake_driver"),
               "FAKE_CUDA_UUIDS": "00112233445566778899aabbccddeef0", "FAKE_CUDA_LAZY": "1"}
    initiator, target = _pair(link, MIB, config={"transfer_timeout": 10.0}, env=env)
    try:
        size = 16 * MIB
        for node in (initiator, target):
            assert node.call("add_region", size=size, device=0)["index"] == 1
        before = link.counters()
        for op in ("write", "read"):
            _move_verified(op, initiator, target, size, region=1)
        assert link.counters()["retrans_segs"] > before["retrans_segs"]
    finally:
        initiator.close()
        target.close()


def test_link_specs_parse_and_bad_ones_are_refused():
    assert shaped.parse_link("clean") == shaped.LinkSpec()
    assert shaped.parse_link("10gbit,loss=0.1%") == shaped.LinkSpec("10gbit", 0.001)
    assert shaped.parse_link("loss=0.01").loss == 0.01
    assert shaped.parse_link("10gbit").kind == "shaped"
    assert shaped.parse_link("10gbit,loss=1%").kind == "lossy"
    for bad in ("fast", "loss=lots", "loss=80%", "10 gbit"):
        with pytest.raises(ValueError):
            shaped.parse_link(bad)


def test_counter_files_parse():
    text = ("TcpExt: TCPTimeouts TCPLossProbes\nTcpExt: 3 7\n"
            "Tcp: RtoAlgorithm RetransSegs\nTcp: 1 42\n")
    found = shaped._parse_counter_file(text)
    assert found[("TcpExt", "TCPTimeouts")] == 3 and found[("Tcp", "RetransSegs")] == 42



# --- flagcx-mc bench --link ------------------------------------------------------------------


ROOT = Path(__file__).resolve().parents[1]


def _bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    # Run outside the source tree, so the installed package (with its compiled core) is imported.
    return subprocess.run([sys.executable, "-m", "flagcx_mc.tools.cli", "bench", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT / "examples")


def test_bench_over_a_lossy_link_verifies_rows_beside_plain_streams_with_counters(tmp_path):
    import json

    why = shaped.unavailable()
    if why:
        pytest.skip(why)
    out = tmp_path / "link.json"
    proc = _bench("--link", "10gbit,loss=1%", "--transports", "tcp,same-host", "--blocks", "64k", "--batch", "64",
                  "--trials", "1", "--no-mooncake", "--incast", "3", "--repeat", "2",
                  "--json", str(out), "--png", "", "--targets", str(ROOT / "docs" / "bench" / "targets.json"))
    data = json.loads(out.read_text())
    assert data["options"]["link"] == {"rate": "10gbit", "loss": 0.01, "kind": "lossy", "text": "10gbit + loss 1%",
                                       "plain_streams": 4}, proc.stderr
    rows = data["rows"]
    assert {(r["transport"], r["op"]) for r in rows} == {("tcp", "write"), ("tcp", "read")}
    for r in rows:
        assert r["verified"], r
        assert r["ratios"]["plain streams"] > 0
        assert set(r["link_per_call"]) == set(shaped.COUNTERS)
    assert sum(r["link_per_call"]["retrans_segs"] for r in rows) > 0  # the link did lose packets
    assert {b["name"] for b in data["baselines"]} == {"plain streams"}
    assert data["transports"]["same-host"] == {**data["transports"]["same-host"], "available": False,
                                               "reason": "over a shaped link only tcp, tcp-build, mooncake-tcp run"}
    # Incast: three initiators at once into one target, beside one of them alone, every range verified.
    (incast,) = data["incast"]
    assert incast["transport"] == "tcp" and incast["initiators"] == 3 and incast["verified"], incast
    assert incast["gbps"] > 0 and incast["single_gbps"] > 0 and incast["vs_single"] > 0
    assert "incast" in proc.stdout
    assert "TCP events per call" in proc.stdout and "over a shaped link (10gbit + loss 1%)" in proc.stdout
    # Only the lossy link's targets judge this run; Mooncake's is N/A (not run).
    names = {t["name"]: t["status"] for t in data["targets"]}
    assert set(names) == {"over a lossy link: native TCP >= 0.8x four plain TCP streams",
                          "over a lossy link: native TCP >= 1.2x Mooncake"}, names
    assert names["over a lossy link: native TCP >= 1.2x Mooncake"] == "N/A"


def test_bench_link_refuses_a_bad_spec_and_explains_a_missing_privilege(monkeypatch, capsys):
    from flagcx_mc.tools.bench import runner

    proc = _bench("--link", "fast")
    assert proc.returncode == 2 and "--link:" in proc.stderr and "not 'fast'" in proc.stderr
    monkeypatch.setattr(shaped, "unavailable", lambda: "a shaped link needs root (network namespaces, tc and nftables)")
    assert runner.run_bench(runner.link_options(shaped.LinkSpec("10gbit"), json_path=None, png_path=None)) == 2
    assert "flagcx-mc bench --link: a shaped link needs root" in capsys.readouterr().err
