"""The connector's pinned staging pool (CUDA path), exercised on the CPU with pinning off.

Pinned memory needs CUDA, which CI does not have: `pin=False` is the only difference from the
pool the connector uses on a GPU.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from teacher.connector import _PinnedPool  # noqa: E402

MiB = 1 << 20


def test_pool_reuses_bounds_and_grows():
    pool = _PinnedPool(2, pin=False)
    a = pool.take(3 * MiB)
    assert a.numel() == 4 * MiB  # power of two
    b = pool.take(100)
    assert b.numel() == MiB  # at least 1 MiB
    assert pool.take(10) is None  # both busy, capacity 2: the caller copies to pageable memory
    pool.give(a)
    pool.give(b)
    assert pool.take(MiB) is b  # the smallest buffer that fits, found by identity
    assert pool.take(MiB) is a
    pool.give(a)
    pool.give(b)
    c = pool.take(8 * MiB)  # none fits: one idle buffer is replaced by a larger one
    assert c.numel() == 8 * MiB and pool._count == 2
    assert pool.take(MiB) is b  # a (first idle) was the one replaced
    assert pool.take(MiB) is None


def test_pool_disabled():
    assert _PinnedPool(0, pin=False).take(10) is None
