"""The tier protocol: one Loan state machine over NVMe / host / device tiers, its failures and
bounded waits; and the extent layout shared by both I/O backends."""
import ctypes
import errno
import time
import zlib

import pytest
import torch

from offload.storage import HostPool, NvmeStore
from offload.storage.nvme import ExtentLayout
from offload.core.errors import InvariantError
from offload.storage.loan import LoanState, LoanStateError, TierIOError, TierTimeout
from offload.storage.tier import DeviceTier, HostTier, NvmeTier
from offload.units import PAGE

BLOCK = 64 << 10
BACKENDS = [pytest.param({"backend": "native"}, id="native"), pytest.param({"backend": "portable"}, id="portable")]


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path):
    s = NvmeStore(str(tmp_path), block_size=BLOCK, queue_depth=8, threads=2, **request.param)
    yield s
    s.close()


@pytest.fixture
def pool():
    p = HostPool([1 << 20] * 2, pin=False, name="lend")
    yield p
    p.close()


def break_next(store, op_code, stall=False):
    """The next request of ``op_code`` fails with EBADF in the backend (or never completes)."""
    b = store._backend
    real_submit, real_done, real_wait = b.submit, b.done, b.wait
    held = set()

    def submit(req):
        if req.op == op_code and not held and not getattr(b, "_broke", False):
            b._broke = True
            if stall:
                held.add(id(req))
            else:
                req.fd = -1
        return real_submit(req)
    b.submit = submit
    b.done = lambda req: False if id(req) in held else real_done(req)
    b.wait = lambda req, t: (time.sleep(min(t or 0.05, 0.2)), False)[1] if id(req) in held else real_wait(req, t)


def test_loan_round_trip_and_transitions(store, pool):
    tier = NvmeTier(store, pool, wait_timeout_s=5)
    n = 3 * 4096 + 123                        # a body and a tail page
    tier.reserve({"k": n})
    loan = tier.loan("k", n, "block 7 (x)")
    assert loan.state is LoanState.ON_TIER
    data = torch.randint(0, 256, (n,), dtype=torch.uint8)
    loan.fill().copy_(data)
    assert loan.state is LoanState.READY
    loan.commit()
    assert loan.state is LoanState.WRITING
    loan.release()
    assert loan.state is LoanState.ON_TIER and pool.stats()["in_use_bytes"] == 0
    assert loan.fetch() and loan.state is LoanState.READING
    assert torch.equal(loan.acquire(), data) and loan.state is LoanState.READY
    loan.release()                            # read only: no write
    assert loan.state is LoanState.ON_TIER and pool.stats()["in_use_bytes"] == 0
    with pytest.raises(LoanStateError, match="block 7"):
        loan.commit()                         # verbs are guarded by the state
    # poll settles without waiting
    assert loan.fetch()
    deadline = time.monotonic() + 10
    while not loan.poll():
        assert time.monotonic() < deadline
    assert loan.state is LoanState.READY
    loan.release()


def test_loan_is_dtype_and_size_agnostic(store, pool):
    tier = NvmeTier(store, pool)
    tier.reserve({"bf": 1000 * 2, "f32": 77 * 4})
    for key, t in (("bf", torch.randn(1000).to(torch.bfloat16)), ("f32", torch.randn(77))):
        loan = tier.loan(key, t.numel() * t.element_size())
        loan.fill().view(t.dtype).copy_(t)
        loan.commit()
        loan.release()
        assert torch.equal(loan.acquire().view(t.dtype), t)
        loan.release()


@pytest.mark.parametrize("kind", [HostTier, DeviceTier])
def test_resident_tiers_ignore_every_verb(kind, pool):
    tier = kind(pool) if kind is HostTier else kind(torch.device("cpu"))
    loan = tier.loan("k", 4096, "block 1")
    assert loan.state is LoanState.RESIDENT
    loan.acquire().fill_(3)
    assert loan.fetch() and loan.poll()
    loan.commit()
    loan.release()
    assert loan.state is LoanState.RESIDENT and int(loan.acquire()[0]) == 3


def test_failed_read_gives_the_buffer_back_and_names_everything(store, pool):
    from offload._native import IO_READ
    tier = NvmeTier(store, pool)
    tier.reserve({"k": 8192})
    loan = tier.loan("k", 8192, "optimizer state of block 4 (h.3)")
    loan.fill().fill_(1)
    loan.commit()
    loan.release()
    break_next(store, IO_READ)
    with pytest.raises(TierIOError) as exc:
        loan.acquire()
    e = exc.value
    assert e.errno == errno.EBADF and e.filename == store._keys["k"].file.path
    assert "read of optimizer state of block 4 (h.3) failed" in str(e)
    assert loan.state is LoanState.ON_TIER and pool.stats()["in_use_bytes"] == 0
    assert int(loan.acquire()[0]) == 1       # the data is still there: a read failure loses nothing
    loan.release()


def test_failed_write_gives_the_buffer_back_and_the_next_read_says_why(store, pool):
    from offload._native import IO_WRITE
    tier = NvmeTier(store, pool)
    tier.reserve({"k": 8192})
    loan = tier.loan("k", 8192, "parameters of block 2 (l.0)")
    break_next(store, IO_WRITE)
    loan.fill().fill_(1)
    loan.commit()
    with pytest.raises(TierIOError, match="write of parameters of block 2 .l.0. failed") as exc:
        loan.release()
    assert exc.value.errno == errno.EBADF
    assert loan.state is LoanState.ON_TIER and pool.stats()["in_use_bytes"] == 0
    with pytest.raises(TierIOError, match="holds no data: its last write failed") as exc:
        loan.acquire()
    assert exc.value.errno == errno.EBADF and exc.value.filename == store._keys["k"].file.path
    assert pool.stats()["in_use_bytes"] == 0


def test_kept_write_serves_the_bytes_and_fails_like_a_write(store, pool):
    """commit(keep=True): the write goes on while acquire() returns the bytes at once; once
    settled (finish_write / poll) they stay lent (READY) and are durable. unkeep() lets the
    buffer go once written. A failed write gives the buffer back and names the owner."""
    from offload._native import IO_WRITE
    tier = NvmeTier(store, pool)
    tier.reserve({"k": 8192})
    loan = tier.loan("k", 8192, "parameters of block 3 (l.1)")
    data = torch.randint(0, 256, (8192,), dtype=torch.uint8)
    loan.fill().copy_(data)
    loan.commit(keep=True)
    assert loan.state is LoanState.WRITING_KEPT and torch.equal(loan.acquire(), data)
    with pytest.raises(LoanStateError, match="write is in flight"):
        loan.fill()                           # nobody modifies bytes a write is reading
    loan.finish_write()
    assert loan.state is LoanState.READY and torch.equal(loan.acquire(), data)
    assert pool.stats()["in_use_bytes"] > 0
    loan.release()                            # READY: no second write
    assert loan.state is LoanState.ON_TIER and pool.stats()["in_use_bytes"] == 0
    assert torch.equal(loan.acquire(), data)  # read back from the tier: it was durable
    loan.acquire().fill_(7)
    loan.commit(keep=True)
    loan.unkeep()                             # WRITING: the buffer goes back once written
    assert loan.state is LoanState.WRITING
    deadline = time.monotonic() + 30
    while not loan.poll():
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert loan.state is LoanState.ON_TIER and pool.stats()["in_use_bytes"] == 0
    assert torch.equal(loan.acquire(), torch.full((8192,), 7, dtype=torch.uint8))
    loan.acquire().fill_(9)
    break_next(store, IO_WRITE)
    loan.commit(keep=True)                    # submitted; fails in the backend
    with pytest.raises(TierIOError, match="write of parameters of block 3 .l.1. failed") as exc:
        loan.finish_write()
    assert exc.value.errno == errno.EBADF
    assert loan.state is LoanState.ON_TIER and pool.stats()["in_use_bytes"] == 0


def test_waits_are_bounded(store, pool):
    from offload._native import IO_READ
    tier = NvmeTier(store, pool, wait_timeout_s=60.0)   # writing the keys may be slow on a busy machine
    tier.reserve({"a": 1 << 20, "b": 1 << 20, "c": 1 << 20})
    loans = [tier.loan(k, 1 << 20, f"block {i}") for i, k in enumerate("abc")]
    for ln in loans:
        ln.fill().zero_()
        ln.commit()
        ln.release()
    tier.wait_timeout_s = 0.5                        # the waits under test: nothing can complete them
    loans[0].acquire(), loans[1].acquire()          # both pool buffers on loan
    t0 = time.monotonic()
    with pytest.raises(TierTimeout, match="block 2: no host buffer free after 0.5 s"):
        loans[2].acquire()
    assert time.monotonic() - t0 < 5
    assert not loans[2].fetch()                     # fetch never waits: False, nothing started
    loans[0].release()
    loans[1].release()
    break_next(store, IO_READ, stall=True)          # a read that never completes
    t0 = time.monotonic()
    with pytest.raises(TierTimeout, match="read of block 2 not done after 0.5 s"):
        loans[2].acquire()
    assert time.monotonic() - t0 < 5
    assert loans[2].state is LoanState.ON_TIER      # its buffer stays with the stuck I/O, never lent again


# ---- the extent layout, shared by both backends ------------------------------------------------
@pytest.mark.parametrize("n", [1, 4095, 4096, 4097, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 12345])
def test_both_backends_store_the_layout_extents(tmp_path, n):
    """The native engine (C) and the portable backend (Python, from ExtentLayout) put the same
    bytes at the same file offsets and checksum the same extents: the ones ExtentLayout lists."""
    layout = ExtentLayout(BLOCK)
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    files, crcs = {}, {}
    for name in ("native", "portable"):
        s = NvmeStore(str(tmp_path), block_size=BLOCK, backend=name, name=name)
        try:
            s.reserve({"k": n})
            s.write("k", data).wait()
            k = s._keys["k"]
            body, tail = layout.split(n)
            count = layout.count(body, tail)
            crcs[name] = list((ctypes.c_uint32 * count).from_address(k.crcs))
            with open(k.file.path, "rb") as f:
                f.seek(k.offset)
                files[name] = f.read(layout.reserved(n))
            for x in layout.extents(body, tail):
                chunk = files[name][x.offset:x.offset + x.length]
                want = data[x.offset:x.offset + x.length].numpy().tobytes()
                if x.tail:
                    want = want + bytes(PAGE - len(want))
                assert chunk == want, (name, x)
                if name == "portable" and s.checksum_name == "crc32(zlib)":
                    assert crcs[name][x.index] == zlib.crc32(chunk)
        finally:
            s.close()
    assert files["native"] == files["portable"] and crcs["native"] == crcs["portable"]


def test_layout_geometry():
    L = ExtentLayout(BLOCK)
    assert L.split(BLOCK + 5) == (BLOCK, 5) and L.reserved(BLOCK + 5) == BLOCK + PAGE
    xs = list(L.extents(*L.split(2 * BLOCK + 4096 + 7)))
    assert [(x.offset, x.length, x.tail) for x in xs] == [(0, BLOCK, False), (BLOCK, BLOCK, False),
                                                          (2 * BLOCK, 4096, False), (2 * BLOCK + 4096, PAGE, True)]
    assert L.max_extents(2 * BLOCK + 4096 + 7) == 4
    with pytest.raises(ValueError, match="multiple of 4096"):
        ExtentLayout(1000)


def test_try_fill_and_lend_a_buffer_from_elsewhere(tmp_path):
    """try_fill() does not wait for the pool; lend() takes a buffer the caller supplies (an
    OwnedBuffer outside the pool) and the loan moves it like the pool's own."""
    from offload.storage.pool import OwnedBuffer
    from offload.storage.loan import LoanState
    from offload.storage.tier import NvmeTier
    store = NvmeStore(str(tmp_path), name="lend-other")
    pool = HostPool([8192], pin=False, name="one")
    tier = NvmeTier(store, pool, wait_timeout_s=5.0)
    tier.reserve({"a": 8192, "b": 8192})
    a, b = tier.loan("a", 8192), tier.loan("b", 8192)
    a.try_fill().fill_(7)
    assert b.try_fill() is None and b.state is LoanState.ON_TIER     # the only buffer is a's
    b.lend(OwnedBuffer(8192), read=False)
    b.acquire().fill_(9)
    for loan in (a, b):
        loan.commit()
        loan.release()
    b.lend(OwnedBuffer(8192), read=True)                              # read back into another owned one
    assert torch.equal(b.acquire(), torch.full((8192,), 9, dtype=torch.uint8))
    b.release()
    assert torch.equal(a.acquire(), torch.full((8192,), 7, dtype=torch.uint8))   # through the pool again
    a.release()
    assert pool.stats()["in_use_bytes"] == 0
    store.close()
    pool.close()


# ---- the extensions owners with changing keys use (saved activations) ---------------------------
class FreeList:
    """A free list of keys for loans bound at their write: reserves a key when none is free."""

    def __init__(self, tier):
        self.tier, self.free, self.given, self.made = tier, [], [], 0

    def take(self, nbytes):
        if self.free:
            return self.free.pop()
        self.made += 1
        key = f"f{self.made}"
        self.tier.reserve({key: nbytes})
        return key

    def give(self, key, nbytes):
        self.given.append(key)
        self.free.append(key)


class Gate:
    """An I/O handle that does not report done until ``open`` (a transfer still in flight)."""
    open = False

    def __init__(self, io):
        self.io = io

    def done(self):
        return Gate.open and self.io.done()

    def wait(self, timeout=None):
        if not Gate.open:
            time.sleep(min(timeout or 0.0, 0.2))
            raise TimeoutError("gated")
        self.io.wait(timeout)


def test_key_bound_at_write_and_back_to_the_free_list_at_retirement(store, pool):
    """key=None: reading before the first commit is an error (no buffer kept); the first
    commit takes a key from the free list and keeps it across releases; a retired loan's
    key goes back to the free list and the next loan's write reuses it."""
    tier = NvmeTier(store, pool, wait_timeout_s=5)
    keys = FreeList(tier)
    loan = tier.loan(None, 8192, "saved tensor 3", keys=keys)
    assert loan.state is LoanState.ON_TIER and loan.key is None
    with pytest.raises(LoanStateError, match="saved tensor 3: read before its first write"):
        loan.acquire()
    assert loan.state is LoanState.ON_TIER and pool.stats()["in_use_bytes"] == 0
    loan.fill().fill_(5)
    loan.commit()
    assert loan.key == "f1" and loan.state is LoanState.WRITING
    loan.release()
    assert int(loan.acquire()[0]) == 5 and loan.key == "f1"      # the key stays bound: read back
    loan.release()
    loan.retire()
    assert keys.given == []                                     # only settling gives it back
    tier.settle_retired()
    assert keys.given == ["f1"] and loan.key is None and pool.stats()["in_use_bytes"] == 0
    other = tier.loan(None, 8192, "saved tensor 4", keys=keys)
    other.fill().fill_(6)
    other.commit()
    other.release()
    assert other.key == "f1" and keys.made == 1                  # reused, nothing reserved
    no_list = tier.loan(None, 8192, "saved tensor 5")
    no_list.fill()
    with pytest.raises(LoanStateError, match="saved tensor 5: commit with no key nor free list"):
        no_list.commit()
    no_list.release()


def test_keep_decided_after_the_write_started(store, pool):
    """keep(): WRITING -> WRITING_KEPT, the bytes readable at once and READY once written
    (the buffer stays); a no-op when READY; an error when nothing is in memory."""
    tier = NvmeTier(store, pool, wait_timeout_s=5)
    tier.reserve({"k": 8192})
    loan = tier.loan("k", 8192, "saved tensor 1")
    with pytest.raises(LoanStateError, match="saved tensor 1: keep from LoanState.ON_TIER"):
        loan.keep()
    data = torch.randint(0, 256, (8192,), dtype=torch.uint8)
    loan.fill().copy_(data)
    loan.keep()
    assert loan.state is LoanState.READY                        # nothing written: stays READY
    loan.commit()
    loan.keep()
    assert loan.state is LoanState.WRITING_KEPT and torch.equal(loan.acquire(), data)
    loan.finish_write()
    assert loan.state is LoanState.READY and pool.stats()["in_use_bytes"] > 0
    loan.release()
    assert torch.equal(loan.acquire(), data)                    # it was durable
    loan.release()
    assert pool.stats()["in_use_bytes"] == 0


def test_caller_buffer_writes_and_reads_in_place(store, pool):
    """A CallerBuffer lends the caller's tensor: the write reads it in place, the read lands in
    it in place, and letting it go leaves the tensor alone (no pool buffer is used)."""
    from offload.storage.pool import CallerBuffer

    def aligned(n):
        raw = torch.zeros(n + PAGE, dtype=torch.uint8)
        return raw[(-raw.data_ptr()) % PAGE:][:n]
    tier = NvmeTier(store, pool, wait_timeout_s=5)
    tier.reserve({"k": 3 * PAGE})
    src, dst = aligned(3 * PAGE), aligned(3 * PAGE)
    src.copy_(torch.randint(0, 256, (3 * PAGE,), dtype=torch.uint8))
    loan = tier.loan("k", 3 * PAGE, "saved tensor 2")
    loan.lend(CallerBuffer(src), read=False)
    assert loan.acquire().data_ptr() == src.data_ptr() and pool.stats()["in_use_bytes"] == 0
    loan.commit()
    loan.release()
    assert loan.state is LoanState.ON_TIER and loan.buffer is None and src.numel() == 3 * PAGE
    loan.lend(CallerBuffer(dst), read=True)
    assert loan.state is LoanState.READING
    got = loan.acquire()
    assert got.data_ptr() == dst.data_ptr() and torch.equal(dst, src)
    loan.release()
    assert torch.equal(dst, src) and pool.stats()["in_use_bytes"] == 0
    with pytest.raises(InvariantError, match="a view of"):
        CallerBuffer(dst).view(torch.uint8, 3 * PAGE + 1)


def test_retire_never_waits_and_settles_once_the_io_is_done(store, pool, monkeypatch):
    """retire() only queues (it may run in a finalizer inside the pool's critical section);
    settle_retired() never waits: a loan whose write is in flight keeps its buffer and key
    until a later call finds the write done. The owner's own waits stay bounded."""
    tier = NvmeTier(store, pool, wait_timeout_s=0.5)
    keys = FreeList(tier)
    write = store.write
    monkeypatch.setattr(store, "write", lambda key, src: Gate(write(key, src)))
    monkeypatch.setattr(Gate, "open", False)
    loan = tier.loan(None, 8192, "saved tensor 7", keys=keys)
    loan.fill().fill_(7)
    loan.commit()
    t0 = time.monotonic()
    with pytest.raises(TierTimeout, match="write of saved tensor 7 not done after 0.5 s"):
        loan.finish_write()                                      # bounded
    assert time.monotonic() - t0 < 5
    stuck = pool.stats()["in_use_bytes"]                         # its buffer stays with the stuck write
    loan = tier.loan(None, 8192, "saved tensor 8", keys=keys)
    loan.fill().fill_(8)
    loan.commit()
    with pool._cond:                                             # a finalizer inside the pool's lock
        loan.retire()
    t0 = time.monotonic()
    tier.settle_retired()
    assert time.monotonic() - t0 < 0.5                           # never waits for the write
    assert loan.state is LoanState.WRITING and keys.given == [] and pool.stats()["in_use_bytes"] > stuck
    Gate.open = True
    deadline = time.monotonic() + 10
    while keys.given == []:
        assert time.monotonic() < deadline
        tier.settle_retired()
    assert keys.given == ["f2"] and loan.key is None and pool.stats()["in_use_bytes"] == stuck
