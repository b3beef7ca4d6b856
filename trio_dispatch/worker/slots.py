"""The worker's delivery slots: at most ``capacity`` attempts at once, each
with the cancel scope that cuts it at its own lease end, and the rows
claimed ahead of a free slot (:mod:`.finisher`), each with its scope too,
so that an operator's cancel or a shutdown reaches them before they start."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import anyio

from ..outbox import Claim


class SlotTable:
    """Claimed attempts and their cancel scopes: never more than
    ``capacity`` running, and the claims held ahead of a slot (at most
    ``ahead`` of them) in claim order. A slot passes from a finished
    attempt to the next claim held ahead without ever being free
    (:meth:`start_ahead`).
    """

    def __init__(self, capacity: int, ahead: int = 0) -> None:
        self.capacity = capacity
        self.ahead_capacity = ahead
        self._scopes: dict[Claim, anyio.CancelScope] = {}
        self._fresh: dict[str, deque[Claim]] = {}
        """Held rows of destinations no slot has started since they had
        none held, by destination in the order first held."""
        self._rotation: dict[str, deque[Claim]] = {}
        """Held rows of the others, by destination, the least recently
        started first."""
        self._waiting = 0
        self._cut_at: dict[Claim, float] = {}
        self._cancelled: set[Claim] = set()
        self._drained: anyio.Event | None = None

    def __len__(self) -> int:
        """Attempts running (the claims held ahead not counted)."""
        return len(self._scopes) - self._waiting

    def __iter__(self) -> Iterator[Claim]:
        """Every claim held: running, and held ahead."""
        return iter(list(self._scopes))

    @property
    def free(self) -> int:
        """Slots with no attempt running."""
        return self.capacity - len(self)

    @property
    def room(self) -> int:
        """Claims a scan or a finish may take now: the free slots, and the
        room ahead of them, less the claims already held ahead."""
        return self.capacity + self.ahead_capacity - len(self._scopes)

    @property
    def waiting(self) -> int:
        """Claims held ahead, not yet started."""
        return self._waiting

    def hold(self, claim: Claim, scope: anyio.CancelScope) -> None:
        """Hold ``claim`` ahead of a slot (the caller claimed no more than
        :attr:`room`); a cancel or a shutdown cuts its scope before it starts."""
        if len(self._scopes) >= self.capacity + self.ahead_capacity:
            raise RuntimeError("no room ahead: claims exceeded the room")
        self._scopes[claim] = scope
        name = claim.deliver_to
        held = self._fresh.get(name)
        if held is None:
            held = self._rotation.get(name)
        if held is None:
            self._fresh[name] = deque([claim])
        else:
            held.append(claim)
        self._waiting += 1

    def start_ahead(self) -> Claim | None:
        """The next claim held ahead, now running in a slot (the caller's
        attempt has left it), or None. Destinations take turns, as within
        a claim (its fair share): a destination none of whose rows a slot
        has started since it had none held goes first (rows of one claimed
        after an enqueue notice do not wait behind every row held before),
        then the one a slot started longest ago; each one's rows in claim
        order."""
        if not self._waiting or len(self) >= self.capacity:
            return None
        group = self._fresh if self._fresh else self._rotation
        name = next(iter(group))
        held = group.pop(name)
        claim = held.popleft()
        if held:
            self._rotation[name] = held  # its turn comes again after the others'
        self._waiting -= 1
        return claim

    def drop_ahead(self) -> list[Claim]:
        """Every claim held ahead, no longer held (to give back unsent)."""
        dropped = [
            claim
            for group in (self._fresh, self._rotation)
            for held in group.values()
            for claim in held
        ]
        self._fresh.clear()
        self._rotation.clear()
        self._waiting = 0
        for claim in dropped:
            self.release(claim)
        return dropped

    def scope(self, claim: Claim) -> anyio.CancelScope:
        return self._scopes[claim]

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
        if self._drained is not None and not len(self):
            self._drained.set()
        return True

    async def wait_drained(self, seconds: float) -> None:
        """Wait up to ``seconds`` for every slot to be free."""
        if not len(self):
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
