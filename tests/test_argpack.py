"""The transfer-call argument packer: every element checked, packed exactly, errors named."""

import array
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from flagcx_mc import errors
from flagcx_mc._argpack import pack3
from flagcx_mc.engine.requests import OP_WRITE, TransferRequest

u64 = st.integers(0, 2**64 - 1)


@given(st.lists(st.tuples(u64, u64, st.integers(0, 2**40)), max_size=300))
def test_packs_local_remote_lengths_in_order(triples):
    local, remote, lens = (list(x) for x in zip(*triples, strict=True)) if triples else ([], [], [])
    packed, n, total = pack3(local, remote, lens)
    assert n == len(triples) and total == sum(lens)
    slots = max(n, 1)
    words = array.array("Q", bytes(packed))
    assert len(words) == 3 * slots
    assert list(words[:n]) == local
    assert list(words[slots:slots + n]) == remote
    assert list(words[2 * slots:2 * slots + n]) == lens


def test_accepts_tuples_generators_and_numpy_integers():
    packed, n, total = pack3((1, 2), (x for x in (3, 4)), np.array([5, 6], dtype=np.uint64).tolist())
    assert (n, total) == (2, 11)
    _, _, total = pack3([np.int64(7)], [np.uint64(2**63)], [np.int32(9)])
    assert total == 9


@pytest.mark.parametrize(
    "args, message",
    [
        (([1], [2], [True]), "lengths must be integers, not booleans"),
        (([1.0], [2], [3]), "buffers must be integers"),
        (([1], ["2"], [3]), "peer buffer addresses must be integers"),
        (([-1], [2], [3]), "buffers must lie in [0, 2**64)"),
        (([1], [2**64], [3]), "peer buffer addresses must lie in [0, 2**64)"),
        (([1, 2], [2], [3]), "differ in length (2, 1, 1)"),
        (([1, 2], [2, 3], [2**63, 2**63]), "lengths add up to 2**64"),
        ((5, [2], [3]), "must be sequences"),
    ],
)
def test_bad_input_is_refused_with_the_list_named(args, message):
    with pytest.raises((TypeError, ValueError), match=None) as info:
        pack3(*args)
    assert message in str(info.value)
    with pytest.raises(errors.InvalidArgumentError) as info:
        TransferRequest.build(OP_WRITE, *args)
    assert message in str(info.value)


def test_request_packs_the_three_lists_into_one_immutable_buffer():
    lists = ([10, 11, 12], [20, 21, 22], [1, 2, 3])
    req = TransferRequest.build(OP_WRITE, *lists)
    for values in lists:
        values[0] = 99  # the caller's lists may change once the call has them
    assert (req.count, req.total_bytes) == (3, 6)
    assert isinstance(req.packed, bytes)
    assert struct.unpack("=9Q", req.packed) == (10, 11, 12, 20, 21, 22, 1, 2, 3)
    empty = TransferRequest.build(OP_WRITE, [], [], [])
    assert (empty.count, empty.total_bytes, struct.unpack("=3Q", empty.packed)) == (0, 0, (0, 0, 0))


def test_no_memory_is_kept_across_calls_good_or_bad():
    import gc
    import tracemalloc

    big = list(range(1 << 20, (1 << 20) + 512))
    bad = ([1, 2], [3, -4], [5, 6])

    def churn():
        for _ in range(300):
            pack3(big, big, big)
            with pytest.raises(ValueError):
                pack3(*bad)

    churn()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        churn()
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 64 * 1024, f"{grown} bytes kept after 600 calls"


@pytest.mark.parametrize("args, message", [
    ((True, 2, 3), "not booleans"),
    ((-1, 2, 3), r"lie in \[0, 2\*\*64\)"),
    ((1, 2.0, 3), "element 0 is float"),
    ((1, 2, 1 << 64), r"lie in \[0, 2\*\*64\)"),
])
def test_single_range_is_checked_like_the_lists(args, message):
    """transfer_sync_write/read take a shortcut for one range of plain ints; anything else gets
    the lists' own checks and errors."""
    from flagcx_mc.engine.requests import SingleTransfer, TransferRequest
    from flagcx_mc.errors import InvalidArgumentError

    assert isinstance(TransferRequest.single(0, 1, 2, 3), SingleTransfer)
    with pytest.raises(InvalidArgumentError, match=message):
        TransferRequest.single(0, *args)


EDGES = [0, 1, 2**15 - 1, 2**15, 2**30 - 1, 2**30, 2**31, 2**45 + 12345, 2**60 - 1, 2**60, 2**62,
         2**63 - 1, 2**63, 2**64 - 1]


@pytest.mark.parametrize("value", EDGES)
def test_digit_boundaries_pack_exactly(value):
    """Both sides of every 15- and 30-bit digit boundary, and an int subclass, pack the same
    value."""

    class Address(int):
        pass

    packed, n, total = pack3([value, Address(value)], [value, value], [value, 0])
    assert list(array.array("Q", bytes(packed))) == [value, value, value, value, value, 0]
    assert total == value


@pytest.mark.parametrize("value", [-1, -(2**30), -(2**60), -(2**64)])
def test_negative_ints_of_any_width_are_refused(value):
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, 2\*\*64\)"):
        pack3([0], [0], [value])
    with pytest.raises(ValueError, match=r"buffers must lie in \[0, 2\*\*64\)"):
        pack3([value], [0], [1])


def test_the_module_is_built_for_the_stable_abi():
    """One module for every CPython from 3.10: built against the limited API (abi3)."""
    from flagcx_mc import _argpack

    assert _argpack.__file__.endswith(".abi3.so")


@given(st.lists(st.tuples(u64, u64, st.integers(0, 2**40)), max_size=100), st.booleans())
def test_lists_and_tuples_pack_alike(triples, as_tuples):
    lists = [list(x) for x in zip(*triples, strict=True)] if triples else [[], [], []]
    args = [tuple(x) for x in lists] if as_tuples else lists
    packed, n, total = pack3(*args)
    assert n == len(triples) and total == sum(lists[2])
    assert struct.unpack(f"={3 * max(n, 1)}Q", packed)[:3 * n] == (*lists[0], *lists[1], *lists[2])


def test_list_and_tuple_subclasses_pack_as_their_bases():
    """Subclasses of list and tuple pack as their bases do."""
    from collections import namedtuple

    class Addresses(list):
        pass

    Triple = namedtuple("Triple", "a b c")
    values = [2**45 + 1, 7, 2**63 + 5]
    expected = pack3(values, values, [1, 2, 3])
    assert pack3(Addresses(values), Triple(*values), Triple(1, 2, 3)) == expected
