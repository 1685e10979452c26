"""tests/asan/run_asan.sh preloads AddressSanitizer into the tests and, through the environment, into
everything they start.  Tools the tests run (the C compiler, ip, nft) must go without it: its leak
report at their exit would turn their status into a failure."""

from __future__ import annotations

import os


def environ_without_sanitizer() -> dict[str, str]:
    """This process's environment less the preloaded sanitizer and its options."""
    return {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "ASAN_OPTIONS")}
