"""Enqueue (docs/usage.md): validate, build the envelope, commit row and transition.

Every dispatch, however it is enqueued -- :func:`enqueue_dispatch` and
:func:`enqueue_many` here, :mod:`trio_dispatch.sync` on a caller's own
connection, a schedule's fire (:mod:`trio_dispatch.schedules.runs`) -- is
made by one entry point, :meth:`EnqueueCall.new`: its arguments checked
(docs/usage.md), its body held to the store's ``max_body_bytes``, its ``create``
span started (docs/tracing.md) and its row -- id, ack token, the serialised
envelope -- built. For the API calls that happens before any transaction;
the write itself is :func:`~.inserts.insert_new` /
:func:`~.inserts.insert_plain`. Concurrent plain enqueues of a process
share one group commit and two bulk statements.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from types import TracebackType
from typing import Any, Final, TypedDict, Unpack

from .. import tracing
from ..lifecycle import ACTOR_ENQUEUE, Source
from ..priority import DEFAULT_PRIORITY, require_priority
from ..signal import dispatch_envelope_json, uuid7_bytes
from ..store.base import DEFAULT_MAX_BODY_BYTES, Database
from ..validate import (
    clock_from,
    require_body,
    require_bool,
    require_int,
    require_kind,
    require_non_empty,
    require_number,
    require_optional_id,
    require_route,
)
from ..values import show
from .coalesce import KEPT, CoalesceMode, grouped, require_coalesce
from .inserts import insert_all, insert_coalesced, insert_plain
from .machine import EnqueueResult, NewDispatch
from .ordering import require_ordering_key
from .transitions import EnqueuedId

DEFAULT_MAX_ATTEMPTS: Final = 8


class _RequiredArgs(TypedDict):
    kind: str
    """What happened, e.g. ``"order.shipped"`` (non-empty, one line)."""
    deliver_to: str
    """The route the transport delivers to (non-empty, one line)."""


class EnqueueArgs(_RequiredArgs, total=False):
    """The arguments of one enqueue, declared once: the keywords of
    :func:`enqueue_dispatch` (async and :mod:`trio_dispatch.sync`) and the
    keys of each :func:`enqueue_many` item. ``kind`` and ``deliver_to`` are
    required; the rest default as :data:`ENQUEUE_DEFAULTS` says."""

    body: dict[str, Any] | None
    """A JSON object, at most the store's ``max_body_bytes`` serialised."""
    dedup_key: str | None
    """At most one row per key, ever: a repeat returns the first row's id."""
    ack_required: bool
    """Whether the consumer must acknowledge with the row's token."""
    max_attempts: int
    """Attempts before the row is dead-lettered (at least 1)."""
    expires_at: float | None
    """Unix time after which the row is expired instead of delivered."""
    session_id: str | None
    """An existing ``sessions.id`` the row belongs to."""
    schedule_run_id: str | None
    """An existing ``schedule_runs.id`` the row was made by."""
    ordering_key: str | None
    """Rows sharing a key are delivered one at a time, in id order
    (docs/ordering.md): at most 255 characters, no control characters."""
    priority: int
    """-10 to 10 (default 0): among due rows, a row of priority ``p`` goes
    as if it had become due ``p * priority_step_seconds`` earlier
    (docs/controls.md); it is never sent before it is due."""
    coalesce_key: str | None
    """At most one row of this key waits unclaimed at any time
    (docs/controls.md; checked as ``ordering_key``): what a second enqueue
    of the key does is ``coalesce``."""
    coalesce: CoalesceMode | None
    """``"keep"`` (the default: the waiting row answers, nothing written),
    ``"replace"`` (the waiting row is superseded by the new one) or
    ``"debounce"`` (as replace, the new row due ``coalesce_seconds`` later);
    only with a ``coalesce_key``."""
    coalesce_seconds: float | None
    """``debounce`` only (and required there): how long after the enqueue
    the row falls due."""
    coalesce_max_wait_seconds: float | None
    """``debounce`` only: the latest the row falls due, counted from the
    creation of the first row it (transitively) replaced; at least
    ``coalesce_seconds``. None: no bound."""


ENQUEUE_KEYS: Final = EnqueueArgs.__required_keys__ | EnqueueArgs.__optional_keys__
"""The names :class:`EnqueueArgs` declares."""

ENQUEUE_DEFAULTS: Final[Mapping[str, object]] = {
    "body": None,
    "dedup_key": None,
    "ack_required": False,
    "max_attempts": DEFAULT_MAX_ATTEMPTS,
    "expires_at": None,
    "session_id": None,
    "schedule_run_id": None,
    "ordering_key": None,
    "priority": DEFAULT_PRIORITY,
    "coalesce_key": None,
    "coalesce": None,
    "coalesce_seconds": None,
    "coalesce_max_wait_seconds": None,
}


def prepare(
    args: Mapping[str, object],
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    metadata: Mapping[str, Any] | None = None,
    source: Source = Source.SYSTEM,
    actor: str = ACTOR_ENQUEUE,
    note: str = "{}",
) -> NewDispatch:
    """Validate one enqueue's arguments (an :class:`EnqueueArgs`) and build
    its row (id, token and serialised envelope, with ``metadata`` in the
    envelope's metadata; ``source``, ``actor`` and ``note`` for its first
    transition). An unknown or missing argument raises ``TypeError`` naming
    it. The step under :meth:`EnqueueCall.new`, which every enqueue goes
    through (it adds the ``create`` span)."""
    unknown = set(args) - ENQUEUE_KEYS
    if unknown:
        raise TypeError(f"unknown enqueue argument {show(sorted(map(str, unknown))[0])}")
    for required in ("kind", "deliver_to"):
        if required not in args:
            raise TypeError(f"missing required argument {required!r}")
    given = {**ENQUEUE_DEFAULTS, **args}
    kind_ = require_kind(given["kind"])
    route = require_route(given["deliver_to"])
    body_json = require_body(given["body"], max_body_bytes)
    dedup_key = given["dedup_key"]
    key = None if dedup_key is None else require_non_empty("dedup_key", dedup_key)
    ack = require_bool("ack_required", given["ack_required"])
    bound = require_int("max_attempts", given["max_attempts"], minimum=1)
    expires_at = given["expires_at"]
    expiry = None if expires_at is None else require_number("expires_at", expires_at)
    session = require_optional_id("session_id", given["session_id"])
    run = require_optional_id("schedule_run_id", given["schedule_run_id"])
    ordering_key = require_ordering_key(given["ordering_key"])
    priority = require_priority(given["priority"])
    coalesce = require_coalesce(
        given["coalesce_key"],
        given["coalesce"],
        given["coalesce_seconds"],
        given["coalesce_max_wait_seconds"],
    )
    dispatch_id = uuid7_bytes().hex()
    # The ack token is a secret: 128 bits of the OS CSPRNG, never time-ordered.
    token = secrets.token_hex(16) if ack else None
    return NewDispatch(
        id=dispatch_id,
        kind=kind_,
        deliver_to=route,
        payload=dispatch_envelope_json(
            dispatch_id=dispatch_id,
            kind=kind_,
            deliver_to=route,
            ack_token=token,
            body_json=body_json,
            metadata=metadata,
        ),
        dedup_key=key,
        max_attempts=bound,
        ack_required=ack,
        ack_token=token,
        session_id=session,
        schedule_run_id=run,
        expires_at=expiry,
        ordering_key=ordering_key,
        priority=priority,
        coalesce=coalesce,
        source=source,
        actor=actor,
        note=note,
    )


def body_limit(db: object) -> int:
    """The ``max_body_bytes`` of a store or transaction handle (the
    default for anything else: a caller's own connection)."""
    limit = getattr(db, "max_body_bytes", DEFAULT_MAX_BODY_BYTES)
    return limit if isinstance(limit, int) else DEFAULT_MAX_BODY_BYTES


class EnqueueCall:
    """One enqueue call, however it comes in, and the one place its
    dispatches are made (see the module's docstring).

    :meth:`new` checks one dispatch's arguments and builds its row, the body
    held to :attr:`max_body_bytes`; with tracing on it first starts the
    dispatch's ``create`` span, whose context the envelope carries ahead of
    any other metadata. Entered as a context manager, the call ends those
    spans when it ends -- with an error status if it raised -- and
    :meth:`written` names each span's message once the ids are known. Made
    with ``traced=False`` it starts none (a caller that cannot end them)."""

    __slots__ = ("max_body_bytes", "spans")

    def __init__(self, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, traced: bool = True) -> None:
        self.max_body_bytes = max_body_bytes
        """The most bytes of JSON a body may take (the store's limit)."""
        self.spans = tracing.creations() if traced and tracing.ACTIVE else None
        """The call's ``create`` spans; None when none is due."""

    @classmethod
    def on(cls, db: object) -> EnqueueCall:
        """A call on a store or transaction handle, held to its limit."""
        return cls(body_limit(db))

    def new(
        self,
        args: Mapping[str, object],
        metadata: Mapping[str, Any] | None = None,
        *,
        source: Source = Source.SYSTEM,
        actor: str = ACTOR_ENQUEUE,
        note: str = "{}",
    ) -> NewDispatch:
        """One dispatch of this call: ``args`` (an :class:`EnqueueArgs`)
        checked, its ``create`` span started, its row built with
        ``metadata`` in the envelope and ``source``, ``actor`` and ``note``
        for its first transition. A bad argument raises ``TypeError`` or
        ``ValueError`` naming it (its span, if any, ends with the call,
        marked failed)."""
        spans = self.spans
        if spans is not None:
            # The trace context first: it is read back from the envelope's head.
            context = spans.start(args.get("kind"))
            metadata = context if metadata is None else {**context, **metadata}
        return prepare(args, self.max_body_bytes, metadata, source, actor, note)

    def batch(self, items: Iterable[Mapping[str, Any]]) -> list[NewDispatch]:
        """:meth:`new` for each item of an :func:`enqueue_many` call, in
        order; an invalid item raises naming its index, before anything is
        written."""
        if isinstance(items, Mapping | str | bytes):
            raise TypeError(f"items must be an iterable of mappings, got {show(items)}")
        made: list[NewDispatch] = []
        for index, item in enumerate(items):
            if not isinstance(item, Mapping):
                raise TypeError(
                    f"item {index} must be a mapping of enqueue arguments, got {show(item)}"
                )
            try:
                made.append(self.new(item))
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"item {index}: {exc}") from None
        return made

    @property
    def started(self) -> int:
        """How many ``create`` spans the call has started so far."""
        return 0 if self.spans is None else len(self.spans.spans)

    def restart(self) -> None:
        """Forget every span started so far, never to end or export it: a
        unit of work that makes its dispatches inside the transaction (a
        schedule's fire) and is run again starts them anew."""
        if self.spans is not None:
            self.spans.restart()

    def forget(self, kept: int) -> None:
        """Forget the spans started after the first ``kept``: the part of a
        unit of work that made those dispatches was rolled back."""
        if self.spans is not None:
            self.spans.forget(kept)

    def written(self, ids: Sequence[str]) -> None:
        """Name each dispatch's span by the id the call returns for it, in
        the order they were made."""
        if self.spans is not None:
            self.spans.written(ids)

    def __enter__(self) -> EnqueueCall:
        return self

    def __exit__(
        self,
        typ: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.spans is not None:
            self.spans.__exit__(typ, exc, tb)


async def enqueue_dispatch(
    db: Database, *, now: float | None = None, **args: Unpack[EnqueueArgs]
) -> str:
    """Commit one dispatch and its ``dispatch.pending.enqueued`` transition;
    return its id: a ``str`` (an :class:`~.transitions.EnqueuedId`, whose
    ``outcome`` says ``inserted``, ``replaced`` or ``kept``; typed as
    ``str``, as it always was).

    With ``coalesce_key``, the key's row waiting unclaimed is kept (its id
    returned, nothing written) or superseded by the new row in the same
    transaction, as ``coalesce`` says (docs/controls.md); a dedup hit
    answers before coalescing does.

    With ``dedup_key``, a key already committed returns that row's id and
    writes nothing -- including when a concurrent writer commits the same key
    first. Raises ``TypeError``/``ValueError`` naming the bad argument (or an
    unknown ``session_id``/``schedule_run_id``) before anything is written;
    a database failure (locked past ``busy_timeout``, disk full, read-only)
    propagates as the driver's error, with nothing written.
    Passed a transaction handle, the row commits or rolls back with it.
    """
    with EnqueueCall.on(db) as call:
        result = await _commit_one(db, call.new(args), now)
        call.written([result.id])
        return EnqueuedId(result.id, result.outcome)


async def _commit_one(db: Database, new: NewDispatch, now: float | None) -> EnqueueResult:
    db.notify_enqueuing()
    if new.plain:
        # Coalesced with the other plain enqueues of the same group commit;
        # alone and unkeyed, it is one statement (PostgreSQL sends it alone).
        result: EnqueueResult = await db.write_many(
            insert_plain, (new, clock_from(now)()), single=new.ordering_key is None
        )
        db.notify_enqueued()
        return result
    if grouped(new):
        # With the other coalescing enqueues of the same group commit: a
        # few statements for them all; alone, one that replaces is one
        # statement (PostgreSQL sends it alone).
        assert new.coalesce is not None
        result = await db.write_many(
            insert_coalesced, (new, clock_from(now)()), single=new.coalesce.mode != "keep"
        )
        if result.outcome != KEPT:
            db.notify_enqueued()
        return result
    return (await commit_new(db, [new], clock_from(now)))[0]


async def commit_new(
    db: Database,
    batch: Sequence[NewDispatch],
    clock: Callable[[], float],
    name_items: bool = False,
) -> list[EnqueueResult]:
    """Write prepared dispatches in one transaction and wake this process's
    workers if any row is new."""
    db.notify_enqueuing()
    results = await db.write(partial(insert_all, batch=batch, now=clock(), name_items=name_items))
    if any(result.outcome != KEPT for result in results):
        db.notify_enqueued()
    return results


async def enqueue_many(
    db: Database, items: Iterable[Mapping[str, Any]], *, now: float | None = None
) -> list[EnqueueResult]:
    """Enqueue many dispatches in one transaction; each item holds the keyword
    arguments of :func:`enqueue_dispatch`. Returns one :class:`EnqueueResult`
    per item, in order. A repeated key within the batch resolves to the first
    item's row. Any invalid item raises (naming its index and argument) before
    anything is written; then no item is written.
    """
    clock = clock_from(now)
    with EnqueueCall.on(db) as call:
        batch = call.batch(items)
        results = await commit_new(db, batch, clock, name_items=True) if batch else []
        call.written([result.id for result in results])
        return results
