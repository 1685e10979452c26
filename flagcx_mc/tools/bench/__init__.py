"""``flagcx-mc bench``: engines against the physical limits and Mooncake, side by side in one run.

- ``runner``: shapes, passes and the processes that measure them;
- ``worker``: one engine process the runner drives;
- ``limits``: the physical limits (raw socket, memcpy, pvm, CUDA copies), measured by the
  ``_limits_cffi`` module;
- ``report``: ratios, tables, the JSON file and the plot;
- ``targets``: the user's targets (``--targets FILE``) checked against a result.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TRANSPORTS", "BenchOptions", "run_bench"]


def __getattr__(name: str) -> Any:
    # Imported on first use, not with the package: the bench's worker processes run as
    # ``python -m flagcx_mc.tools.bench.worker``, and runpy warns when the package has already
    # imported the module it is about to run.
    if name in __all__:
        from . import runner

        return getattr(runner, name)
    raise AttributeError(name)
