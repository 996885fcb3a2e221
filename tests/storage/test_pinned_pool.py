import threading
import time

import pytest
import torch

from offload.storage import HostPool, PoolBudgetError


def test_slots_exact_sizes_page_aligned():
    sizes = [5000, 4096, (1 << 20) + 1, 3 * (1 << 20) + 12345]
    pool = HostPool(sizes, pin=False)
    try:
        st = pool.stats()
        # each slot rounded up to 4096 only, never to a power of two
        assert st["capacity_bytes"] == 8192 + 4096 + (1 << 20) + 4096 + 3 * (1 << 20) + 16384
        assert st["slots"] == 4 and st["free_slots"] == 4 and st["in_use_bytes"] == 0
        bufs = [pool.acquire(n) for n in sizes]
        assert sorted(b.nbytes for b in bufs) == sorted([8192, 4096, (1 << 20) + 4096, 3 * (1 << 20) + 16384])
        for b in bufs:
            assert b.data_ptr % 4096 == 0
            b.release()
    finally:
        pool.close()


def test_budget_error_names_budget_asked_and_fix():
    with pytest.raises(PoolBudgetError) as exc:
        HostPool([3 << 20, 3 << 20], budget_bytes=5 << 20, pin=False, name="grads")
    msg = str(exc.value)
    assert "grads" in msg and str(6 << 20) in msg and str(5 << 20) in msg and "raise" in msg
    assert isinstance(exc.value, ValueError)
    HostPool([3 << 20], budget_bytes=3 << 20, pin=False).close()  # exactly at budget is fine


def test_acquire_smallest_fit_and_no_allocation_on_reuse():
    pool = HostPool([1 << 20, 4096, 64 << 10], pin=False)
    try:
        b = pool.acquire(5000)
        assert b.nbytes == 64 << 10  # smallest slot that holds 5000 bytes
        ptr = b.data_ptr
        b.release()
        again = pool.acquire(5000)
        assert again.data_ptr == ptr  # the same memory comes back: nothing allocated
        small = pool.acquire(1)
        assert small.nbytes == 4096
        big = pool.acquire(60 << 10)  # the 64 KiB slot is taken: next is 1 MiB
        assert big.nbytes == 1 << 20
        assert pool.try_acquire(1) is None
        for x in (again, small, big):
            x.release()
    finally:
        pool.close()


def test_counters_in_use_and_peak():
    pool = HostPool([8192, 8192, 4096], pin=False)
    try:
        a, b = pool.acquire(8192), pool.acquire(100)
        assert pool.stats()["in_use_bytes"] == 8192 + 4096
        a.release()
        c = pool.acquire(8000)
        st = pool.stats()
        assert st["in_use_bytes"] == 8192 + 4096 and st["peak_bytes"] == 8192 + 4096 and st["free_slots"] == 1
        b.release()
        c.release()
        st = pool.stats()
        assert st["in_use_bytes"] == 0 and st["peak_bytes"] == 8192 + 4096 and st["free_slots"] == 3
    finally:
        pool.close()


def test_acquire_blocks_until_release_and_times_out():
    pool = HostPool([4096], pin=False)
    try:
        held = pool.acquire(4096)
        with pytest.raises(TimeoutError, match="no free slot"):
            pool.acquire(10, timeout=0.05)
        got = []
        t = threading.Thread(target=lambda: got.append(pool.acquire(10, timeout=10)))
        t.start()
        time.sleep(0.05)
        assert not got  # still waiting
        held.release()
        t.join(5)
        assert got and got[0].nbytes == 4096
        got[0].release()
    finally:
        pool.close()


def test_request_no_slot_can_hold_raises_at_once():
    pool = HostPool([4096, 8192], pin=False)
    try:
        with pytest.raises(PoolBudgetError, match="largest holds 8192"):
            pool.acquire(8193)
        with pytest.raises(PoolBudgetError):
            pool.try_acquire(1 << 20)
    finally:
        pool.close()


def test_views_alias_the_slot_and_check_bounds():
    pool = HostPool([3 * 4096], pin=False)
    try:
        with pool.acquire(10) as buf:
            f = buf.view(torch.float32, 100, offset_bytes=4096)
            u = buf.view(torch.uint8, 3 * 4096)
            f.fill_(1.5)
            assert torch.equal(u[4096:4100], torch.tensor([0, 0, 0xC0, 0x3F], dtype=torch.uint8))
            assert f.data_ptr() == buf.data_ptr + 4096 and f.is_contiguous() and f.dim() == 1
            h = buf.view(torch.bfloat16, 5, offset_bytes=2)
            assert h.numel() == 5
            with pytest.raises(ValueError, match="needs"):
                buf.view(torch.float32, 3 * 1024 + 1)
            with pytest.raises(ValueError, match="multiple of 4"):
                buf.view(torch.float32, 1, offset_bytes=2)
        assert pool.stats()["free_slots"] == 1  # the context manager released it
        with pytest.raises(RuntimeError, match="already released"):
            buf.release()
        with pytest.raises(RuntimeError, match="already released"):
            buf.view(torch.uint8, 1)
    finally:
        pool.close()


def test_pin_none_follows_cuda_and_pin_true_needs_cuda():
    pool = HostPool([4096])
    try:
        assert pool.pinned == torch.cuda.is_available()
    finally:
        pool.close()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            HostPool([4096], pin=True)


@pytest.mark.cuda
def test_pinned_slots_are_page_locked():
    pool = HostPool([(1 << 20) + 5], pin=True)
    try:
        with pool.acquire(1) as buf:
            t = buf.view(torch.uint8, buf.nbytes)
            assert t.is_pinned() and buf.nbytes == (1 << 20) + 4096
            d = t.to("cuda", non_blocking=True)
            torch.cuda.synchronize()
            assert d.numel() == t.numel()
    finally:
        pool.close()


def test_bad_arguments():
    with pytest.raises(ValueError):
        HostPool([], pin=False)
    with pytest.raises(ValueError):
        HostPool([0], pin=False)
    pool = HostPool([4096], pin=False)
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.acquire(1)


def test_arena_lends_ranges_within_its_budget_and_merges_them_back():
    from offload.storage import HostArena
    a = HostArena(10 * 4096 + 100, pin=False, name="arena")        # rounded down: never over the budget
    assert a.capacity_bytes == 10 * 4096
    x, y, z = a.acquire(5000), a.acquire(4096), a.acquire(3 * 4096)   # 2 + 1 + 3 pages
    assert (x.nbytes, y.nbytes, z.nbytes) == (8192, 4096, 12288)
    ptrs = sorted(b.data_ptr for b in (x, y, z))
    assert all(p % 4096 == 0 for p in ptrs) and ptrs[1] - ptrs[0] >= 4096
    assert a.try_acquire(5 * 4096) is None and a.stats()["largest_free_bytes"] == 4 * 4096
    with pytest.raises(TimeoutError, match="no free range"):
        a.acquire(5 * 4096, timeout=0.01)
    x.release()
    z.release()                                        # x's pages, y, then z's merged with the tail
    assert a.stats()["largest_free_bytes"] == 7 * 4096
    y.release()
    st = a.stats()
    assert (st["in_use_bytes"], st["largest_free_bytes"], st["peak_bytes"]) == (0, 10 * 4096, 6 * 4096)
    with pytest.raises(PoolBudgetError, match="do not fit"):
        a.acquire(11 * 4096)
    a.close()


@pytest.mark.parametrize("huge", [False, True], ids=["4k", "huge"])
def test_arena_trim_gives_free_pages_back(huge):
    import psutil
    from offload.storage import HostArena
    proc = psutil.Process()
    a = HostArena(64 << 20, pin=False, name="trim", huge_pages=huge)
    buf = a.acquire(64 << 20)
    buf.view(torch.uint8, 64 << 20).fill_(1)                 # every page resident
    before = proc.memory_info().rss
    assert a.trim() == 0                                     # nothing free: nothing given back
    buf.release()
    assert a.trim() == 64 << 20
    assert before - proc.memory_info().rss > 48 << 20
    again = a.acquire(4096)
    assert int(again.view(torch.uint8, 4096).sum()) == 0     # the pages come back as zeros
    again.release()
    a.close()


def test_pool_slots_ask_for_huge_pages_only_when_told():
    """``HostPool(huge_pages=True)``: every slot's mapping carries the kernel's ``hg`` flag
    (MADV_HUGEPAGE); without it, none does."""
    import mmap
    import os
    from offload import device as dev
    supported = hasattr(mmap, "MADV_HUGEPAGE") and os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")
    for huge in (False, True):
        pool = HostPool([4 << 20, 6 << 20], pin=False, name="thp", huge_pages=huge)
        bufs = [pool.acquire(4 << 20), pool.acquire(6 << 20)]
        for b in bufs:
            assert ("hg" in dev._mapping_flags(b.view(torch.uint8, 4096).data_ptr())) is (huge and supported)
            b.release()
        pool.close()


def test_arena_asks_for_huge_pages_only_when_told():
    """``huge_pages``: the arena's mapping carries the kernel's ``hg`` flag (MADV_HUGEPAGE),
    which an arena without it does not; a pinned arena is never advised (CUDA locks its pages)."""
    import mmap
    import os
    from offload import device as dev
    from offload.storage import HostArena
    supported = hasattr(mmap, "MADV_HUGEPAGE") and os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")
    for huge in (False, True):
        a = HostArena(8 << 20, pin=False, name="thp", huge_pages=huge)
        buf = a.acquire(4096)
        assert ("hg" in dev._mapping_flags(buf.view(torch.uint8, 4096).data_ptr())) is (huge and supported)
        buf.release()
        a.close()


@pytest.mark.parametrize("kind", ["pool", "arena"])
def test_closed_memory_stays_under_a_live_tensor(kind):
    """close() frees the memory, but never under a tensor still over a buffer: it reads what
    was written until it goes (the mapping goes with the last tensor over it)."""
    from offload.storage import HostArena
    pool = HostPool([8192, 4096], pin=False) if kind == "pool" else HostArena(3 * 4096, pin=False)
    buf = pool.acquire(4096)
    kept = buf.view(torch.float32, 1024)
    kept.fill_(3.0)
    buf.release()
    pool.close()
    assert torch.equal(kept, torch.full((1024,), 3.0))


@pytest.mark.parametrize("kind", ["pool", "arena"])
def test_the_one_wait_names_who_holds_the_buffers(kind):
    """A wait for a buffer that runs out names the owners holding the pool's buffers (the
    ``holder`` each took it with), so a stuck owner is found from the message."""
    from offload.storage import HostArena
    pool = HostPool([4096, 4096], pin=False, name="w") if kind == "pool" else HostArena(8192, pin=False, name="w")
    try:
        a = pool.acquire(4096, holder="optimizer state of block 1")
        b = pool.try_acquire(4096, "parameters of block 2")
        with pytest.raises(TimeoutError, match=r"held by optimizer state of block 1, parameters of block 2"):
            pool.acquire(4096, timeout=0.05, holder="block 3")
        b.release()
        c = pool.acquire(4096, holder="optimizer state of block 1")
        with pytest.raises(TimeoutError, match=r"held by optimizer state of block 1 \(2\)\)"):
            pool.acquire(4096, timeout=0.0)
        a.release(), c.release()
    finally:
        pool.close()


def test_the_one_wait_asks_make_room_and_wakes_on_a_release():
    """``make_room``: MADE (it gave a buffer back) tries again at once, NEVER (nobody will)
    returns None at once, WAIT waits for a release, which wakes the waiter through the
    pool's condition variable long before ``poll_s`` or the timeout."""
    from offload.storage.pool import Room
    pool = HostPool([4096], pin=False, name="rooms")
    try:
        held = [pool.acquire(10, holder="a write in flight")]
        made = lambda: (held.pop().release(), Room.MADE)[1] if held else Room.WAIT   # noqa: E731
        buf = pool.acquire(10, timeout=5.0, make_room=made)
        assert buf is not None and not held
        t0 = time.monotonic()
        assert pool.acquire(10, timeout=5.0, make_room=lambda: Room.NEVER) is None
        assert time.monotonic() - t0 < 1.0
        threading.Timer(0.05, buf.release).start()
        t0 = time.monotonic()
        got = pool.acquire(10, timeout=30.0, make_room=lambda: Room.WAIT, poll_s=20.0)
        assert got is not None and time.monotonic() - t0 < 10.0, "the release did not wake the waiter"
        got.release()
    finally:
        pool.close()
