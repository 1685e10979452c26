"""``flagcx-mc bench``: engines against the physical limits and Mooncake, side by side in one run.

- ``runner``: shapes, passes, the JSON report and the plot;
- ``worker``: one engine process the runner drives;
- ``limits``: the physical limits (raw socket, memcpy, pvm, CUDA copies) and ratios against them.
"""

from __future__ import annotations

from .runner import TRANSPORTS, BenchOptions, run_bench

__all__ = ["TRANSPORTS", "BenchOptions", "run_bench"]
