"""Paged-KV layout: turn (request -> block ids) on both sides into the fewest (src, dst, length) triplets.

A paged KV cache, seen from the transfer engine, is a list of *planes*.  A plane is
``num_blocks`` equal blocks of ``block_len`` bytes, block ``i`` at ``base + i * stride``: the K
cache of one layer, the V cache of one layer, or one layer's fused K/V blocks.  Planes that share
block ids form a *group* (vLLM's KV-cache groups: full-attention layers, sliding-window layers...),
and a ``KVLayout`` is the tuple of groups of one worker.

``plan`` pairs the planes of a prefill worker with those of a decode worker, walks the two
block-id lists of one request, and returns the triplets to hand to
``batch_transfer_sync_write``: runs of blocks contiguous on *both* sides become one triplet, K and
V of a fused tensor merge when both sides allow it, and a triplet never crosses the buffer
(``Plane.span``) it was registered in.  When prefill and decode use different tensor-parallel
sizes, ``HeadSplit`` says which heads each rank holds and ``plan`` moves only the heads the prefill
rank owes the decode rank.

Nothing here imports torch or numpy: tensors are read by duck typing (``data_ptr()``,
``__array_interface__``), by address and size.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..errors import InvalidArgumentError

__all__ = [
    "LayoutError",
    "BufferInfo",
    "buffer_info",
    "Plane",
    "KVLayout",
    "planes_of",
    "TPRank",
    "HeadSplit",
    "Triplets",
    "group_contiguous",
    "plan_group",
    "plan",
    "KV_BLOCKS",
    "KV_FIRST",
    "KV_INNER",
]

_U64 = 1 << 64

# How a tensor holds its blocks (``planes_of``):
KV_BLOCKS = "blocks"  # [num_blocks, ...]: one plane (a K or V cache alone, or an MLA latent cache)
KV_FIRST = "kv_first"  # [2, num_blocks, ...]: K plane then V plane (vLLM FlashAttention)
KV_INNER = "kv_inner"  # [num_blocks, 2, ...]: each block holds its K half then its V half (FlashInfer)
_KINDS = (KV_BLOCKS, KV_FIRST, KV_INNER)


class LayoutError(InvalidArgumentError):
    """KV layouts, head splits or block ids that do not fit together."""


def _uint(value: Any, what: str, *, positive: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise LayoutError(f"{what} must be an int, not {type(value).__name__}")
    if value < (1 if positive else 0) or value >= _U64:
        raise LayoutError(f"{what} = {value} is out of range")
    return value


# ---------------------------------------------------------------------------------- buffers


class BufferInfo(NamedTuple):
    """Where a tensor's bytes are: start address, size, and device (``"cpu"``, ``"cuda:0"``...)."""

    addr: int
    nbytes: int
    device: str


def buffer_info(obj: Any) -> BufferInfo:
    """Address, size and device of a contiguous tensor-like object, without importing its library.

    Accepts torch tensors and look-alikes (``data_ptr()``, ``nbytes`` or ``numel()`` and
    ``element_size()``, ``is_cuda``/``device``), numpy arrays (``__array_interface__``), objects
    with ``addr`` and ``size`` (``HostBuffer``) and ``(addr, nbytes)`` pairs.

    Raises:
        LayoutError: not contiguous, empty, or of an unknown kind.
    """
    if isinstance(obj, tuple) and len(obj) == 2:
        addr, nbytes = obj
        return BufferInfo(_uint(addr, "address"), _uint(nbytes, "size", positive=True), "cpu")
    if callable(getattr(obj, "data_ptr", None)):
        is_contiguous = getattr(obj, "is_contiguous", None)
        if callable(is_contiguous) and not is_contiguous():
            raise LayoutError("tensor is not contiguous: its blocks cannot be addressed by offset")
        nbytes = getattr(obj, "nbytes", None)
        if not isinstance(nbytes, int):
            nbytes = int(obj.numel()) * int(obj.element_size())
        device = getattr(obj, "device", None)
        if device is None:
            device = "cuda" if getattr(obj, "is_cuda", False) else "cpu"
        return BufferInfo(_uint(int(obj.data_ptr()), "data_ptr()"), _uint(nbytes, "size", positive=True), str(device))
    iface = getattr(obj, "__array_interface__", None)
    if isinstance(iface, dict):
        strides = iface.get("strides")
        flags = getattr(obj, "flags", None)
        if strides is not None and not getattr(flags, "c_contiguous", False):
            raise LayoutError("array is not C-contiguous: its blocks cannot be addressed by offset")
        return BufferInfo(_uint(int(iface["data"][0]), "array address"), _uint(int(obj.nbytes), "size", positive=True),
                          "cpu")
    if hasattr(obj, "addr") and hasattr(obj, "size"):
        return BufferInfo(_uint(obj.addr, "address"), _uint(obj.size, "size", positive=True), "cpu")
    raise LayoutError(f"cannot find the memory of a {type(obj).__name__}")


# ---------------------------------------------------------------------------------- planes


@dataclass(frozen=True)
class Plane:
    """``num_blocks`` blocks of ``block_len`` bytes, block ``i`` at ``base + i * stride``.

    ``stride`` 0 means ``block_len`` (blocks back to back).  ``span`` is the registered buffer the
    plane lives in, as ``(addr, nbytes)``; ``None`` means the plane's own extent.  Triplets are
    merged only within one span, so each stays inside one registered region.
    """

    base: int
    block_len: int
    num_blocks: int
    stride: int = 0
    span: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        _uint(self.base, "plane base")
        _uint(self.block_len, "block_len", positive=True)
        _uint(self.num_blocks, "num_blocks", positive=True)
        _uint(self.stride, "stride")
        if self.stride == 0:
            object.__setattr__(self, "stride", self.block_len)
        if self.stride < self.block_len:
            raise LayoutError(f"stride {self.stride} is shorter than block_len {self.block_len}")
        extent = (self.num_blocks - 1) * self.stride + self.block_len
        if self.span is None:
            object.__setattr__(self, "span", (self.base, extent))
        else:
            if not (isinstance(self.span, tuple) and len(self.span) == 2):
                raise LayoutError("span must be an (addr, nbytes) pair")
            addr, nbytes = _uint(self.span[0], "span address"), _uint(self.span[1], "span size", positive=True)
            if self.base < addr or self.base + extent > addr + nbytes:
                raise LayoutError(f"plane [{self.base:#x}, +{extent}) is outside its span [{addr:#x}, +{nbytes})")
        if self.base + extent > _U64:
            raise LayoutError("plane ends beyond the 64-bit address space")

    def block_addr(self, block: int) -> int:
        return self.base + block * self.stride

    def to_list(self) -> list[int]:
        """``[base, block_len, num_blocks, stride, span_addr, span_nbytes]`` (the wire form)."""
        assert self.span is not None
        return [self.base, self.block_len, self.num_blocks, self.stride, self.span[0], self.span[1]]

    @classmethod
    def from_list(cls, items: Sequence[int]) -> Plane:
        if not isinstance(items, (list, tuple)) or len(items) != 6:
            raise LayoutError("a plane is [base, block_len, num_blocks, stride, span_addr, span_nbytes]")
        base, block_len, num_blocks, stride, span_addr, span_len = items
        return cls(base, block_len, num_blocks, stride, (span_addr, span_len))


@dataclass(frozen=True)
class KVLayout:
    """The planes of one worker, one tuple per group of planes that share block ids."""

    groups: tuple[tuple[Plane, ...], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        groups = tuple(tuple(g) for g in self.groups)
        for g in groups:
            if not g or not all(isinstance(p, Plane) for p in g):
                raise LayoutError("each group must be a non-empty sequence of Plane")
        object.__setattr__(self, "groups", groups)

    @classmethod
    def single(cls, planes: Sequence[Plane]) -> KVLayout:
        """A layout of one group (every layer shares the same block ids)."""
        return cls((tuple(planes),))

    @property
    def planes(self) -> tuple[Plane, ...]:
        return tuple(p for g in self.groups for p in g)

    def spans(self) -> tuple[list[int], list[int]]:
        """The distinct buffers to register, as ``(addresses, lengths)`` for ``batch_register_memory``.

        Raises:
            LayoutError: two different spans overlap (the engine would refuse them).
        """
        unique = sorted({p.span for p in self.planes if p.span is not None})
        for (a0, n0), (a1, _) in zip(unique, unique[1:], strict=False):  # neighbours
            if a1 < a0 + n0:
                raise LayoutError(f"spans [{a0:#x}, +{n0}) and [{a1:#x}, ...) overlap")
        return [a for a, _ in unique], [n for _, n in unique]

    def to_list(self) -> list[list[list[int]]]:
        return [[p.to_list() for p in g] for g in self.groups]

    @classmethod
    def from_list(cls, groups: Sequence[Sequence[Sequence[int]]]) -> KVLayout:
        if not isinstance(groups, (list, tuple)):
            raise LayoutError("a layout is a list of groups")
        out = []
        for g in groups:
            if not isinstance(g, (list, tuple)):
                raise LayoutError("a group is a list of planes")
            out.append(tuple(Plane.from_list(p) for p in g))
        return cls(tuple(out))


def planes_of(cache: Any, num_blocks: int, kind: str = KV_BLOCKS) -> list[Plane]:
    """The planes of one cache tensor (numpy array, torch tensor, ``HostBuffer``, ``(addr, nbytes)``).

    Args:
        cache: contiguous memory holding ``num_blocks`` blocks in the arrangement ``kind``.
        num_blocks: blocks per plane.
        kind: ``KV_BLOCKS`` ([num_blocks, ...], one plane), ``KV_FIRST`` ([2, num_blocks, ...], K
            then V) or ``KV_INNER`` ([num_blocks, 2, ...], K and V halves inside each block).

    Returns:
        One plane, or two (K, V), whose span is the whole tensor.

    Raises:
        LayoutError: the size does not divide into the blocks, or an unknown kind.
    """
    if kind not in _KINDS:
        raise LayoutError(f"unknown kind {kind!r}; use one of {_KINDS}")
    info = buffer_info(cache)
    _uint(num_blocks, "num_blocks", positive=True)
    parts = 1 if kind == KV_BLOCKS else 2
    if info.nbytes % (num_blocks * parts):
        raise LayoutError(f"{info.nbytes} bytes do not split into {parts} x {num_blocks} equal blocks")
    span = (info.addr, info.nbytes)
    if kind == KV_BLOCKS:
        return [Plane(info.addr, info.nbytes // num_blocks, num_blocks, span=span)]
    if kind == KV_FIRST:
        half = info.nbytes // 2
        block = half // num_blocks
        return [Plane(info.addr, block, num_blocks, span=span), Plane(info.addr + half, block, num_blocks, span=span)]
    block = info.nbytes // num_blocks
    half = block // 2
    return [Plane(info.addr, half, num_blocks, block, span), Plane(info.addr + half, half, num_blocks, block, span)]


# ---------------------------------------------------------------------------------- heads


class TPRank(NamedTuple):
    """A tensor-parallel position: group size and rank in it."""

    size: int
    rank: int


def _tp(value: Any, what: str) -> TPRank:
    try:
        size, rank = value
    except (TypeError, ValueError):
        raise LayoutError(f"{what} must be a (size, rank) pair") from None
    _uint(size, f"{what} size", positive=True)
    _uint(rank, f"{what} rank")
    if rank >= size:
        raise LayoutError(f"{what} rank {rank} is not below its size {size}")
    return TPRank(size, rank)


@dataclass(frozen=True)
class HeadSplit:
    """How tensor parallelism splits the KV heads of every plane's blocks.

    Args:
        num_heads: KV heads of one layer in the whole model.
        block_size: tokens per block.
        head_bytes: bytes of one head of one token (``head_dim * element_size``).
        token_major: blocks are ``[tokens, heads, dim]`` (NHD) rather than ``[heads, tokens, dim]``
            (HND).  With HND a rank's share of a block is one contiguous chunk; with NHD it is one
            chunk per token.

    A rank of a group of ``tp`` holds ``num_heads / tp`` consecutive heads; when ``tp`` exceeds
    ``num_heads`` (and is a multiple of it) each head is replicated on ``tp / num_heads`` ranks.
    Any other combination cannot be split and raises ``LayoutError``.
    """

    num_heads: int
    block_size: int
    head_bytes: int
    token_major: bool = False

    def __post_init__(self) -> None:
        _uint(self.num_heads, "num_heads", positive=True)
        _uint(self.block_size, "block_size", positive=True)
        _uint(self.head_bytes, "head_bytes", positive=True)

    def heads(self, tp_size: int, tp_rank: int) -> range:
        """The global head indices rank ``tp_rank`` of ``tp_size`` holds."""
        tp = _tp((tp_size, tp_rank), "tp")
        if self.num_heads % tp.size == 0:
            per = self.num_heads // tp.size
            return range(tp.rank * per, (tp.rank + 1) * per)
        if tp.size % self.num_heads == 0:
            head = tp.rank // (tp.size // self.num_heads)
            return range(head, head + 1)
        raise LayoutError(f"{self.num_heads} KV heads cannot be split over {tp.size} ranks")

    def block_len(self, tp_size: int) -> int:
        """Bytes of one plane block on a rank of a group of ``tp_size``."""
        return len(self.heads(tp_size, 0)) * self.block_size * self.head_bytes

    def sources(self, src_tp: int, dst_tp: int, dst_rank: int) -> list[tuple[int, range]]:
        """Which source ranks send which heads to destination rank ``dst_rank``.

        Every head the destination holds comes from exactly one source rank; among replicas, the
        choice rotates with ``dst_rank`` so that replicated sources share the load.

        Returns:
            ``[(src_rank, heads), ...]`` in head order.
        """
        holders: dict = {}
        for r in range(src_tp):
            for h in self.heads(src_tp, r):
                holders.setdefault(h, []).append(r)
        out: list[tuple[int, range]] = []
        for h in self.heads(dst_tp, dst_rank):
            rank = holders[h][dst_rank % len(holders[h])]
            if out and out[-1][0] == rank and out[-1][1].stop == h:
                out[-1] = (rank, range(out[-1][1].start, h + 1))
            else:
                out.append((rank, range(h, h + 1)))
        return out

    def share(self, src: tuple[int, int], dst: tuple[int, int]) -> range:
        """The heads source rank ``src`` = (size, rank) sends to destination rank ``dst`` (empty if none)."""
        src, dst = _tp(src, "source tp"), _tp(dst, "destination tp")
        for rank, heads in self.sources(src.size, dst.size, dst.rank):
            if rank == src.rank:
                return heads
        return range(0)

    def chunks(self, src: tuple[int, int], dst: tuple[int, int], heads: range) -> list[tuple[int, int, int]]:
        """``(src_offset, dst_offset, length)`` of ``heads`` inside one block on each side."""
        src, dst = _tp(src, "source tp"), _tp(dst, "destination tp")
        mine, theirs = self.heads(*src), self.heads(*dst)
        if heads.start < mine.start or heads.stop > mine.stop or heads.start < theirs.start or heads.stop > theirs.stop:
            raise LayoutError(f"heads {heads} are not held by both ranks")
        n, hb = len(heads), self.head_bytes
        src_skip, dst_skip = heads.start - mine.start, heads.start - theirs.start  # heads before ours
        if not self.token_major:
            unit = self.block_size * hb
            return [(src_skip * unit, dst_skip * unit, n * unit)]
        return [((t * len(mine) + src_skip) * hb, (t * len(theirs) + dst_skip) * hb, n * hb)
                for t in range(self.block_size)]


# ---------------------------------------------------------------------------------- triplets


@dataclass
class Triplets:
    """Parallel lists of source addresses, destination addresses and lengths."""

    src: list[int] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        return iter(zip(self.src, self.dst, self.lengths, strict=True))

    @property
    def nbytes(self) -> int:
        return sum(self.lengths)

    def extend(self, other: Triplets) -> None:
        self.src.extend(other.src)
        self.dst.extend(other.dst)
        self.lengths.extend(other.lengths)


def _ids(blocks: Any, what: str) -> list[int]:
    if hasattr(blocks, "tolist"):  # numpy arrays and torch tensors
        blocks = blocks.tolist()
    if not isinstance(blocks, (list, tuple, range)):
        raise LayoutError(f"{what} must be a sequence of block ids")
    for b in blocks:
        if isinstance(b, bool) or not isinstance(b, int) or b < 0:
            raise LayoutError(f"{what} holds {b!r}, not a block id")
    return list(blocks)


def group_contiguous(src_blocks: Any, dst_blocks: Any) -> list[tuple[int, int, int]]:
    """Split paired block-id lists into maximal runs contiguous on both sides.

    Returns:
        ``[(src_first, dst_first, count), ...]`` in list order.

    Raises:
        LayoutError: lists of different lengths, or entries that are not block ids.
    """
    src, dst = _ids(src_blocks, "source blocks"), _ids(dst_blocks, "destination blocks")
    if len(src) != len(dst):
        raise LayoutError(f"{len(src)} source blocks but {len(dst)} destination blocks")
    runs: list[tuple[int, int, int]] = []
    s0 = d0 = n = 0
    for s, d in zip(src, dst, strict=True):
        if n and s == s0 + n and d == d0 + n:
            n += 1
            continue
        if n:
            runs.append((s0, d0, n))
        s0, d0, n = s, d, 1
    if n:
        runs.append((s0, d0, n))
    return runs


def _check_range(plane: Plane, runs: list[tuple[int, int, int]], side: int, what: str) -> None:
    for run in runs:
        if run[side] + run[2] > plane.num_blocks:
            raise LayoutError(f"{what} block {run[side] + run[2] - 1} is beyond the plane's {plane.num_blocks} blocks")


def plan_group(
    src_planes: Sequence[Plane],
    dst_planes: Sequence[Plane],
    src_blocks: Any,
    dst_blocks: Any,
    *,
    split: HeadSplit | None = None,
    src_tp: tuple[int, int] = (1, 0),
    dst_tp: tuple[int, int] = (1, 0),
) -> Triplets:
    """The fewest triplets that copy one request's blocks of one group from source to destination.

    ``src_planes[i]`` is copied to ``dst_planes[i]``; block ``src_blocks[j]`` goes to
    ``dst_blocks[j]``.  Without ``split`` whole blocks move (their lengths must match).  With
    ``split``, only the heads that ``src_tp`` owes ``dst_tp`` move, and each plane's ``block_len``
    must be what the split gives that rank.

    Raises:
        LayoutError: plane counts or block lengths differ, block ids out of range or a
            destination block named twice, or heads that cannot be split.
    """
    return _merge(_pieces(src_planes, dst_planes, src_blocks, dst_blocks, split, src_tp, dst_tp))


_Piece = tuple[int, int, int, Any, Any]  # src, dst, length, source span, destination span


def _pieces(src_planes: Sequence[Plane], dst_planes: Sequence[Plane], src_blocks: Any, dst_blocks: Any,
            split: HeadSplit | None, src_tp: tuple[int, int], dst_tp: tuple[int, int]) -> list[_Piece]:
    if len(src_planes) != len(dst_planes):
        raise LayoutError(f"{len(src_planes)} source planes but {len(dst_planes)} destination planes")
    runs = group_contiguous(src_blocks, dst_blocks)
    dst_ids = [d + k for _, d, n in runs for k in range(n)]
    if len(set(dst_ids)) != len(dst_ids):
        raise LayoutError("a destination block is named twice")
    src, dst = _tp(src_tp, "source tp"), _tp(dst_tp, "destination tp")
    if split is None:
        if src.size != dst.size or src.rank != dst.rank:
            raise LayoutError(f"source tp {tuple(src)} and destination tp {tuple(dst)} differ: pass a HeadSplit")
        chunks = None
    else:
        heads = split.share(src, dst)
        if not heads:
            return []
        chunks = split.chunks(src, dst, heads)
    raw: list[_Piece] = []
    for sp, dp in zip(src_planes, dst_planes, strict=True):
        if split is not None:
            for plane, tp, side in ((sp, src, "source"), (dp, dst, "destination")):
                if plane.block_len != split.block_len(tp.size):
                    raise LayoutError(f"{side} block_len {plane.block_len} is not the {split.block_len(tp.size)} "
                                      f"bytes the head split gives tp {tp.size}")
        elif sp.block_len != dp.block_len:
            raise LayoutError(f"source block_len {sp.block_len} differs from destination block_len {dp.block_len}")
        _check_range(sp, runs, 0, "source")
        _check_range(dp, runs, 1, "destination")
        spans = (sp.span, dp.span)
        if chunks is None or chunks == [(0, 0, sp.block_len)] and sp.block_len == dp.block_len:
            if sp.stride == sp.block_len and dp.stride == dp.block_len:
                for s0, d0, n in runs:
                    raw.append((sp.block_addr(s0), dp.block_addr(d0), n * sp.block_len, *spans))
                continue
            per_block = [(0, 0, sp.block_len)]
        else:
            per_block = chunks
        for s0, d0, n in runs:
            for k in range(n):
                sa, da = sp.block_addr(s0 + k), dp.block_addr(d0 + k)
                for so, do, length in per_block:
                    raw.append((sa + so, da + do, length, *spans))
    return raw


def _merge(raw: list[_Piece]) -> Triplets:
    # Destination ranges never overlap (a destination block is named once), so once sorted by
    # destination address two triplets that can merge are neighbours.
    raw.sort(key=lambda t: t[1])
    out = Triplets()
    last_span: Any = None
    for s, d, n, sspan, dspan in raw:
        if out.lengths and (sspan, dspan) == last_span and out.src[-1] + out.lengths[-1] == s \
                and out.dst[-1] + out.lengths[-1] == d:
            out.lengths[-1] += n
            continue
        out.src.append(s)
        out.dst.append(d)
        out.lengths.append(n)
        last_span = (sspan, dspan)
    return out


def plan(
    src: KVLayout,
    dst: KVLayout,
    src_blocks: Sequence[Any],
    dst_blocks: Sequence[Any],
    *,
    split: HeadSplit | None = None,
    src_tp: tuple[int, int] = (1, 0),
    dst_tp: tuple[int, int] = (1, 0),
) -> Triplets:
    """``plan_group`` over every group: ``src_blocks[g]`` and ``dst_blocks[g]`` are group ``g``'s ids.

    When the destination names fewer blocks than the source in a group (it already holds a
    prefix of the prompt), the source's last blocks are the ones sent.

    Raises:
        LayoutError: group counts differ, the destination names more blocks than the source, and
            whatever ``plan_group`` raises.
    """
    if len(src.groups) != len(dst.groups):
        raise LayoutError(f"{len(src.groups)} source groups but {len(dst.groups)} destination groups")
    if len(src_blocks) != len(src.groups) or len(dst_blocks) != len(dst.groups):
        raise LayoutError(f"need one block-id list per group ({len(src.groups)})")
    raw: list[_Piece] = []
    for sp, dp, sb, db in zip(src.groups, dst.groups, src_blocks, dst_blocks, strict=True):
        sb, db = _ids(sb, "source blocks"), _ids(db, "destination blocks")
        if len(db) > len(sb):
            raise LayoutError(f"destination asks for {len(db)} blocks but the source has {len(sb)}")
        raw.extend(_pieces(sp, dp, sb[len(sb) - len(db):], db, split, src_tp, dst_tp))
    return _merge(raw)
