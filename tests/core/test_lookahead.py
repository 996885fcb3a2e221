"""core/lookahead.py: the order every prefetch follows and the byte window ahead of it."""
from offload.core.lookahead import Lookahead
from offload.core.telemetry import Telemetry

SIZES = {0: 10, 1: 20, 2: 30, 3: 40}


def size(i):
    return SIZES[i]


def test_first_pass_is_recorded_and_installed_then_followed():
    t = Telemetry()
    la = Lookahead("prefetch", t)
    for i in (0, 1, 1, 2, 3):                # a repeated use is one use
        la.record(i)
    assert la.upcoming() == []               # nothing known during the first pass
    la.rewind()
    assert la.order == [0, 1, 2, 3] and t.counters["prefetch_retraces"] == 1
    la.record(0)
    assert la.upcoming() == [1, 2, 3]
    assert list(la.window(size, 50)) == [1, 2]          # 20 + 30 = 50 fits, + 40 does not
    assert list(la.window(size, 5)) == []
    assert list(la.window(size, 5, first=True)) == [1]  # the next one however large
    assert la.upcoming(cyclic=True) == [1, 2, 3, 0]
    assert la.used_within(3, size, 50) and not la.used_within(3, size, 49)


def test_a_changed_path_diverges_and_replaces_the_order_at_rewind():
    t = Telemetry()
    la = Lookahead("prefetch", t)
    la.set_order([0, 1, 2])
    la.record(0)
    la.record(2)                             # skipped 1: another path
    assert la.diverged and la.upcoming() == [] and t.counters["prefetch_divergences"] == 1
    la.record(1)
    la.rewind()
    assert la.order == [0, 2, 1] and la.cursor == 0 and not la.diverged


def test_a_pass_that_stops_early_keeps_the_order():
    la = Lookahead("x")
    la.set_order([0, 1, 2, 3])
    la.record(0)
    la.record(1)
    la.rewind()
    assert la.order == [0, 1, 2, 3]


def test_advance_moves_past_an_item_never_back():
    la = Lookahead("x")
    la.set_order(["a", "b", "c", "d"])
    la.advance("c")
    assert la.upcoming() == ["d"]
    la.advance("a")
    assert la.upcoming() == ["d"]
    la.advance("zz")                        # not in the order: no move
    assert la.cursor == 3


def test_a_use_again_is_recorded_even_where_it_repeats_the_last():
    la = Lookahead("x")
    for i, again in ((0, False), (1, False), (1, True), (2, False)):
        la.record(i, again=again)
    la.rewind()
    assert la.order == [0, 1, 1, 2]


def test_head_sees_the_orders_first_items_after_the_tail():
    la = Lookahead("x")
    la.set_order([0, 1, 2, 3])
    la.record(0)
    la.record(1)
    la.record(2)
    assert la.upcoming(head=2) == [3, 0, 1]
    assert list(la.window(size, 50, head=2)) == [3, 0]     # 40 + 10 = 50 fits, + 20 does not
    assert not la.used_within(0, size, 39, head=1) and la.used_within(0, size, 40, head=1)


def test_first_is_the_next_item_the_owner_brings():
    sizes = {0: 0, 1: 100, 2: 10}                          # size 0: an item its owner skips
    la = Lookahead("x")
    la.set_order([0, 1, 2])
    assert list(la.window(sizes.get, 50, first=True)) == [0, 1]
    assert list(la.window(sizes.get, 50)) == [0]
