"""NvmeStore through every backend: round trips, concurrency, and each way the disk can fail.

The environments the failures need are made for real where this machine allows it (tests
run as root): a loop-mounted tiny ext4 for a full disk, a read-only bind mount (root ignores
permission bits), ramfs for a filesystem that refuses O_DIRECT (tmpfs accepts it since Linux
6.6), RLIMIT_FSIZE in a process of its own for write errors. Each has a fallback that still fails
for real (chattr +i, RLIMIT_FSIZE) or, last, a simulated refusal.
"""
import contextlib
import errno
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import _forked
import _nvme_worker
from offload.storage import (ChecksumError, DirectIOWarning, HostPool, NvmeIOError, NvmeSpaceError, NvmeStore,
                             StaleSwapDirWarning)
from offload.storage import nvme as nvme_mod

# Plain torch tensors are often not 4096-aligned; the store warns and uses the page cache.
pytestmark = pytest.mark.filterwarnings("ignore:a buffer at .* is not 4096-aligned")

BLOCK = 64 << 10  # small extents, so small tensors still span several
from _paths import ROOT as REPO  # noqa: E402

BACKENDS = [pytest.param({"backend": "native"}, id="native"),
            pytest.param({"backend": "native", "io_uring": False}, id="native-threads"),
            pytest.param({"backend": "portable"}, id="portable")]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture
def make_store(backend, tmp_path):
    stores = []

    def make(path=None, **kw):
        opts = {"block_size": BLOCK, "queue_depth": 8, "threads": 3, **backend, **kw}
        s = NvmeStore(str(path or tmp_path), **opts)
        stores.append(s)
        return s

    yield make
    for s in stores:
        s.close()


@pytest.fixture(scope="module")
def pool():
    p = HostPool([4 << 20] * 4 + [1 << 20] * 8, pin=False)
    yield p
    p.close()


def rand_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def run(*cmd) -> bool:
    try:
        return subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0
    except OSError:  # the tool is not installed
        return False


@contextlib.contextmanager
def mount(*args, target):
    """mount(args..., target); yields True when it worked, and unmounts afterwards."""
    os.makedirs(target, exist_ok=True)
    ok = run("mount", *args, str(target))
    try:
        yield ok
    finally:
        if ok:
            run("umount", "-l", str(target))


def run_py(code: str) -> dict:
    """Run code in a fresh interpreter; it prints one JSON object as its last line."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- round trips --------------------------------------------------------------------------------

SIZES = [1, 100, 4095, 4096, 4097, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 12345, (1 << 20) + 7]


def test_round_trip_odd_sizes(make_store, pool):
    store = make_store()
    store.reserve({f"k{n}": n for n in SIZES})
    for n in SIZES:
        src = rand_bytes(n, n)
        with pool.acquire(n) as a, pool.acquire(n) as b:
            s, d = a.view(torch.uint8, n), b.view(torch.uint8, n)
            s.copy_(src)
            d.fill_(0xAA)
            store.write(f"k{n}", s).wait()
            store.read(f"k{n}", d).wait()
            assert torch.equal(d, src), n
    st = store.stats()
    assert st["bytes_written"] >= sum(SIZES) and st["bytes_read"] >= sum(SIZES)
    assert st["files"] == 1 and st["keys"] == len(SIZES) and st["direct"]
    assert st["backend"] in ("native-io_uring", "native-threads", "portable")


def test_round_trip_dtypes_and_unaligned_buffers(make_store, pool):
    store = make_store()
    f32 = torch.randn(3 * BLOCK // 4 + 3, generator=torch.Generator().manual_seed(1))
    bf16 = torch.randn(5001, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    store.reserve({"f32": f32.nbytes, "bf16": bf16.nbytes})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unaligned buffers go through the page cache, with a warning
        for key, t in (("f32", f32), ("bf16", bf16)):
            src = torch.empty(t.numel() + 1, dtype=t.dtype)[1:]  # deliberately not 4096-aligned
            src.copy_(t)
            store.write(key, src).wait()
            with pool.acquire(t.nbytes) as b:
                dst = b.view(t.dtype, t.numel())
                store.read(key, dst).wait()
                assert torch.equal(dst, t)
            dst = torch.zeros(t.numel() + 3, dtype=t.dtype)[3:]
            store.read(key, dst).wait()
            assert torch.equal(dst, t)


def test_tail_never_touches_neighbouring_bytes(make_store, pool):
    """Keys packed back to back in one slot: reading one must not clobber the next."""
    store = make_store()
    n = 2 * BLOCK + 999  # a tail of 999 bytes + 3097 bytes of someone else's data after it
    store.reserve({"a": n})
    with pool.acquire(2 * n) as buf:
        a, after = buf.view(torch.uint8, n), buf.view(torch.uint8, 4096, offset_bytes=n)
        a.copy_(rand_bytes(n, 5))
        want = a.clone()
        store.write("a", a).wait()
        a.zero_()
        after.fill_(0x5A)
        store.read("a", a).wait()
        assert torch.equal(a, want)
        assert bool((after == 0x5A).all())


def test_many_concurrent_requests(make_store, pool):
    store = make_store()
    sizes = {f"b{i}.state": 1 + (i * 7919 + 4093) % (5 * BLOCK) for i in range(48)}
    store.reserve(sizes)
    data = {k: rand_bytes(n, i) for i, (k, n) in enumerate(sizes.items())}
    handles = [store.write(k, t) for k, t in data.items()]  # all in flight together
    for h in handles:
        h.wait()
    out = {k: torch.empty(n, dtype=torch.uint8) for k, n in sizes.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # plain torch buffers may be unaligned
        handles = [store.read(k, out[k]) for k in sizes]
        assert all(isinstance(h.done(), bool) for h in handles)
        for h in handles:
            h.wait()
    for k in sizes:
        assert torch.equal(out[k], data[k]), k
    assert all(h.done() for h in handles)


def test_threads_sharing_one_store(make_store):
    """Several threads write and read their own keys through one store at once."""
    import threading
    store = make_store()
    sizes = {f"t{t}.k{i}": 4096 * (i + 1) + 17 * t + 1 for t in range(4) for i in range(4)}
    store.reserve(sizes)
    errors = []

    def worker(t):
        try:
            for rnd in range(4):
                for i in range(4):
                    key = f"t{t}.k{i}"
                    src = rand_bytes(sizes[key], 1000 * t + 10 * rnd + i)
                    store.write(key, src).wait()
                    dst = torch.empty_like(src)
                    store.read(key, dst).wait()
                    assert torch.equal(dst, src), key
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not errors, errors


def test_reserve_more_than_once_and_key_checks(make_store):
    store = make_store()
    store.reserve({"a": 5000})
    store.reserve({"a": 4000, "b": 10})  # "a" already fits: left as is
    assert store.stats()["files"] == 2
    with pytest.raises(ValueError, match="cannot grow"):
        store.reserve({"a": 9000})
    with pytest.raises(KeyError, match="not reserved"):
        store.write("zzz", torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="8192 reserved"):
        store.write("a", torch.zeros(8193, dtype=torch.uint8))
    with pytest.raises(NvmeIOError, match="never written"):
        store.read("a", torch.zeros(5000, dtype=torch.uint8))
    store.write("b", torch.arange(10, dtype=torch.uint8)).wait()
    with pytest.raises(ValueError, match="10 were written"):
        store.read("b", torch.zeros(11, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous CPU"):
        store.write("b", torch.zeros(20, dtype=torch.uint8)[::2])


def test_one_io_per_key_at_a_time(make_store):
    store = make_store()
    store.reserve({"a": 3 * BLOCK})
    t = rand_bytes(3 * BLOCK, 3)
    h = store.write("a", t)
    real_done = store._backend.done
    store._backend.done = lambda req: False  # hold the write "in flight", deterministically
    try:
        with pytest.raises(RuntimeError, match="already has a write in flight"):
            store.read("a", torch.empty_like(t))
    finally:
        store._backend.done = real_done
    h.wait()
    out = torch.empty_like(t)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        store.read("a", out).wait()
    assert torch.equal(out, t)


def test_close_removes_files_and_refuses_io(make_store, tmp_path):
    store = make_store()
    store.reserve({"a": 10})
    h = store.write("a", torch.ones(10, dtype=torch.uint8))
    run_dir = store.run_dir
    assert os.path.isdir(run_dir)
    store.close()  # waits for the write first
    assert h.done() and not os.path.exists(run_dir) and os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError, match="closed"):
        store.write("a", torch.ones(10, dtype=torch.uint8))
    store.close()  # idempotent


# ---- corruption and I/O errors ------------------------------------------------------------------

def corrupt(store, key, offset_in_key, nbytes=3):
    k = store._keys[key]
    fd = os.open(k.file.path, os.O_RDWR)
    try:
        pos = k.offset + offset_in_key
        old = os.pread(fd, nbytes, pos)
        os.pwrite(fd, bytes(b ^ 0xFF for b in old), pos)
        os.fsync(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("where,extent", [(BLOCK + 100, 1), (3 * BLOCK + 5, 3), (3 * BLOCK + 4096 + 5, 4)])
def test_corrupted_extent_raises_checksum_error(make_store, pool, where, extent):
    store = make_store()
    n = 3 * BLOCK + 4096 + 77  # body extents 0-2 and 3 (one page), then the tail page: extent 4
    store.reserve({"b7.state": n})
    with pool.acquire(n) as buf:
        t = buf.view(torch.uint8, n)
        t.copy_(rand_bytes(n, 9))
        store.write("b7.state", t).wait()
        corrupt(store, "b7.state", where)
        with pytest.raises(ChecksumError, match=f"key 'b7.state': extent {extent} ") as exc:
            store.read("b7.state", t).wait()
        assert exc.value.errno == errno.EBADMSG and isinstance(exc.value, NvmeIOError)
        assert store._keys["b7.state"].file.path in str(exc.value)


def test_checksum_switch_off_reads_what_is_there(make_store, pool):
    store = make_store(checksum=False)
    n = 2 * BLOCK
    store.reserve({"a": n})
    with pool.acquire(n) as buf:
        t = buf.view(torch.uint8, n)
        t.copy_(rand_bytes(n, 4))
        want = t.clone()
        store.write("a", t).wait()
        corrupt(store, "a", 10)
        store.read("a", t).wait()  # no checksum, no error
        assert not torch.equal(t, want) and torch.equal(t[13:], want[13:])
    assert store.stats()["checksum"] == "off"


def test_short_read_raises(make_store, pool):
    store = make_store()
    n = 4 * BLOCK
    store.reserve({"a": n})
    with pool.acquire(n) as buf:
        t = buf.view(torch.uint8, n)
        store.write("a", t).wait()
        k = store._keys["a"]
        os.truncate(k.file.path, k.offset + 2 * BLOCK + 4096)  # extent 2 is cut short
        with pytest.raises(NvmeIOError, match=r"short read of key 'a': extent 2 .* moved 4096 of 65536 bytes"):
            store.read("a", t).wait()


@pytest.mark.parametrize("backend_args", [b.values[0] for b in BACKENDS], ids=[b.id for b in BACKENDS])
def test_write_error_surfaces_from_wait(tmp_path, backend_args):
    """RLIMIT_FSIZE makes writes past 1 MiB fail with EFBIG: the error reaches wait(), and the
    key then refuses to be read rather than returning whatever is on disk, naming the failed
    write's errno and file (not a bare "holds no data")."""
    res = _forked.call(_nvme_worker.write_past_file_size_limit, str(tmp_path), BLOCK, backend_args,
                       timeout_s=60, what="the write under a file-size limit")
    assert res["errno"] == errno.EFBIG, res
    assert "write of key 'big' failed" in res["msg"] and "File too large" in res["msg"]
    assert "key 'big' holds no data: its last write failed" in res["read"] and "File too large" in res["read"]
    assert res["read_errno"] == errno.EFBIG and res["read_file"] == res["file"] and res["file"] in res["msg"]


# ---- the path: missing, read-only, full, no O_DIRECT, stale ------------------------------------

def test_missing_path(backend, tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        NvmeStore(str(missing), **backend)
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        NvmeStore(str(tmp_path / "file"), **backend)


@pytest.fixture
def readonly_dir(tmp_path):
    """A directory that refuses writes even to root."""
    src, ro = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    with mount("--bind", str(src), target=ro) as ok:
        if ok and run("mount", "-o", "remount,ro,bind", str(ro)):
            yield str(ro)
            return
    if run("chattr", "+i", str(src)):  # immutable: even root cannot create entries in it
        try:
            yield str(src)
        finally:
            run("chattr", "-i", str(src))
        return
    yield "/proc"  # no new directories in /proc, whoever asks


def test_read_only_path(backend, readonly_dir):
    with pytest.raises(OSError) as exc:
        os.mkdir(os.path.join(readonly_dir, "probe"))  # the directory really is read-only
    with pytest.raises(PermissionError, match=f"nvme_path {readonly_dir} is not writable"):
        NvmeStore(readonly_dir, **backend)
    assert exc.value.errno in (errno.EROFS, errno.EPERM, errno.EACCES, errno.ENOENT)


@pytest.fixture
def tiny_fs(tmp_path):
    """A 16 MiB ext4 filesystem on a loop device, or None where mounting is not allowed."""
    img, mnt = tmp_path / "tiny.img", tmp_path / "tiny"
    with open(img, "wb") as f:
        f.truncate(16 << 20)
    if not run("mkfs.ext4", "-q", "-F", str(img)):
        yield None
        return
    with mount("-o", "loop", str(img), target=mnt) as ok:
        yield str(mnt) if ok else None


def test_full_disk_is_an_error_before_allocation(make_store, tiny_fs, monkeypatch, tmp_path):
    if tiny_fs is None:  # no loop mounts here: a filesystem that reports 8 MiB free
        real = nvme_mod.psutil.disk_usage
        monkeypatch.setattr(nvme_mod.psutil, "disk_usage", lambda p: real(p)._replace(free=8 << 20))
    store = make_store(tiny_fs or tmp_path)
    store.reserve({"small": 1 << 20})
    with pytest.raises(NvmeSpaceError) as exc:
        store.reserve({"b0.state": 40 << 20, "b1.state": 24 << 20})
    msg = str(exc.value)
    assert exc.value.errno == errno.ENOSPC
    assert f"nvme_path {store.path}" in msg and f"need {64 << 20} bytes" in msg and "free" in msg
    assert sorted(os.listdir(store.run_dir)) == ["owner.json", "swap-000.swap"]  # nothing allocated
    assert store.stats()["reserved_bytes"] == 1 << 20


def test_preallocation_failure_is_an_error(backend, tiny_fs, monkeypatch, tmp_path):
    """The free-space check passes but the filesystem cannot deliver: fallocate's error."""
    if tiny_fs is not None:
        real = nvme_mod.psutil.disk_usage
        monkeypatch.setattr(nvme_mod.psutil, "disk_usage", lambda p: real(p)._replace(total=1 << 40, free=1 << 40))
        store = NvmeStore(tiny_fs, **backend)
        try:
            with pytest.raises(NvmeSpaceError, match=r"cannot preallocate .*swap-000.swap.*No space left"):
                store.reserve({"a": 64 << 20})
            assert sorted(os.listdir(store.run_dir)) == ["owner.json"]
        finally:
            store.close()
        return
    res = run_py(f"""
        import json, resource, signal
        from offload.storage import NvmeStore, NvmeSpaceError
        s = NvmeStore({str(tmp_path)!r}, **{backend!r})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
        try:
            s.reserve({{"a": 8 << 20}})
        except NvmeSpaceError as e:
            print(json.dumps({{"msg": str(e)}}))
        s.close()
    """)
    assert "cannot preallocate" in res["msg"]


@pytest.fixture
def nodirect_dir(tmp_path, monkeypatch):
    """A directory whose filesystem refuses O_DIRECT: /dev/shm on kernels before 6.6, else a
    ramfs mount, else (no mounts allowed) a simulated refusal."""
    def refuses(d):
        try:
            fd = os.open(os.path.join(d, ".probe"), os.O_CREAT | os.O_RDWR | os.O_DIRECT)
            os.close(fd)
            return False
        except OSError as e:
            return e.errno == errno.EINVAL
        finally:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(d, ".probe"))

    if os.path.isdir("/dev/shm") and refuses("/dev/shm"):
        d = os.path.join("/dev/shm", f"offload-test-{os.getpid()}")
        os.makedirs(d, exist_ok=True)
        yield d
        os.rmdir(d)
        return
    with mount("-t", "ramfs", "ramfs", target=tmp_path / "ramfs") as ok:
        if ok and refuses(str(tmp_path / "ramfs")):
            yield str(tmp_path / "ramfs")
            return
    real_open = os.open

    def no_direct(path, flags, *a, **kw):
        if flags & os.O_DIRECT and str(path).startswith(str(tmp_path)):
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", no_direct)
    yield str(tmp_path)


def test_no_o_direct_falls_back_to_buffered_with_one_warning(make_store, nodirect_dir, pool):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = make_store(nodirect_dir)
        n = 2 * BLOCK + 1234
        store.reserve({"a": n, "b": 10})
        with pool.acquire(n) as buf:
            t = buf.view(torch.uint8, n)
            t.copy_(rand_bytes(n, 8))
            want = t.clone()
            store.write("a", t).wait()
            store.write("b", torch.arange(10, dtype=torch.uint8)).wait()
            t.zero_()
            store.read("a", t).wait()
            assert torch.equal(t, want)
    direct_warnings = [w for w in caught if issubclass(w.category, DirectIOWarning)]
    assert len(direct_warnings) == 1 and nodirect_dir in str(direct_warnings[0].message)
    assert len(caught) == 1  # and nothing else (no per-buffer alignment warnings)
    assert not store.stats()["direct"]


def test_stale_run_directory_is_reported_not_reused(backend, tmp_path):
    crashed = run_py(f"""
        import json, os, torch
        from offload.storage import NvmeStore
        s = NvmeStore({str(tmp_path)!r}, name="swap", **{backend!r})
        s.reserve({{"a": 1 << 20}})
        s.write("a", torch.ones(1 << 20, dtype=torch.uint8)).wait()
        print(json.dumps({{"run_dir": s.run_dir}}), flush=True)
        os._exit(0)  # a crash: no close(), no atexit
    """)["run_dir"]
    assert os.path.isdir(crashed)
    with pytest.warns(StaleSwapDirWarning, match=f"stale offload swap directory {crashed} .*rm -rf {crashed}"):
        store = NvmeStore(str(tmp_path), name="swap", **backend)
    try:
        assert store.run_dir != crashed
        assert os.path.isdir(crashed)  # reported, left alone, not reused
    finally:
        store.close()
    assert os.listdir(tmp_path) == [os.path.basename(crashed)]


def test_live_run_directories_are_not_reported(backend, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        a = NvmeStore(str(tmp_path), **backend)
        b = NvmeStore(str(tmp_path), **backend)
    a.close()
    b.close()


def test_swap_files_removed_at_interpreter_exit(backend, tmp_path):
    run_dir = run_py(f"""
        import json, torch
        from offload.storage import NvmeStore
        s = NvmeStore({str(tmp_path)!r}, **{backend!r})
        s.reserve({{"a": 1 << 20}})
        s.write("a", torch.ones(1 << 20, dtype=torch.uint8))  # still in flight, maybe
        print(json.dumps({{"run_dir": s.run_dir}}))
    """)["run_dir"]
    assert not os.path.exists(run_dir) and os.listdir(tmp_path) == []


def test_io_uring_choice_by_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_IO_URING", "off")
    with NvmeStore(str(tmp_path)) as s:
        assert s.backend == "native-threads"
    monkeypatch.setenv("OFFLOAD_IO_URING", "auto")
    with NvmeStore(str(tmp_path)) as s:
        assert s.backend in ("native-io_uring", "native-threads")  # threads where io_uring is refused
    monkeypatch.setenv("OFFLOAD_IO_URING", "maybe")
    with pytest.raises(ValueError, match="OFFLOAD_IO_URING"):
        NvmeStore(str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="multiple of 4096"):
        NvmeStore(str(tmp_path), block_size=1000)
    with pytest.raises(ValueError, match="backend"):
        NvmeStore(str(tmp_path), backend="spdk")
    with pytest.raises(ValueError, match="name"):
        NvmeStore(str(tmp_path), name="a/b")
    assert os.listdir(tmp_path) == []


def _policies() -> dict:
    """tid -> scheduling policy (field 41 of /proc/self/task/<tid>/stat) of this process's
    threads, the kernel's io_uring workers (``iou-*``, the kernel's own) left out."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith("iou-"):
                    continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                out[int(tid)] = int(f.read().rsplit(")", 1)[1].split()[38])
        except (FileNotFoundError, ProcessLookupError):
            pass                     # a thread that ended meanwhile
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.sched_getscheduler(0) != os.SCHED_OTHER,
                    reason="SCHED_BATCH is Linux's, applied only under the default policy")
def test_io_threads_do_not_preempt_on_wakeup(make_store, pool):
    """The I/O threads run under SCHED_BATCH (no wakeup preemption of the thread that submits,
    e.g. an optimizer job handing over its write-back), every one of them from the moment the
    store exists; the caller's policy is not touched."""
    with pool.acquire(3 * BLOCK) as a:
        a.view(torch.uint8, 3 * BLOCK).copy_(rand_bytes(3 * BLOCK, 1))   # torch's own threads start here
        before = set(_policies())
        s = make_store()
        started = {tid: pol for tid, pol in _policies().items() if tid not in before}
        s.reserve({"k": 3 * BLOCK})
        s.write("k", a.view(torch.uint8, 3 * BLOCK)).wait(timeout=30)
    new = {tid: pol for tid, pol in _policies().items() if tid not in before}
    assert len(started) == 3, started            # the fixture's threads=3, all started with the store
    assert set(started.values()) == {os.SCHED_BATCH}, started
    assert set(new.values()) == {os.SCHED_BATCH}, new
    assert os.sched_getscheduler(0) == os.SCHED_OTHER
