"""The communication buffer pool: best-fit reuse across sizes and dtypes, bounded idle memory."""

from __future__ import annotations

import pytest
import torch

from fsdp2.comm.buffers import BufferPool

CPU = torch.device("cpu")


def test_a_larger_idle_buffer_serves_a_smaller_request_of_another_dtype() -> None:
    pool = BufferPool()
    big = pool.acquire(1000, torch.float32, CPU)
    ptr = big.data_ptr()
    pool.release(big)
    small = pool.acquire(300, torch.bfloat16, CPU)
    assert (small.numel(), small.dtype, small.data_ptr()) == (300, torch.bfloat16, ptr)
    assert pool.allocations == 1


def test_best_fit_leaves_the_large_buffer_for_the_large_request() -> None:
    pool = BufferPool()
    a, b = pool.acquire(100, torch.float32, CPU), pool.acquire(1000, torch.float32, CPU)
    pool.release(b)
    pool.release(a)
    small = pool.acquire(50, torch.float32, CPU)  # takes the 100-element buffer
    large = pool.acquire(900, torch.float32, CPU)  # still finds the 1000-element one
    assert pool.allocations == 2 and small.data_ptr() != large.data_ptr()


def test_buffers_in_use_are_never_handed_out_twice() -> None:
    pool = BufferPool()
    first = pool.acquire(10, torch.float32, CPU)
    second = pool.acquire(10, torch.float32, CPU)
    assert first.data_ptr() != second.data_ptr() and pool.allocations == 2


def test_idle_buffers_are_capped_and_the_smallest_is_dropped() -> None:
    pool = BufferPool(max_free=2)
    bufs = [pool.acquire(n, torch.float32, CPU) for n in (10, 20, 30)]
    for b in bufs:
        pool.release(b)
    assert pool.idle_bytes() == (20 + 30) * 4


def test_releasing_a_foreign_tensor_is_an_internal_error() -> None:
    pool = BufferPool()
    with pytest.raises(AssertionError, match="did not hand out"):
        pool.release(torch.empty(4))
    buf = pool.acquire(4, torch.float32, CPU)
    pool.release(buf)
    with pytest.raises(AssertionError, match="did not hand out"):
        pool.release(buf)


def test_a_buffer_dropped_without_release_is_not_kept() -> None:
    pool = BufferPool()
    buf = pool.acquire(1000, torch.float32, CPU)
    del buf  # its holder went away mid-step
    assert pool._in_use == {} and pool.idle_bytes() == 0
    again = pool.acquire(10, torch.float32, CPU)
    pool.release(again)
    assert pool.idle_bytes() == 40
