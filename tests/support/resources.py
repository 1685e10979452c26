"""What this process holds, for tests that check a session or a call leaves nothing behind.

Zero-copy sends go through a pipe of the sending thread (two fds, tcp/fmc_splice.c) that lives
as long as the thread, whichever session it last served: such pipes are counted apart from the
other fds, and held to at most one per thread."""

from __future__ import annotations

import os


def threads_and_fds() -> tuple[int, int, int]:
    """(threads, fds other than pipes, pipe fds) of this process."""
    fds = pipes = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            pipe = os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:")
        except OSError:
            continue  # closed meanwhile (the listing's own fd among them)
        pipes += pipe
        fds += not pipe
    return len(os.listdir("/proc/self/task")), fds, pipes


def pipes_follow_threads(base: tuple[int, int, int], now: tuple[int, int, int]) -> bool:
    """No more pipes than at ``base`` plus one pair per thread now alive."""
    return now[2] <= base[2] + 2 * now[0]
