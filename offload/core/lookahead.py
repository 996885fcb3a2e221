"""The one lookahead: an expected order of uses and a byte window ahead of the cursor.

Parameter prefetch, activation prefetch and the optimizer state's read-ahead all work the
same way: they know (or learn) the order in which items will be used, follow that order as
uses happen, and keep the items within some bytes ahead of the current position in flight.
``Lookahead`` is that order and that window; what "in flight" means (an NVMe read, a copy to
the device) stays with the owner of the items.

Two ways to know the order:

* recorded (``record(item)``): each use is recorded; the first pass (or one that left the
  order) is installed by ``rewind()`` as the order of the next pass. A use that does not
  match the order ahead *diverges*: nothing is upcoming until the next ``rewind()``, so a
  lookahead never brings what a changed path will not use. A pass that stopped early on
  the order (an evaluation forward) keeps it.
* given (``set_order(items)``): the order is known (the optimizer's blocks in forward order);
  ``advance(item)`` moves the cursor past an item, wherever it is ahead.

``window(size, limit)`` yields the items ahead of the cursor while their sizes add up to at
most ``limit`` bytes (``first=True``: the next item of non-zero size always, however large:
it is needed soonest; size 0 is an item the owner has nothing to bring for). ``cyclic``
passes (inference, where the next pass starts where this one began) see the order's head
after its tail; ``head=n`` passes see only its first n items after the tail (the part of
the next pass known to be worth bringing early). Telemetry counts hits, misses, divergences and
retraces under ``<name>_*`` when the owner reports them (``hit()`` / ``miss()``).

Not thread-safe: each owner calls it from one thread (or under its own lock).
"""
from __future__ import annotations

from typing import Callable, Hashable, Iterator, List, Optional, Sequence


class Lookahead:
    def __init__(self, name: str, telemetry=None):
        self.name = name
        self.telemetry = telemetry
        self.order: Optional[List[Hashable]] = None   # the expected order (None: not known yet)
        self._pos: dict = {}                          # item -> its first position in ``order``
        self._recording: List[Hashable] = []
        self.cursor = 0                               # items of ``order`` already used
        self.diverged = False

    # ---- the order -------------------------------------------------------------------------
    def set_order(self, order: Sequence[Hashable]) -> None:
        """A known order; the cursor starts at its head."""
        self._install(list(order))
        self._recording = []
        self.cursor = 0
        self.diverged = False

    def _install(self, order: List[Hashable]) -> None:
        self.order = order
        self._pos = {}
        for k, item in enumerate(order):
            self._pos.setdefault(item, k)

    def next_order(self) -> Optional[List[Hashable]]:
        """The order ``rewind()`` installs: what this pass recorded when there was no order
        yet or the pass left it, else the current order."""
        if self._recording and (self.order is None or self.diverged):
            return self._recording
        return self.order

    def rewind(self) -> None:
        """A new pass starts: install what was recorded (when it replaces the order), restart."""
        order = self.next_order()
        if order is not self.order:
            self._install(order)
            self._count("retraces")
        self._recording = []
        self.cursor = 0
        self.diverged = False

    def record(self, item: Hashable, again: bool = False) -> None:
        """``item`` is used now (a repeat of the last use is one use, unless ``again``: the
        owner knows it is a use of its own): follow the order or leave it."""
        if self._recording and self._recording[-1] == item and not again:
            return
        self._recording.append(item)
        if self.order is None or self.diverged:
            return
        if self.cursor < len(self.order) and self.order[self.cursor] == item:
            self.cursor += 1
        else:
            self.diverged = True
            self._count("divergences")

    @property
    def last(self) -> Optional[Hashable]:
        """The last use recorded in this pass (None: none yet)."""
        return self._recording[-1] if self._recording else None

    def advance(self, item: Hashable) -> None:
        """Move the cursor past ``item`` (a given order, used out of step: never backwards)."""
        k = self._pos.get(item)
        if k is not None and k + 1 > self.cursor:
            self.cursor = k + 1

    # ---- what is ahead ---------------------------------------------------------------------
    def upcoming(self, cyclic: bool = False, head: int = 0) -> List[Hashable]:
        """The items ahead of the cursor, in order (none once the pass diverged); ``head``:
        then the order's first ``head`` items (the next pass's start, where only that much
        of it is known to be worth bringing)."""
        if self.order is None or self.diverged:
            return []
        ahead = self.order[self.cursor:]
        if cyclic:
            return ahead + self.order[:self.cursor]
        return ahead + self.order[:head] if head else ahead

    def window(self, size: Callable[[Hashable], int], limit: int, *, first: bool = False,
               cyclic: bool = False, head: int = 0) -> Iterator[Hashable]:
        """The distinct items ahead whose sizes, added in order, stay within ``limit`` bytes
        (``first``: the next one of non-zero size in any case; an item of size 0 is one the
        owner will not bring, and costs nothing)."""
        seen, total = set(), 0
        for item in self.upcoming(cyclic, head):
            if item in seen:
                continue
            seen.add(item)
            n = size(item)
            total += n
            if total > limit and not (first and total == n):
                return
            yield item

    def used_within(self, item: Hashable, size: Callable[[Hashable], int], limit: int,
                    cyclic: bool = False, head: int = 0) -> bool:
        """Whether ``item`` is used again within the next ``limit`` bytes of the order."""
        total = 0
        for other in self.upcoming(cyclic, head):
            if other == item:
                return True
            total += size(other)
            if total > limit:
                return False
        return False

    # ---- counts ----------------------------------------------------------------------------
    def hit(self) -> None:
        self._count("hits")

    def miss(self) -> None:
        self._count("misses")

    def _count(self, what: str) -> None:
        if self.telemetry is not None:
            self.telemetry.count(f"{self.name}_{what}")
