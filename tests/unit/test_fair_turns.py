"""The fair share's rotation across claims (:class:`Turns`): each row
claimed is a turn, destinations are ordered least recently served first
(claim order among equals), a destination served within the last round
asks for a look at every head -- unless the last look found it alone and
no news came since -- and the memory stays bounded. No database."""

from __future__ import annotations

from trio_dispatch.outbox.claim.fair import RELOOK_TURNS, REMEMBERED, Turns


def names(items: list[tuple[str, int]]) -> list[str]:
    return [name for name, _ in items]


def test_never_served_come_first_in_claim_order_then_least_recently_served() -> None:
    turns = Turns()
    heads = [("a", 1), ("b", 2), ("c", 3), ("d", 4)]
    assert names(turns.order(heads, lambda item: item[0])) == ["a", "b", "c", "d"]
    turns.served(["c", "a"])  # c's turn, then a's
    assert names(turns.order(heads, lambda item: item[0])) == ["b", "d", "c", "a"]


def test_a_destination_is_recent_within_the_last_round_of_turns() -> None:
    turns = Turns()
    assert not turns.recent(["a"])  # nothing served yet
    turns.served(["a"])
    assert turns.recent(["a"])  # the last turn, and the round is one
    turns.looked(3, ["a", "b", "c"])  # three destinations had due rows
    turns.served(["b", "c"])
    assert turns.recent(["a"])  # served 3 turns ago: within the round of 3
    turns.served(["b"])
    assert not turns.recent(["a"])  # 4 turns ago: its turn may come first
    assert turns.recent(["x", "b"])
    turns.looked(0, ["b", "c"])  # a round is at least one turn
    assert turns.recent(["b"]) and not turns.recent(["c"])


def test_the_memory_is_bounded_and_forgets_the_least_recently_served() -> None:
    turns = Turns()
    turns.served(f"d{i}" for i in range(REMEMBERED + 5))
    heads = [("d0", 0), (f"d{REMEMBERED + 4}", 1), ("d5", 2)]
    # d0 was forgotten: as never served, first; then d5, then the newest.
    assert names(turns.order(heads, lambda item: item[0])) == ["d0", "d5", f"d{REMEMBERED + 4}"]


def test_a_destination_found_alone_asks_no_look_until_news_or_a_while() -> None:
    turns = Turns()
    turns.served(["a"])
    turns.looked(1, ["a"])  # a alone has live rows
    turns.served(["a"])
    assert not turns.recent(["a"])  # served last turn, but nobody else was there
    assert turns.recent(["a", "b"])  # a first round with another: it looks
    turns.news()  # an enqueue: someone else may be there now
    assert turns.recent(["a"])
    turns.looked(1, ["a"])
    turns.served(["a"] * (RELOOK_TURNS - 1))
    assert not turns.recent(["a"])
    turns.served(["a"])  # news or not, a look that old is taken again
    assert turns.recent(["a"])
    turns.looked(1, ["a", "p"])  # p has live rows, none due (or left out): not alone
    assert turns.recent(["a"])
