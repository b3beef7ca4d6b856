"""The worker's delivery slots: at most ``capacity`` attempts at once, each
with the cancel scope that cuts it at its own lease end."""

from __future__ import annotations

from collections.abc import Iterator

import anyio

from ..outbox import Claim


class SlotTable:
    """Claimed attempts and their cancel scopes, never more than
    ``capacity``: a claim is only taken for a free slot, so no claimed row
    waits for a slot while its lease runs. A slot passes from a finished
    attempt to the next claim without ever being free (:meth:`hand_over`).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._scopes: dict[Claim, anyio.CancelScope] = {}
        self._cut_at: dict[Claim, float] = {}
        self._cancelled: set[Claim] = set()
        self._drained: anyio.Event | None = None

    def __len__(self) -> int:
        return len(self._scopes)

    def __iter__(self) -> Iterator[Claim]:
        return iter(list(self._scopes))

    @property
    def free(self) -> int:
        """Slots a scan may claim rows for."""
        return self.capacity - len(self._scopes)

    def take(self, claim: Claim, scope: anyio.CancelScope) -> None:
        """Give ``claim`` a slot (the caller claimed no more than :attr:`free`)."""
        if len(self._scopes) >= self.capacity:
            raise RuntimeError("no free delivery slot: claims exceeded the free slots")
        self._scopes[claim] = scope

    def scope(self, claim: Claim) -> anyio.CancelScope:
        return self._scopes[claim]

    def hand_over(self, finished: Claim, claim: Claim, scope: anyio.CancelScope) -> None:
        """The slot of ``finished`` passes to ``claim`` (never free between)."""
        del self._scopes[finished]
        self._cut_at.pop(finished, None)
        self._cancelled.discard(finished)
        self._scopes[claim] = scope

    def cut(self, claim: Claim) -> None:
        """Cut the attempt of ``claim`` now (shutdown), noting when."""
        self._cut_at.setdefault(claim, anyio.current_time())
        self._scopes[claim].cancel()

    def cut_by_cancel(self, claim: Claim) -> bool:
        """Cut the attempt of ``claim`` now because an operator cancelled it
        (docs/controls.md); False if it holds no slot any more."""
        if claim not in self._scopes:
            return False
        self._cancelled.add(claim)
        self.cut(claim)
        return True

    def cancelled(self, claim: Claim) -> bool:
        """Whether an operator's cancel cut ``claim``'s attempt."""
        return claim in self._cancelled

    def cut_at(self, claim: Claim) -> float | None:
        """When :meth:`cut` or :meth:`cancel_all` cut ``claim``'s attempt
        (event-loop time), or None: a cancellation its scope caught came
        from its own deadline."""
        return self._cut_at.get(claim)

    def release(self, claim: Claim) -> bool:
        """Free the slot of ``claim``; False if it held none."""
        self._cut_at.pop(claim, None)
        self._cancelled.discard(claim)
        if self._scopes.pop(claim, None) is None:
            return False
        if self._drained is not None and not self._scopes:
            self._drained.set()
        return True

    async def wait_drained(self, seconds: float) -> None:
        """Wait up to ``seconds`` for every slot to be free."""
        if not self._scopes:
            return
        self._drained = anyio.Event()
        try:
            with anyio.move_on_after(seconds):
                await self._drained.wait()
        finally:
            self._drained = None

    def cancel_all(self) -> None:
        """Cut every running attempt now (each releases its own row)."""
        for claim in list(self._scopes):
            self.cut(claim)
