"""``flagcx-mc`` command line: the loopback demo, the benchmark and version information."""

from __future__ import annotations

import argparse
import logging
import sys


def _parse_shape(text: str) -> tuple:
    """'4kx1024' -> (4096, 1024); a block without a count is one block."""
    from .._units import parse_size

    block, _, count = text.partition("x")
    try:
        return parse_size(block), int(count or 1)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _csv(convert):
    def parse(text: str) -> list:
        try:
            return [convert(item) for item in text.split(",") if item.strip()]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def _add_bench_parser(sub) -> None:
    from .._units import parse_size
    from .bench.runner import TRANSPORTS

    bench = sub.add_parser("bench",
                           help="sweep block and batch sizes per transport against Mooncake and physical limits")
    bench.add_argument("--quick", action="store_true",
                       help="small sweep (under a minute): 3 block sizes, one batch size")
    bench.add_argument("--blocks", type=_csv(parse_size), metavar="SIZES",
                       help="block sizes, e.g. 4k,64k,1m,64m (default 4 KiB to 64 MiB, x4 steps)")
    bench.add_argument("--batch", type=_csv(int), metavar="COUNTS",
                       help="blocks per batch, e.g. 1,32,1024 (capped at 64 MiB per batch)")
    bench.add_argument("--paged-blocks", type=_csv(parse_size), metavar="SIZES",
                       help="block sizes of the paged-KV transports (default 16k,32k,64k; 1024 blocks a call "
                            "from 32 layers' K and V tensors at random block ids)")
    bench.add_argument("--paged-count", type=int, metavar="N",
                       help="blocks per call of the paged-KV transports, a multiple of 64 (default 1024; 8192 is a "
                            "vLLM request of 128 blocks from each of 32 layers' K and V); their calls are also "
                            "shown as requests, in ms beside the raw and the staged socket")
    bench.add_argument("--streams", type=int,
                       help="data streams per peer, the raw socket baseline's too (default: the engine's, "
                            "half the CPUs from 4 to 8)")
    bench.add_argument("--ops", type=_csv(str), default=["write", "read"], metavar="OPS", help="write,read")
    bench.add_argument("--transports", type=_csv(str), metavar="NAMES",
                       help="comma list of " + ", ".join(t.name for t in TRANSPORTS) + " (default all)")
    bench.add_argument("--repeat", type=int, help="timed batches per trial (default: enough for 256 MiB, at most 1000)")
    bench.add_argument("--trials", type=int, help="timed trials per measurement, the fastest reported (default 5)")
    bench.add_argument("--latency-n", type=int,
                       help="4 KiB sync writes, and as many reads, in the latency test (default 2000)")
    bench.add_argument("--steal-retries", type=int, metavar="N",
                       help="measure a shape again, up to N times, when hypervisor steal took 10%% or more of "
                            "the CPU time during it; the calmest pass is kept (default 2, 0: never)")
    bench.add_argument("--json", metavar="PATH", default="bench-results/bench.json", help="results file ('' for none)")
    bench.add_argument("--png", metavar="PATH", default="bench-results/bench.png",
                       help="plot of GB/s vs block size, if matplotlib is installed ('' for none)")
    bench.add_argument("--no-mooncake", action="store_true", help="skip Mooncake's engine")
    bench.add_argument("--targets", metavar="FILE",
                       help="check the result against the targets in FILE (JSON or TOML: a list of {name, metric, "
                            "threshold, better}, see flagcx_mc.tools.bench.targets); a missed target makes the exit "
                            "code 1")
    bench.add_argument("--check", metavar="RESULTS",
                       help="measure nothing: print the report of a results file written earlier, checked against "
                            "--targets")
    bench.add_argument("--async", dest="async_calls", action="store_true",
                       help="only the async facade: calls/s beside the sync facade and asyncio.to_thread, 1/16/64 "
                            "coroutines, on asyncio's loop and uvloop (about a minute), with its targets")
    bench.add_argument("--peers", metavar="COUNTS",
                       help="only what many peers cost one process: for each count (e.g. 1,8,64,256), one engine "
                            "writing 1 MiB to that many peers (out) and that many writing 1 MiB into it (in), the "
                            "peers' engines hosted 32 to a process; aggregate GB/s and the measured process's "
                            "threads, fds and RSS, Mooncake's beside")
    bench.add_argument("--link", metavar="SPEC",
                       help="run the TCP rows (tcp, mooncake-tcp) across two network namespaces over a shaped link, "
                            "held against plain TCP streams on the same link, with TCP counters per call: 'clean', "
                            "a rate such as 10gbit, loss=N%%, or both (10gbit,loss=0.1%%); needs root, tc, nft and "
                            "ethtool. Defaults then: 64 KiB and 1 MiB blocks in 64 MiB calls, 3 trials")
    bench.add_argument("--compare-build", metavar="PATH",
                       help="also run the tcp rows with the engines of another flagcx_mc source tree built in place "
                            "(python setup.py build_ext --inplace there), as transport tcp-build: a change measured "
                            "against what it changed, in the same run; name gpu-tcp-build, gpu-tcp-paged-build "
                            "(any of tcp, gpu-tcp, gpu-tcp-paged, gpu-tcp-paged-10, gpu-host-tcp-paged with -build) "
                            "in --transports for those rows")
    bench.add_argument("--incast", type=int, metavar="N",
                       help="over a link: also N initiators (engines in processes of their own) writing to one "
                            "target at once, beside one of them alone, flagcx_mc's and Mooncake's")
    bench.add_argument("--plain-streams", type=int, metavar="N",
                       help="connections of the plain streams limit over a link (default 4)")
    bench.add_argument("-v", "--verbose", action="store_true", help="engine logs (Mooncake's too)")


def _run_bench(args: argparse.Namespace) -> int:
    from .bench.link import parse_link
    from .bench.runner import COMPARED_BUILD, TRANSPORTS, BenchOptions, link_options, run_bench
    from .bench.targets import TargetsError, load_targets

    targets = None
    if args.targets:
        try:
            targets = load_targets(args.targets, tuple(t.name for t in TRANSPORTS))
        except TargetsError as exc:
            print(exc, file=sys.stderr)
            return 2
    if args.check:
        return _check_results(args.check, targets)
    if args.async_calls:
        return _run_async_bench(args.json, targets)
    if args.peers:
        try:
            counts = [int(c) for c in args.peers.split(",")]
        except ValueError:
            counts = []
        if not counts or any(not 1 <= c <= 1024 for c in counts):
            print("--peers takes counts of 1 to 1024, such as 1,8,64,256", file=sys.stderr)
            return 2
        return _run_peers_bench(counts, args.json, not args.no_mooncake, args.trials or 3, args.verbose, targets)

    given = {"blocks": args.blocks, "batches": args.batch, "transports": args.transports, "repeat": args.repeat,
             "trials": args.trials, "latency_n": args.latency_n, "streams": args.streams,
             "steal_retries": args.steal_retries, "paged_blocks": args.paged_blocks, "paged_count": args.paged_count}
    overrides = {k: v for k, v in given.items() if v is not None}
    if args.paged_count is not None and (args.paged_count < 64 or args.paged_count % 64):
        print(f"--paged-count takes a multiple of 64 (32 layers' K and V), not {args.paged_count}", file=sys.stderr)
        return 2
    bad_ops = set(args.ops) - {"write", "read"}
    if bad_ops or not args.ops:
        print(f"--ops takes write and/or read, not {','.join(sorted(bad_ops)) or 'nothing'}", file=sys.stderr)
        return 2
    overrides.update(ops=args.ops, mooncake=not args.no_mooncake, targets=targets, targets_path=args.targets,
                     json_path=args.json or None, png_path=args.png or None, verbose=args.verbose,
                     compare_build=args.compare_build)
    if args.link is not None:
        try:
            spec = parse_link(args.link)
        except ValueError as exc:
            print(f"--link: {exc}", file=sys.stderr)
            return 2
        if args.incast is not None:
            if not 2 <= args.incast <= 64:
                print("--incast takes 2 to 64 initiators", file=sys.stderr)
                return 2
            overrides["incast"] = args.incast
        if args.plain_streams is not None:
            if not 1 <= args.plain_streams <= 64:
                print("--plain-streams takes 1 to 64", file=sys.stderr)
                return 2
            overrides["plain_streams"] = args.plain_streams
        opts = link_options(spec, **overrides)
    else:
        opts = BenchOptions.quick_options(**overrides) if args.quick else BenchOptions(**overrides)
    if args.compare_build and args.transports is None:
        opts.transports.append(COMPARED_BUILD)
    return run_bench(opts)


def _run_async_bench(json_path: str, targets) -> int:
    import json
    from pathlib import Path

    from .bench.async_calls import run_async_bench
    from .bench.report import verdict
    from .bench.targets import evaluate_targets

    rows = run_async_bench(loop="asyncio") + run_async_bench(loop="uvloop")
    result: dict = {"async_calls": rows, "targets": [], "verified": True, "errors": []}
    result["targets"] = _calls_ratio_only(evaluate_targets(targets, result)) if targets else []
    _print_async_result(result)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=1))
    return verdict(result)


def _run_peers_bench(counts: list[int], json_path: str, mooncake: bool, trials: int, verbose: bool,
                     targets) -> int:
    import contextlib
    import importlib.util
    import json
    import tempfile
    from collections.abc import Callable
    from functools import partial
    from pathlib import Path

    from ..config import usable_cpus
    from .bench.peers import measure_first_contact, measure_peers, print_first_contact_report, print_peers_report
    from .bench.report import print_targets, verdict
    from .bench.runner import stderr_to
    from .bench.targets import evaluate_targets

    engines = ["flagcx_mc"] + (["mooncake"] if mooncake and importlib.util.find_spec("mooncake") else [])

    def measured(what: str, value: Callable[[dict], str], measure: Callable[[], dict]) -> dict:
        """One row, the engines' stderr kept out of the report unless verbose, and a line of progress."""
        with contextlib.ExitStack() as stack:
            log = None if verbose else stack.enter_context(tempfile.TemporaryFile("w+"))
            with stderr_to(log):
                row = measure()
        print(f"{what}: {value(row)}" + (f", error: {row['error']}" if row["error"] else ""), flush=True)
        return row

    rows = []
    for n in counts:
        for direction in ("out", "in"):
            for engine in engines:
                rows.append(measured(f"{engine:<10} {direction:>3} {n:>4} peers", lambda r: f"{r['gbps']:.2f} GB/s",
                                     partial(measure_peers, engine, direction, n, 1 << 20, trials=trials)))
    first = []
    if max(counts) >= 2:  # the most initiators reaching one target at once
        for engine in engines:
            first.append(measured(f"{engine:<10} first contact of {max(counts)}", lambda r: f"{r['seconds']:.3f} s",
                                  partial(measure_first_contact, engine, max(counts))))
    result: dict = {"peers": rows, "first_contact": first, "cpus": usable_cpus(), "targets": [], "errors": [],
                    "verified": all(r["verified"] for r in rows + first)}
    result["targets"] = _peers_only(evaluate_targets(targets, result)) if targets else []
    print_peers_report(rows, result["cpus"])
    print_first_contact_report(first)
    print_targets(result["targets"])
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=1))
    return verdict(result)


def _peers_only(targets: list[dict]) -> list[dict]:
    """The evaluated targets a --peers result can meet."""
    return [t for t in targets if t["metric"].startswith("peers:")]


def _check_results(path: str, targets) -> int:
    """The report of a results file written earlier, its targets evaluated afresh (``targets``:
    a loaded targets file, or None for none)."""
    import json

    from .bench.report import print_report, verdict
    from .bench.targets import evaluate_targets

    try:
        with open(path) as f:
            result = json.load(f)
        result["targets"] = evaluate_targets(targets, result) if targets else []
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"cannot read bench results from {path}: {exc}", file=sys.stderr)
        return 2
    if "rows" in result:
        print_report(result)
    elif "peers" in result:  # written by --peers
        from .bench.peers import print_first_contact_report, print_peers_report
        from .bench.report import print_targets

        result["targets"] = _peers_only(result["targets"])
        print_peers_report(result["peers"], result.get("cpus") or 1)
        print_first_contact_report(result.get("first_contact", []))
        print_targets(result["targets"])
    else:  # written by --async: only the async facade's calls/s
        result["targets"] = _calls_ratio_only(result["targets"])
        _print_async_result(result)
    return verdict(result)


def _calls_ratio_only(targets: list[dict]) -> list[dict]:
    """The evaluated targets an --async result can meet: the others need the throughput sweep,
    which --async does not run."""
    return [t for t in targets if t["metric"].startswith("calls_ratio:")]


def _print_async_result(result: dict) -> None:
    """The async facade's table and its targets."""
    from .bench.async_calls import print_async_report
    from .bench.report import print_targets

    print_async_report(result["async_calls"])
    print_targets(result["targets"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flagcx-mc", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="two engines in two processes on 127.0.0.1: move, verify, time")
    demo.add_argument("--shape", action="append", type=_parse_shape, metavar="BLOCKxCOUNT",
                      help="block size and count, e.g. 4kx1024 or 64mx1 (repeatable)")
    demo.add_argument("--repeat", type=int, default=3, help="timed repetitions per shape")
    demo.add_argument("--streams", type=int, help="data streams per peer (default: the engine's)")
    demo.add_argument("-v", "--verbose", action="store_true")
    sub.add_parser("version", help="print the package and core versions")
    sub.add_parser("metadata-server", add_help=False,
                   help="a Mooncake-compatible HTTP metadata server (see `flagcx-mc metadata-server --help`)")
    _add_bench_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["metadata-server"]:
        from ..metadata.server import main as metadata_server_main

        return metadata_server_main(argv[1:])
    args = parser.parse_args(argv)

    if args.command == "version":
        import flagcx_mc

        from .._core import core_version

        print(f"flagcx_mc {flagcx_mc.__version__} (core {core_version()})")
        return 0
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command == "bench":
        return _run_bench(args)
    from .demo import DEFAULT_SHAPES, run_demo

    return run_demo(args.shape or DEFAULT_SHAPES, repeat=args.repeat, streams=args.streams)


if __name__ == "__main__":
    sys.exit(main())
