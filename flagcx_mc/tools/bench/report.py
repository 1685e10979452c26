"""What ``flagcx-mc bench`` makes of its measurements: ratios against the physical limits and
Mooncake, the tables on stdout, the JSON file and the plot.  Nothing here measures; everything
works as well on a results file written earlier.

Ratios are shown side by side (``vs <baseline>`` columns); whether they are good enough is for
targets the user supplies (``targets``).
"""

from __future__ import annotations

import json
import statistics
import sys
from typing import IO

from ..._extras import install_hint
from ..._units import fmt_size
from .limits import BASELINES, also_against

__all__ = ["add_ratios", "draw_png", "print_report", "print_targets", "request_times", "steal_summary",
           "throughput_rows", "verdict", "write_json"]


def add_ratios(rows: list, baselines: list, limit_of: dict[str, str]) -> None:
    """Fill each row's ``ratios`` (throughput / baseline) and ``cpu_vs_mooncake``.

    ``limit_of`` maps a transport name to the physical limit it is held against.  A row is held
    against the limit measured beside it (same op pass), else against any measurement of that
    shape (results written before limits were measured per op).
    """
    base: dict[tuple, float] = {}
    trials: dict[tuple, list | None] = {}
    for b in baselines:
        base.setdefault((b["name"], b["block"], b["count"]), b["gbps"])
        base[(b["name"], b["block"], b["count"], b.get("op"))] = b["gbps"]
        trials[(b["name"], b["block"], b["count"], b.get("op"))] = b.get("trials_gbps")

    def limit_for(name: str, r: dict) -> float | None:
        return base.get((name, r["block"], r["count"], r["op"]), base.get((name, r["block"], r["count"])))

    def median_ratio(mine: list | None, theirs: list | None) -> float | None:
        """The same ratio between median trials: shows whether one fast or slow trial decided it."""
        if not mine or not theirs or not statistics.median(theirs):
            return None
        return statistics.median(mine) / statistics.median(theirs)

    def workload(r: dict) -> tuple:
        """What Mooncake's row must share with ours to be compared: GPU or host memory on each
        side, the layout and the callers as well as the shape (older results: host memory)."""
        memory = r.get("memory", "host")
        gpu = (memory == "cuda", (r.get("target_memory") or memory) == "cuda")
        return (r["op"], r["block"], r["count"], gpu, r.get("layout", "contiguous"), r.get("callers", 1))

    mooncake = {workload(r): r for r in rows if r["engine"] == "mooncake" and r["verified"]}
    for r in rows:
        if not r["verified"]:
            continue
        own = limit_of[r["transport"]]
        medians = r.setdefault("median_ratios", {})
        for name in (own, *also_against(own)):
            limit = limit_for(name, r)
            if limit:
                r["ratios"][name] = r["gbps"] / limit
                medians[name] = median_ratio(r.get("trials_gbps"), trials.get((name, r["block"], r["count"], r["op"])))
        mc = mooncake.get(workload(r))
        if mc is not None and r["engine"] != "mooncake":
            r["ratios"]["mooncake"] = r["gbps"] / mc["gbps"] if mc["gbps"] else None
            medians["mooncake"] = median_ratio(r.get("trials_gbps"), mc.get("trials_gbps"))
            if r["cpu_s_per_gib"] is not None and mc["cpu_s_per_gib"]:
                r["cpu_vs_mooncake"] = r["cpu_s_per_gib"] / mc["cpu_s_per_gib"]


def throughput_rows(rows: list, transport: str, count: int | None = None) -> list:
    """Verified rows of one transport at the largest batch of each block size (the throughput
    workload), or at ``count`` blocks per call."""
    mine = [r for r in rows if r["transport"] == transport and r["verified"]]
    if count is not None:
        return [r for r in mine if r["count"] == count]
    largest: dict[int, int] = {}
    for r in mine:
        largest[r["block"]] = max(largest.get(r["block"], 0), r["count"])
    return [r for r in mine if r["count"] == largest[r["block"]]]


def _fmt_ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def steal_summary(result: dict) -> str | None:
    """One line on hypervisor steal over the run and during the worst shape, if it was measured."""
    share = result.get("host", {}).get("steal_share")
    if share is None:
        return None
    line = f"hypervisor steal: {share:.0%} of CPU time over the run"
    worst = max((r for r in result["rows"] if r.get("steal") is not None), key=lambda r: r["steal"], default=None)
    if worst is not None and worst["steal"] > 0:
        line += f" (most: {worst['steal']:.0%} during {worst['op']} {fmt_size(worst['block'])} x{worst['count']})"
    again = {(r["op"], r["block"], r["count"]) for r in result["rows"] if len(r.get("steal_attempts") or ()) > 1}
    if again:
        line += f"; {len(again)} shape(s) measured again after steal, the calmest pass kept"
    return line


def print_report(result: dict, out: IO[str] | None = None) -> None:
    out = out or sys.stdout  # looked up per call: a redirected sys.stdout (tests, callers) gets the report
    rows, baselines = result["rows"], result["baselines"]
    columns = [b for b in BASELINES if any(b in r["ratios"] for r in rows)]
    head = f"{'transport':<14} {'op':<5} {'block':>7} {'count':>5} {'GB/s':>7} {'CPU s/GiB':>9}"
    head += "".join(f" {'vs ' + c:>14}" for c in columns) + "  verified"
    print(head, file=out)
    for r in rows:
        line = (f"{r['transport']:<14} {r['op']:<5} {fmt_size(r['block']):>7} {r['count']:>5} {r['gbps']:>7.2f} "
                f"{r['cpu_s_per_gib'] if r['cpu_s_per_gib'] is not None else float('nan'):>9.3f}")
        line += "".join(f" {_fmt_ratio(r['ratios'].get(c)):>14}" for c in columns)
        print(line + ("  yes" if r["verified"] else f"  NO ({r['error']})"), file=out)
    _print_requests(rows, out)
    _print_link_counters(result, out)
    _print_incast(result, out)
    if baselines:
        print(f"\n{'physical limit':<14} {'beside':<6} {'block':>7} {'count':>5} {'GB/s':>7}", file=out)
        for b in baselines:
            print(f"{b['name']:<14} {b.get('op', ''):<6} {fmt_size(b['block']):>7} {b['count']:>5} {b['gbps']:>7.2f}",
                  file=out)
    if result["latency"]:
        print(f"\n{'4 KiB sync call':<16} {'op':<6} {'n':>5} {'p50 us':>8} {'p99 us':>8} {'mean us':>8}  verified",
              file=out)
        for x in result["latency"]:
            print(f"{x['transport']:<16} {x.get('op', 'write'):<6} {x['n'] or 0:>5} {x['p50_us'] or 0:>8.1f} "
                  f"{x['p99_us'] or 0:>8.1f} {x['mean_us'] or 0:>8.1f}  {'yes' if x['verified'] else 'NO'}", file=out)
    print(file=out)
    for name, info in result["transports"].items():
        if not info["available"]:
            print(f"{name}: {info['reason']}", file=out)
    for name, reason in result["baselines_missing"].items():
        print(f"baseline {name}: not available ({reason})", file=out)
    host, options = result.get("host", {}), result.get("options", {})
    link = options.get("link")
    if link:
        print(f"over a shaped link ({link['text']}) between two network namespaces; plain streams: "
              f"{link['plain_streams']} TCP connections with the kernel's defaults", file=out)
    elif options.get("streams"):
        print(f"TCP: {options['streams']} streams per peer (the raw socket too); congestion control within "
              f"this host {host.get('local_congestion_control')}, host default {host.get('tcp_congestion_control')} "
              f"(Mooncake's)", file=out)
    steal_line = steal_summary(result)
    if steal_line:
        print(steal_line, file=out)
    print_targets(result.get("targets", []), out)
    bad = [r for r in rows if not r["verified"]] + [x for x in result["latency"] if not x["verified"]]
    bad += [x for x in result.get("incast", []) if not x["verified"]]
    print("all transfers verified by sha256" if not bad and not result["errors"]
          else f"{len(bad)} measurement(s) NOT verified, {len(result['errors'])} error(s)", file=out)


def request_times(rows: list) -> list[dict]:
    """Paged rows as requests: milliseconds per call (one call is one request of a vLLM-shaped
    KV transfer), beside the time the raw socket and the staged socket take for the same bytes
    at the rates measured beside them."""
    def ms_at(size: int, gbps: float) -> float | None:
        return size / (gbps * 1e9) * 1e3 if gbps else None

    out = []
    for r in rows:
        if r.get("layout") != "paged" or not r["verified"] or not r["gbps"]:
            continue
        size = r["block"] * r["count"]
        limits = {name: ms_at(size, r["gbps"] / ratio) if ratio else None
                  for name in ("raw socket", "staged socket") if (ratio := r["ratios"].get(name)) is not None}
        out.append({"transport": r["transport"], "op": r["op"], "block": r["block"], "count": r["count"],
                    "bytes": size, "ms": ms_at(size, r["gbps"]), "raw_socket_ms": limits.get("raw socket"),
                    "staged_socket_ms": limits.get("staged socket")})
    return out


def _print_requests(rows: list, out: IO[str]) -> None:
    requests = request_times(rows)
    if not requests:
        return

    def ms(value: float | None) -> str:
        return "" if value is None else f"{value:.2f}"

    print(f"\n{'request':<20} {'op':<5} {'blocks':>13} {'MiB':>6} {'ms':>8} {'raw socket ms':>14} "
          f"{'staged socket ms':>17}", file=out)
    for q in requests:
        shape = f"{q['count']} x {fmt_size(q['block'])}"
        print(f"{q['transport']:<20} {q['op']:<5} {shape:>13} {q['bytes'] / (1 << 20):>6.0f} {ms(q['ms']):>8} "
              f"{ms(q['raw_socket_ms']):>14} {ms(q['staged_socket_ms']):>17}", file=out)
    print("(a paged call as one request: its time, and the time the raw and the staged socket take for its bytes)",
          file=out)


def _print_link_counters(result: dict, out: IO[str]) -> None:
    """Over a link: the TCP events behind each row's figure, per call of its fastest trial."""
    rows = [r for r in result["rows"] if r.get("link_per_call")]
    if not rows:
        return
    print("\nTCP events per call (both namespaces; the fastest trial, its warm-up call included)", file=out)
    print(f"{'transport':<14} {'op':<5} {'block':>7} {'count':>5} {'RTOs':>6} {'loss probes':>11} "
          f"{'retransmits':>11} {'fast retr.':>10} {'DSACKs':>7}", file=out)
    for r in rows:
        c = r["link_per_call"]
        print(f"{r['transport']:<14} {r['op']:<5} {fmt_size(r['block']):>7} {r['count']:>5} {c.get('rto', 0):>6.2f} "
              f"{c.get('loss_probes', 0):>11.1f} {c.get('retrans_segs', 0):>11.0f} {c.get('fast_retrans', 0):>10.0f} "
              f"{c.get('dsack_recv', 0):>7.0f}", file=out)


def _print_incast(result: dict, out: IO[str]) -> None:
    """Over a link: N initiators writing to one target at once, beside one of them alone."""
    rows = result.get("incast") or []
    if not rows:
        return
    print(f"\n{'incast':<14} {'initiators':>10} {'block':>7} {'count':>5} {'GB/s':>7} {'one alone':>9} "
          f"{'vs one':>7} {'RTOs/call':>9} {'retr./call':>10}  verified", file=out)
    for r in rows:
        c = r.get("link_per_call") or {}
        ratio = "" if r.get("vs_single") is None else f"{r['vs_single']:.2f}x"
        print(f"{r['transport']:<14} {r['initiators']:>10} {fmt_size(r['block']):>7} {r['count']:>5} {r['gbps']:>7.2f} "
              f"{r['single_gbps']:>9.2f} {ratio:>7} {c.get('rto', 0):>9.2f} {c.get('retrans_segs', 0):>10.0f}  "
              f"{'yes' if r['verified'] else 'NO (' + str(r['error']) + ')'}", file=out)


def print_targets(targets: list[dict], out: IO[str] | None = None) -> None:
    """One line per evaluated target: its status, measured value, threshold and detail."""
    out = out or sys.stdout
    if targets:
        print(file=out)
    for t in targets:
        measured = "" if t["measured"] is None else f"{t['measured']:.2f} (threshold {t['threshold']})"
        print(f"{t['status']:<4} {t['name']}: {measured}{'  ' if measured else ''}{t['detail']}", file=out)


def draw_png(result: dict, path: str) -> str | None:
    """Throughput vs block size (largest batch per block); returns why it was skipped, or None."""
    try:
        import matplotlib  # type: ignore[import-not-found, unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return f"matplotlib is not installed (the plot {install_hint('bench', 'matplotlib')})"
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for transport in dict.fromkeys(r["transport"] for r in result["rows"]):
        picked = throughput_rows(result["rows"], transport)
        for op in dict.fromkeys(r["op"] for r in picked):
            pts = sorted((r["block"], r["gbps"]) for r in picked if r["op"] == op)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{transport} {op}")
    largest: dict[int, int] = {}
    for b in result["baselines"]:
        largest[b["block"]] = max(largest.get(b["block"], 0), b["count"])
    for name in dict.fromkeys(b["name"] for b in result["baselines"]):
        per_block: dict[int, list[float]] = {}  # one value per op pass: their mean
        for b in result["baselines"]:
            if b["name"] == name and b["count"] == largest[b["block"]]:
                per_block.setdefault(b["block"], []).append(b["gbps"])
        pts = sorted((block, sum(v) / len(v)) for block, v in per_block.items())
        ax.plot([p[0] for p in pts], [p[1] for p in pts], linestyle="--", label=f"limit: {name}")
    ax.set_xscale("log", base=2)
    blocks = sorted({r["block"] for r in result["rows"]} | set(largest))
    ax.set_xticks(blocks, [fmt_size(b).replace(" ", "") for b in blocks])
    ax.set_xlabel("block size (largest batch per block)")
    ax.set_ylabel("GB/s")
    ax.set_title(f"flagcx_mc bench: {result['host']['cpus']} CPUs, {result['host']['platform']}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write_json(result: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def verdict(result: dict) -> int:
    """The exit code a result earns: 0 if every transfer was verified, nothing failed and no
    target was missed (N/A is no miss), else 1."""
    missed = any(t["status"] == "MISS" for t in result.get("targets", []))
    return 0 if result["verified"] and not result["errors"] and not missed else 1
