"""``flagcx-mc bench``: engines against the physical limits and Mooncake, side by side in one run.

- ``runner``: shapes, passes and the processes that measure them;
- ``worker``: one engine process the runner drives;
- ``limits``: the physical limits (raw socket, memcpy, pvm, CUDA copies), measured by the
  ``_limits_cffi`` module;
- ``report``: ratios, tables, the JSON file and the plot;
- ``targets``: the user's targets (``--targets FILE``) checked against a result.
"""

from __future__ import annotations

from .runner import TRANSPORTS, BenchOptions, run_bench

__all__ = ["TRANSPORTS", "BenchOptions", "run_bench"]
