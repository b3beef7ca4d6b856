"""The outbox: enqueue, deliver, read and operate on dispatches.

One concern per module:

- :mod:`.machine` -- the state machine, the one place that writes a status
  (each compare-and-set with its transition row, its edge checked first);
- :mod:`.sql` -- the statements, built from the lifecycle vocabulary;
- :mod:`.claim` -- what a claim may take: the claim order, named once, and
  the rules that narrow a claim (ordering keys, per-destination caps,
  destination admission), composed through one interface; the due scan,
  shared fairly between destinations, bounded whatever a left-out
  destination holds;
- :mod:`.enqueue` -- the enqueue API (docs/usage.md) and
  :class:`~.enqueue.EnqueueCall`, the one entry point that makes every
  dispatch (checks, body limit, ``create`` span), whoever enqueues it: the
  API, :mod:`trio_dispatch.sync`, a schedule's fire;
- :mod:`.delivery` -- the claim and the attempt's end (docs/guarantees.md), each
  one transaction (the transport call between them is the worker's:
  :mod:`trio_dispatch.worker.attempts`);
- :mod:`.expiry` -- the expiry sweep: rows past their deadline that no
  claim reads (held back by their destination or their key) expire at it,
  a batch a transaction;
- :mod:`.reads` -- get, list, history, stats;
- :mod:`.operator` -- ack, retry, purge, prune;
- :mod:`.cancel` -- cancel one dispatch, waiting or running (docs/controls.md);
- :mod:`.bulk` -- retry, purge or cancel every row a filter matches (the
  dashboard's bulk actions, replay, bulk cancel).

No transaction here spans the transport or any other await on the outside
world.
"""

from __future__ import annotations

from .bulk import CancelManyResult, RetryResult, cancel_dispatches, retry_dispatches
from .cancel import CancelResult, cancel_dispatch
from .delivery import (
    claim_due,
    finish_and_claim_next,
    finish_attempt,
    release_attempt,
    require_store,
    tally,
)
from .enqueue import DEFAULT_MAX_ATTEMPTS, enqueue_dispatch, enqueue_many
from .machine import COUNTER_KEYS, Claim, EnqueueResult, Outcome
from .operator import (
    DEFAULT_RETENTION_SECONDS,
    PRUNE_CHUNK,
    ack_dispatch,
    prune_dispatches,
    purge_dispatch,
    retry_dispatch,
)
from .reads import (
    DEFAULT_LIST_LIMIT,
    dispatch_stats,
    get_dispatch,
    list_dispatches,
    list_transitions,
    next_due_at,
)
from .transitions import EnqueuedId

__all__ = [
    "COUNTER_KEYS",
    "DEFAULT_LIST_LIMIT",
    "DEFAULT_MAX_ATTEMPTS",
    "DEFAULT_RETENTION_SECONDS",
    "PRUNE_CHUNK",
    "CancelManyResult",
    "CancelResult",
    "Claim",
    "EnqueueResult",
    "EnqueuedId",
    "Outcome",
    "RetryResult",
    "ack_dispatch",
    "cancel_dispatch",
    "cancel_dispatches",
    "claim_due",
    "dispatch_stats",
    "enqueue_dispatch",
    "enqueue_many",
    "finish_and_claim_next",
    "finish_attempt",
    "get_dispatch",
    "list_dispatches",
    "list_transitions",
    "next_due_at",
    "prune_dispatches",
    "purge_dispatch",
    "release_attempt",
    "require_store",
    "retry_dispatch",
    "retry_dispatches",
    "tally",
]
