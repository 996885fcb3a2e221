"""Every host pool and NVMe store of one engine: made from its memory plan, counted and
released in one place.

``Resources`` is the single owner. A host pool is made by ``make_pool`` from the memory
plan's pool of that name (engine/memory_plan.py says what each holds); an NVMe store by
``make_store`` from the ``aio`` settings, one per role ("optimizer", "params",
"activations"); a store made elsewhere (the checkpoint read in place, storage/source.py)
joins with ``add_store``. Whoever builds a part asks for its pool or store here and keeps
the object it gets; ``stats`` and ``release`` then cover every one of them, so nothing is
counted twice or left open.
"""
from __future__ import annotations

from typing import Dict


class Resources:
    """The pools (by memory-plan name) and stores (by role) of one engine. ``plan``: the
    memory plan (``pool(name)`` gives a pool's slots, or None); ``aio``: the config's aio
    section; ``wait_timeout_s``: how long ``release`` waits for I/O still in flight."""

    def __init__(self, plan, aio, wait_timeout_s: float):
        self._plan = plan
        self._aio = aio
        self._wait_timeout_s = wait_timeout_s
        self.pools: Dict[str, object] = {}     # memory-plan name -> HostPool / HostArena
        self.stores: Dict[str, object] = {}    # role -> NvmeStore / SourceStore

    # ---- making -----------------------------------------------------------------------
    def make_pool(self, name: str, *, pin: bool, huge_pages: bool = False, arena: bool = False):
        """The memory plan's pool ``name``, allocated now: a ``HostPool`` of its slots, or
        with ``arena`` a ``HostArena`` of its bytes (variable-size loans). None when the plan
        has no such pool. ``huge_pages``: unpinned memory asks for transparent huge pages."""
        from offload.storage.pool import HostArena, HostPool
        if name in self.pools:
            raise ValueError(f"host pool {name!r} is made already")
        planned = self._plan.pool(name)
        if planned is None:
            return None
        if arena:
            pool = HostArena(planned.nbytes, pin=pin, name=planned.name, huge_pages=huge_pages)
        else:
            pool = HostPool(list(planned.slots), pin=pin, name=name, huge_pages=huge_pages)
        self.pools[name] = pool
        return pool

    def make_store(self, role: str, path: str):
        """An ``NvmeStore`` under ``path`` for ``role`` (its run directory's name), with the
        config's aio backend, block size, queue depth, threads and checksum."""
        from offload.storage.nvme import NvmeStore
        if role in self.stores:
            raise ValueError(f"store {role!r} is made already")
        a = self._aio
        store = NvmeStore(path, backend=a.backend, block_size=a.block_size, queue_depth=a.queue_depth,
                          threads=a.thread_count, checksum=a.checksum, name=role)
        self.stores[role] = store
        return store

    def add_store(self, role: str, store) -> None:
        """A store made elsewhere (``stats()`` with bytes_read / bytes_written and their
        seconds, ``close(timeout)``), counted and released with the others."""
        if role in self.stores:
            raise ValueError(f"store {role!r} is made already")
        self.stores[role] = store

    def pool(self, name: str):
        """The pool of that memory-plan name, or None."""
        return self.pools.get(name)

    def store(self, role: str):
        """The store of that role, or None."""
        return self.stores.get(role)

    # ---- counting -----------------------------------------------------------------------
    def stats(self) -> dict:
        """``host``: the pools' capacity; ``host_peak``: the sum of their peaks;
        ``host_pools``: capacity and peak per pool; ``nvme``: bytes reserved on the stores;
        ``links``: {"read"/"write": (bytes, seconds in flight)} over every store;
        ``source_bytes`` where a checkpoint is read in place."""
        pool_stats = {name: p.stats() for name, p in self.pools.items()}
        store_stats = {role: st.stats() for role, st in self.stores.items()}
        out = {"host": sum(s["capacity_bytes"] for s in pool_stats.values()),
               "host_peak": sum(s["peak_bytes"] for s in pool_stats.values()),
               "host_pools": {n: {k: s[k] for k in ("capacity_bytes", "peak_bytes")} for n, s in pool_stats.items()},
               "nvme": sum(s.get("reserved_bytes", 0) for s in store_stats.values()),
               "links": {d: (sum(s[f"bytes_{w}"] for s in store_stats.values()),
                             sum(s[f"{d}_seconds"] for s in store_stats.values()))
                         for d, w in (("read", "read"), ("write", "written"))}}
        if "source" in store_stats:
            out["source_bytes"] = store_stats["source"]["source_bytes"]
        return out

    # ---- releasing ----------------------------------------------------------------------
    def release(self) -> None:
        """Close every store (I/O stuck on a stalled disk is left behind after
        ``wait_timeout_s``, not waited for), then free every pool, unless a store could not
        close cleanly: a stuck request may still write into a pool buffer, so the pools are
        then kept alive for the process's life. Idempotent."""
        clean = True
        for store in self.stores.values():
            clean = store.close(timeout=self._wait_timeout_s) and clean
        pools = list(self.pools.values())
        if clean:
            for pool in pools:
                pool.close()
        else:
            from offload.storage import nvme
            nvme.keep_alive(pools)
        self.stores.clear()
        self.pools.clear()
