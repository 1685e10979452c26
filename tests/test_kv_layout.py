"""Paged-KV grouping: triplets copy exactly the right bytes (checked in real memory) and are fewest."""

from __future__ import annotations

import ctypes
import itertools
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flagcx_mc import HostBuffer
from flagcx_mc.kv import (
    KV_BLOCKS,
    KV_FIRST,
    KV_INNER,
    HeadSplit,
    KVLayout,
    LayoutError,
    Plane,
    buffer_info,
    group_contiguous,
    plan,
    plan_group,
    planes_of,
)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------- helpers


def _span_of(addr, spans):
    for base, size in spans:
        if base <= addr < base + size:
            return base, size
    raise AssertionError(f"address {addr:#x} outside every buffer")


def _apply(triplets, src_arrays, dst_arrays):
    """Copy through real memory, after proving every triplet lies inside one buffer on each side."""
    src_spans = [(a.ctypes.data, a.nbytes) for a in src_arrays]
    dst_spans = [(a.ctypes.data, a.nbytes) for a in dst_arrays]
    for s, d, n in triplets:
        sb, sn = _span_of(s, src_spans)
        db, dn = _span_of(d, dst_spans)
        assert n > 0 and s + n <= sb + sn and d + n <= db + dn, "triplet crosses a buffer boundary"
    for s, d, n in triplets:
        ctypes.memmove(d, s, n)


def _assert_fewest(triplets, src_arrays, dst_arrays):
    """No two triplets could merge: adjacent on both sides inside the same buffers."""
    src_spans = [(a.ctypes.data, a.nbytes) for a in src_arrays]
    dst_spans = [(a.ctypes.data, a.nbytes) for a in dst_arrays]
    ends = {}
    for s, d, n in triplets:
        ends[(s + n, d + n)] = (_span_of(s, src_spans), _span_of(d, dst_spans))
    for s, d, _ in triplets:
        before = ends.get((s, d))
        assert before != (_span_of(s, src_spans), _span_of(d, dst_spans)), "two triplets could have merged"


def _caches(layers, num_blocks, kind, block_shape, seed):
    rng = np.random.default_rng(seed)
    shape = {KV_BLOCKS: (num_blocks, *block_shape), KV_FIRST: (2, num_blocks, *block_shape),
             KV_INNER: (num_blocks, 2, *block_shape)}[kind]
    return [rng.integers(0, 1 << 16, size=shape, dtype=np.uint16) for _ in range(layers)]


def _blocks_view(cache, kind):
    """[kv, block, ...] view of a cache, whatever its kind."""
    if kind == KV_BLOCKS:
        return cache[None]
    if kind == KV_FIRST:
        return cache
    return cache.swapaxes(0, 1)


def _layout(caches, num_blocks, kind):
    return KVLayout.single([p for c in caches for p in planes_of(c, num_blocks, kind)])


block_pairs = st.integers(1, 24).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, 31), min_size=n, max_size=n),
        st.permutations(list(range(32))).map(lambda p: p[:n]),
    )
)


# ---------------------------------------------------------------------------------- grouping


def test_group_contiguous_examples():
    assert group_contiguous([], []) == []
    assert group_contiguous([3, 4, 5, 9, 10], [0, 1, 2, 3, 4]) == [(3, 0, 3), (9, 3, 2)]
    # contiguous on one side only is not a run
    assert group_contiguous([1, 2, 3], [7, 9, 10]) == [(1, 7, 1), (2, 9, 2)]
    assert group_contiguous(np.array([5, 6]), np.array([1, 2])) == [(5, 1, 2)]
    with pytest.raises(LayoutError):
        group_contiguous([1, 2], [1])
    with pytest.raises(LayoutError):
        group_contiguous([1, -2], [1, 2])
    with pytest.raises(LayoutError):
        group_contiguous([1, True], [1, 2])


@SETTINGS
@given(block_pairs)
def test_group_contiguous_reconstructs_and_is_maximal(pair):
    src, dst = pair
    runs = group_contiguous(src, dst)
    assert [s + k for s, _, n in runs for k in range(n)] == src
    assert [d + k for _, d, n in runs for k in range(n)] == dst
    for (s0, d0, n0), (s1, d1, _) in itertools.pairwise(runs):
        assert not (s1 == s0 + n0 and d1 == d0 + n0), "two runs could have been one"


# ---------------------------------------------------------------------------------- same TP


@pytest.mark.parametrize("kind,expected", [(KV_BLOCKS, 2 * 3), (KV_FIRST, 2 * 2 * 3), (KV_INNER, 2 * 3)])
def test_fewest_triplets_for_known_runs(kind, expected):
    # Three layers, two runs contiguous on both sides ([3, 4, 5] -> [0, 1, 2] and [9, 10] -> [3, 4]):
    # one triplet per run and plane; fused K/V inside a block merge into one.
    src_caches = _caches(3, 16, kind, (4, 8), seed=1)
    dst_caches = _caches(3, 16, kind, (4, 8), seed=2)
    src, dst = [3, 4, 5, 9, 10], [0, 1, 2, 3, 4]
    t = plan(_layout(src_caches, 16, kind), _layout(dst_caches, 16, kind), [src], [dst])
    assert len(t) == expected
    assert t.nbytes == sum(c.nbytes // 16 * 5 for c in src_caches)  # every byte of the 5 blocks


@SETTINGS
@given(kind=st.sampled_from([KV_BLOCKS, KV_FIRST, KV_INNER]), pair=block_pairs, layers=st.integers(1, 3))
def test_same_tp_moves_exactly_the_blocks(kind, pair, layers):
    src_ids, dst_ids = pair
    src_caches = _caches(layers, 32, kind, (2, 3, 4), seed=len(src_ids))
    dst_caches = _caches(layers, 32, kind, (2, 3, 4), seed=99)
    before = [c.copy() for c in dst_caches]
    t = plan(_layout(src_caches, 32, kind), _layout(dst_caches, 32, kind), [src_ids], [dst_ids])
    _apply(t, src_caches, dst_caches)
    _assert_fewest(t, src_caches, dst_caches)
    untouched = sorted(set(range(32)) - set(dst_ids))
    for sc, dc, old in zip(src_caches, dst_caches, before, strict=True):
        sv, dv, ov = _blocks_view(sc, kind), _blocks_view(dc, kind), _blocks_view(old, kind)
        assert np.array_equal(dv[:, dst_ids], sv[:, src_ids])
        assert np.array_equal(dv[:, untouched], ov[:, untouched]), "bytes outside the named blocks changed"


def test_whole_tensor_run_merges_k_and_v_of_kv_first():
    # All blocks in order: K plane and V plane of one tensor are adjacent, so one triplet per layer.
    caches = _caches(2, 8, KV_FIRST, (16,), seed=3)
    dst = _caches(2, 8, KV_FIRST, (16,), seed=4)
    t = plan(_layout(caches, 8, KV_FIRST), _layout(dst, 8, KV_FIRST), [list(range(8))], [list(range(8))])
    assert len(t) == 2 and t.lengths == [caches[0].nbytes] * 2


def test_triplets_never_cross_separately_registered_buffers():
    # Two layers allocated back to back in one buffer, but registered (spanned) separately.
    with HostBuffer(2 * 4 * 1024) as src, HostBuffer(2 * 4 * 1024) as dst:
        def planes(buf):
            return [Plane(buf.addr + i * 4096, 1024, 4, span=(buf.addr + i * 4096, 4096)) for i in range(2)]
        t = plan(KVLayout.single(planes(src)), KVLayout.single(planes(dst)), [[0, 1, 2, 3]], [[0, 1, 2, 3]])
        assert t.lengths == [4096, 4096]
        joined = [Plane(src.addr + i * 4096, 1024, 4, span=(src.addr, 8192)) for i in range(2)]
        joined_dst = [Plane(dst.addr + i * 4096, 1024, 4, span=(dst.addr, 8192)) for i in range(2)]
        t = plan(KVLayout.single(joined), KVLayout.single(joined_dst), [[0, 1, 2, 3]], [[0, 1, 2, 3]])
        assert t.lengths == [8192]


def test_groups_and_prefix_hit():
    full = _caches(2, 16, KV_BLOCKS, (8,), seed=5)
    swa = _caches(1, 16, KV_BLOCKS, (8,), seed=6)
    dfull = _caches(2, 16, KV_BLOCKS, (8,), seed=7)
    dswa = _caches(1, 16, KV_BLOCKS, (8,), seed=8)
    src = KVLayout(([p for c in full for p in planes_of(c, 16)], planes_of(swa[0], 16)))
    dst = KVLayout(([p for c in dfull for p in planes_of(c, 16)], planes_of(dswa[0], 16)))
    # Decode already holds the first two blocks of group 0: it names only the last two, which must
    # come from prefill's last two.
    t = plan(src, dst, [[1, 2, 3, 4], [7]], [[10, 11], [0]])
    _apply(t, full + swa, dfull + dswa)
    for s, d in zip(full, dfull, strict=True):
        assert np.array_equal(d[[10, 11]], s[[3, 4]])
    assert np.array_equal(dswa[0][0], swa[0][7])
    with pytest.raises(LayoutError, match="asks for 3 blocks"):
        plan(src, dst, [[1, 2], [7]], [[1, 2, 3], [0]])
    with pytest.raises(LayoutError, match="one block-id list per group"):
        plan(src, dst, [[1, 2]], [[1, 2]])


# ---------------------------------------------------------------------------------- TP


def _tp_caches(split, tp, layers, num_blocks, seed):
    heads = len(split.heads(tp, 0))
    dim = split.head_bytes // 2
    block = (split.block_size, heads, dim) if split.token_major else (heads, split.block_size, dim)
    return _caches(layers, num_blocks, KV_FIRST, block, seed)


@SETTINGS
@given(
    tps=st.sampled_from([(1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 8), (8, 4), (2, 2), (8, 8), (16, 2), (2, 16)]),
    token_major=st.booleans(),
    pair=block_pairs,
)
def test_different_tp_moves_each_head_once_from_the_right_rank(tps, token_major, pair):
    src_tp, dst_tp = tps
    split = HeadSplit(num_heads=8, block_size=4, head_bytes=2 * 3, token_major=token_major)
    src_ids, dst_ids = pair
    layers, nb = 2, 32
    srcs = [_tp_caches(split, src_tp, layers, nb, seed=10 + r) for r in range(src_tp)]
    for d_rank in range(dst_tp):
        dst = _tp_caches(split, dst_tp, layers, nb, seed=50)
        before = [c.copy() for c in dst]
        sent_heads = []
        for s_rank in range(src_tp):
            t = plan(_layout(srcs[s_rank], nb, KV_FIRST), _layout(dst, nb, KV_FIRST), [src_ids], [dst_ids],
                     split=split, src_tp=(src_tp, s_rank), dst_tp=(dst_tp, d_rank))
            _apply(t, srcs[s_rank], dst)
            _assert_fewest(t, srcs[s_rank], dst)
            share = split.share((src_tp, s_rank), (dst_tp, d_rank))
            assert (len(t) == 0) == (len(share) == 0)
            sent_heads.extend(share)
            mine, theirs = split.heads(src_tp, s_rank), split.heads(dst_tp, d_rank)
            axis = 3 if token_major else 2  # [kv, block, heads, tokens, dim] or [kv, block, tokens, heads, dim]
            for sc, dc in zip(srcs[s_rank], dst, strict=True):
                got = np.take(dc[:, dst_ids], [h - theirs.start for h in share], axis=axis)
                want = np.take(sc[:, src_ids], [h - mine.start for h in share], axis=axis)
                assert np.array_equal(got, want)
        assert sorted(sent_heads) == list(split.heads(dst_tp, d_rank)), "each head exactly once"
        untouched = sorted(set(range(nb)) - set(dst_ids))
        for dc, old in zip(dst, before, strict=True):
            assert np.array_equal(dc[:, untouched], old[:, untouched])


def test_head_split_rules():
    split = HeadSplit(num_heads=4, block_size=16, head_bytes=256)
    assert split.heads(2, 1) == range(2, 4)
    assert split.heads(8, 5) == range(2, 3)  # replicated: ranks 4 and 5 hold head 2
    assert split.block_len(2) == 2 * 16 * 256
    assert split.sources(2, 4, 3) == [(1, range(3, 4))]
    assert split.sources(4, 1, 0) == [(0, range(0, 1)), (1, range(1, 2)), (2, range(2, 3)), (3, range(3, 4))]
    # replicas share the load: decode ranks 0 and 1 read head 0 from different prefill ranks
    assert split.sources(8, 8, 0) != split.sources(8, 8, 1)
    with pytest.raises(LayoutError, match="cannot be split"):
        split.heads(3, 0)
    with pytest.raises(LayoutError):
        split.heads(2, 2)


def test_tp_mismatch_is_refused_without_a_split_and_block_lens_are_checked():
    a = _caches(1, 8, KV_BLOCKS, (64,), seed=1)
    b = _caches(1, 8, KV_BLOCKS, (32,), seed=2)
    la, lb = _layout(a, 8, KV_BLOCKS), _layout(b, 8, KV_BLOCKS)
    with pytest.raises(LayoutError, match="pass a HeadSplit"):
        plan(la, la, [[0]], [[0]], src_tp=(2, 0), dst_tp=(1, 0))
    with pytest.raises(LayoutError, match="block_len"):
        plan(la, lb, [[0]], [[0]])
    split = HeadSplit(num_heads=4, block_size=1, head_bytes=32)  # tp 1 -> 128-byte blocks; lb has 64
    with pytest.raises(LayoutError, match="head split gives"):
        plan(lb, lb, [[0]], [[0]], split=split)


@pytest.mark.parametrize("src,dst,match", [
    ([8], [0], "beyond"),
    ([0], [8], "beyond"),
    ([0, 1], [2, 2], "named twice"),
    ([0, 1], [0], "differ|blocks but"),
])
def test_bad_block_ids_are_refused(src, dst, match):
    a = _caches(1, 8, KV_BLOCKS, (16,), seed=1)
    la = _layout(a, 8, KV_BLOCKS)
    with pytest.raises(LayoutError, match=match):
        plan_group(la.planes, la.planes, src, dst)


# ---------------------------------------------------------------------------------- tensors


class FakeTensor:
    """The duck-typed surface of a torch tensor that the layout reads (torch is not installed)."""

    def __init__(self, array, device="cpu", contiguous=True):
        self._array, self._device, self._contiguous = array, device, contiguous

    def data_ptr(self):
        return self._array.ctypes.data

    def element_size(self):
        return self._array.itemsize

    def numel(self):
        return self._array.size

    def is_contiguous(self):
        return self._contiguous

    @property
    def is_cuda(self):
        return self._device.startswith("cuda")

    @property
    def device(self):
        return self._device


def test_buffer_info_reads_numpy_fake_torch_hostbuffer_and_pairs():
    arr = np.zeros((4, 16), dtype=np.float32)
    assert buffer_info(arr) == (arr.ctypes.data, 256, "cpu")
    assert buffer_info(FakeTensor(arr, "cuda:1")) == (arr.ctypes.data, 256, "cuda:1")
    with HostBuffer(8192) as hb:
        assert buffer_info(hb)[:2] == (hb.addr, 8192)
    assert buffer_info((4096, 10)) == (4096, 10, "cpu")
    with pytest.raises(LayoutError, match="contiguous"):
        buffer_info(arr[:, ::2])
    with pytest.raises(LayoutError, match="contiguous"):
        buffer_info(FakeTensor(arr, contiguous=False))
    with pytest.raises(LayoutError):
        buffer_info(object())


def test_planes_of_fake_cuda_tensor_by_address_and_size():
    arr = np.zeros((2, 10, 4, 8), dtype=np.float16)  # [2, num_blocks, ...], 64 bytes per block
    k, v = planes_of(FakeTensor(arr, "cuda:0"), 10, KV_FIRST)
    base = arr.ctypes.data
    assert (k.base, k.block_len, k.num_blocks, k.stride) == (base, 64, 10, 64)
    assert v.base == base + 640 and v.span == (base, 1280)
    k, v = planes_of(FakeTensor(arr, "cuda:0"), 10, KV_INNER)
    assert (k.block_len, k.stride, v.base) == (64, 128, base + 64)
    with pytest.raises(LayoutError, match="equal blocks"):
        planes_of(arr, 3)
    with pytest.raises(LayoutError, match="unknown kind"):
        planes_of(arr, 10, "kv_last")


def test_layout_wire_form_and_spans():
    caches = _caches(2, 8, KV_INNER, (16,), seed=1)
    layout = _layout(caches, 8, KV_INNER)
    assert KVLayout.from_list(layout.to_list()) == layout
    addrs, lens = layout.spans()
    assert sorted(zip(addrs, lens, strict=True)) == sorted((c.ctypes.data, c.nbytes) for c in caches)
    with pytest.raises(LayoutError, match="overlap"):
        KVLayout.single([Plane(4096, 64, 4), Plane(4096 + 128, 64, 4)]).spans()
    with pytest.raises(LayoutError, match="outside its span"):
        Plane(4096, 64, 4, span=(4096, 100))
    with pytest.raises(LayoutError, match="stride"):
        Plane(4096, 64, 4, stride=32)


def test_importing_the_toolkit_imports_neither_torch_nor_numpy():
    code = "import sys, flagcx_mc.kv; print('torch' in sys.modules, 'numpy' in sys.modules)"
    from support.servers import PACKAGE_PARENT

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=PACKAGE_PARENT)
    assert out.stdout.split() == ["False", "False"], out.stderr
