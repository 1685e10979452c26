"""Block layouts that test how an engine hands back-to-back blocks to the kernel.

Both the TCP path (zero-copy sends, scatter reads) and the same-host path (process_vm_writev)
join blocks that continue one another in memory into one range per side; these layouts mix runs,
gaps, backwards runs and a block named twice, so any join that crosses a gap or reorders bytes
shows up in the digests.
"""

from __future__ import annotations

import hashlib
import random


def runs_and_gaps(n: int, block: int, rng: random.Random) -> list[int]:
    """Offsets of n blocks laid out in runs of back-to-back blocks, the runs apart by gaps, and
    some runs stored backwards (block i+1 just before block i: touching, but not in order)."""
    offsets, pos, i = [0] * n, 0, 0
    while i < n:
        run = min(n - i, rng.randint(1, 40))
        slots = list(range(run))
        if rng.random() < 0.3:
            slots.reverse()
        for k, slot in enumerate(slots):
            offsets[i + k] = pos + slot * block
        pos += run * block + rng.choice([0, 0, block, 3 * block + 17])
        i += run
    return offsets


async def round_trip_runs_and_gaps(engine, node, local_buf, seed: int, block: int = 4096, n: int = 1536) -> None:
    """Write n blocks from one runs-and-gaps layout into another (shuffled, so the sides' runs do
    not line up; one source block written twice), then read them back; every byte must land at
    its own entry's place and the gaps must stay zero.  6 MiB by default: several vectors per
    stream, each over the zero-copy minimum."""
    rng = random.Random(seed)
    local_off = runs_and_gaps(n, block, rng)
    remote_off = runs_and_gaps(n, block, rng)
    rng.shuffle(remote_off)
    local_off[7] = local_off[6]
    local_span = max(local_off) + block
    remote_span = max(remote_off) + block

    local_buf.fill_random(0, local_span)
    node.call("set", region=0, byte=0, offset=0, length=remote_span)
    local = [local_buf.addr + o for o in local_off]
    remote = [node.addr(0, o) for o in remote_off]
    await engine.batch_transfer_sync_write(node.session, local, remote, [block] * n)
    expected = bytearray(remote_span)
    for lo, ro in zip(local_off, remote_off, strict=True):
        expected[ro:ro + block] = local_buf.read(lo, block)
    got = node.call("digest", region=0, offset=0, length=remote_span)["digest"]
    assert got == hashlib.sha256(expected).hexdigest()

    # Back: every entry but the duplicate's first (its twin lands on the same local block).
    keep = [i for i in range(n) if i != 6]
    local_buf.fill(0, 0, local_span)
    await engine.batch_transfer_sync_read(node.session, [local[i] for i in keep], [remote[i] for i in keep],
                                          [block] * len(keep))
    back = bytearray(local_span)
    for i in keep:
        back[local_off[i]:local_off[i] + block] = expected[remote_off[i]:remote_off[i] + block]
    assert local_buf.digest(0, local_span) == hashlib.sha256(back).hexdigest()
    assert node.call("guards")["intact"]
