"""``flagcx-mc`` command line: the loopback demo and version information."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import List, Optional


def _parse_shape(text: str) -> tuple:
    block, _, count = text.partition("x")
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    block = block.strip().lower()
    mult = units.get(block[-1:], 1)
    number = block[:-1] if block[-1:] in units else block
    return int(number) * mult, int(count or 1)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="flagcx-mc", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="two engines in two processes on 127.0.0.1: move, verify, time")
    demo.add_argument("--shape", action="append", type=_parse_shape, metavar="BLOCKxCOUNT",
                      help="block size and count, e.g. 4kx1024 or 64mx1 (repeatable)")
    demo.add_argument("--repeat", type=int, default=3, help="timed repetitions per shape")
    demo.add_argument("--streams", type=int, default=4, help="data streams per peer")
    demo.add_argument("-v", "--verbose", action="store_true")
    sub.add_parser("version", help="print the package and core versions")
    args = parser.parse_args(argv)

    if args.command == "version":
        import flagcx_mc
        from flagcx_mc._core import core_version

        print(f"flagcx_mc {flagcx_mc.__version__} (core {core_version()})")
        return 0
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from .demo import DEFAULT_SHAPES, run_demo

    return run_demo(args.shape or DEFAULT_SHAPES, repeat=args.repeat, streams=args.streams)


if __name__ == "__main__":
    sys.exit(main())
