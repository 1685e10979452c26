"""Where a benchmark batch's blocks sit on each side: ``contiguous`` (block i at ``i * block`` on
both sides) or ``paged`` (a paged KV cache as vLLM registers it: separate K and V tensors per
layer, each cut into blocks; one call moves the same number of blocks from every tensor, at
block ids drawn at random, different on each side, from twice as many as the call moves, in
random order).  Both processes of a measurement derive the same plan from the same arguments,
so only numbers cross between them.
"""

from __future__ import annotations

import random

__all__ = ["LAYOUTS", "PAGED_LAYERS", "block_plan", "cache_bytes"]

LAYOUTS = ("contiguous", "paged")
PAGED_LAYERS = 32       # layers of the paged cache (2 tensors each: K and V)
_PAGED_POOL = 2         # a tensor holds this many times the blocks a call takes from it


def cache_bytes(layout: str, block: int, count: int, layers: int = PAGED_LAYERS) -> int:
    """Bytes a region needs on each side for one batch of ``count`` blocks."""
    if layout == "contiguous":
        return block * count
    return block * _blocks_per_tensor(count, layers) * _PAGED_POOL * 2 * layers


def _blocks_per_tensor(count: int, layers: int) -> int:
    if count % (2 * layers):
        raise ValueError(f"a paged batch moves the same blocks from each of {2 * layers} tensors: "
                         f"{count} blocks is not a multiple")
    return count // (2 * layers)


def block_plan(layout: str, block: int, count: int, layers: int = PAGED_LAYERS, seed: int = 0
               ) -> tuple[list[int], list[int]]:
    """(local offsets, remote offsets) of the ``count`` blocks, from the start of each side's region."""
    if layout == "contiguous":
        offsets = [i * block for i in range(count)]
        return offsets, list(offsets)
    if layout != "paged":
        raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")
    per = _blocks_per_tensor(count, layers)
    pool = per * _PAGED_POOL
    tensor = pool * block
    rng = random.Random(f"{seed}:{block}:{count}:{layers}")
    local: list[int] = []
    remote: list[int] = []
    for t in range(2 * layers):  # K and V of each layer
        for side in (local, remote):
            side.extend(t * tensor + i * block for i in rng.sample(range(pool), per))
    return local, remote
