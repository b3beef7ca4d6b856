"""The closed lifecycle graph and reason codes (docs/lifecycle.md).

The edge graph is checked pair by pair against ``lifecycle.check_edge``; the
reason codes are checked on every transition row that real dispatches write
on a real SQLite file while being driven through every path.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from trio_dispatch import (
    InvalidTransition,
)
from trio_dispatch import lifecycle as lc

STATUSES = (
    "pending",
    "delivering",
    "delivered",
    "acked",
    "dead_letter",
    "expired",
    "superseded",  # coalescing
    "cancelled",  # cancel
)

# docs/lifecycle.md, transcribed: (from, to) -> who may take it.
# docs/lifecycle.md's graph, with who takes each edge: delivery edges are the
# scheduler's, acks the consumer's, revival of a failed row the operator's.
SPEC_EDGE_SOURCES = {
    ("pending", "delivering"): ("scheduler",),
    ("pending", "expired"): ("scheduler",),
    ("pending", "acked"): ("consumer",),
    ("pending", "superseded"): ("system", "scheduler"),  # coalescing: an enqueue, a schedule's
    ("pending", "cancelled"): ("operator",),  # cancel
    ("delivering", "delivering"): ("scheduler",),
    ("delivering", "pending"): ("scheduler",),
    ("delivering", "delivered"): ("scheduler",),
    ("delivering", "acked"): ("consumer",),
    ("delivering", "dead_letter"): ("scheduler",),
    ("delivering", "expired"): ("scheduler",),
    ("delivering", "cancelled"): ("scheduler", "operator"),  # cancel
    ("dead_letter", "pending"): ("operator",),
    ("expired", "pending"): ("operator",),
}
SPEC_EDGES = frozenset(SPEC_EDGE_SOURCES)

# docs/lifecycle.md, the reason-code table, transcribed.
SPEC_REASON_CODES = frozenset(
    {
        "dispatch.pending.enqueued",
        "dispatch.delivering.attempt",
        "dispatch.delivered.transport_ok",
        "dispatch.pending.awaiting_ack",
        "dispatch.pending.retry_backoff",
        "dispatch.pending.throttled",  # a throttle
        "dispatch.dead_letter.max_attempts",
        "dispatch.dead_letter.ack_timeout",
        "dispatch.dead_letter.gone",
        "dispatch.expired.deadline",
        "dispatch.acked.consumer",
        "dispatch.pending.operator_retry",
        "dispatch.pending.released",
        "dispatch.purged.operator",
        "dispatch.purged.retention",
        "dispatch.superseded.coalesced",  # coalescing
        "dispatch.cancelled.operator",  # cancel
    }
)


pytestmark = pytest.mark.anyio


# -- the edge graph -------------------------------------------------------------


async def test_reason_codes_equal_the_spec_table() -> None:
    assert lc.REASON_CODES == SPEC_REASON_CODES


async def test_status_set_and_edge_set_equal_the_spec() -> None:
    assert lc.STATUSES == frozenset(STATUSES)
    assert lc.EDGES == frozenset(SPEC_EDGES)


async def test_every_member_is_documented_and_the_sql_vocabulary_comes_from_the_enums() -> None:
    for enum_class in (lc.Status, lc.Reason, lc.Source):
        assert enum_class.__doc__
    source = Path(lc.__file__).read_text()
    for member in (*lc.Status, *lc.Reason, *lc.Source):  # a docstring under each member
        assert re.search(rf'= "{re.escape(member.value)}"\n\s+"""', source), member
    assert set(lc.DUE_STATUSES) | set(lc.FINISHED_STATUSES) == lc.STATUSES
    assert not set(lc.DUE_STATUSES) & set(lc.FINISHED_STATUSES)


@pytest.mark.parametrize(("from_status", "to_status"), list(itertools.product(STATUSES, STATUSES)))
@pytest.mark.parametrize("source", ["scheduler", "operator", "consumer", "system"])
async def test_check_edge_allows_exactly_the_spec_graph_for_each_source(
    from_status: str, to_status: str, source: str
) -> None:
    allowed = source in SPEC_EDGE_SOURCES.get((from_status, to_status), ())

    if allowed:
        lc.check_edge("d" * 32, from_status, to_status, source=source)
    else:
        with pytest.raises(InvalidTransition) as caught:
            lc.check_edge("d" * 32, from_status, to_status, source=source)
        assert caught.value.from_status == from_status
        assert caught.value.to_status == to_status
        assert isinstance(caught.value, ValueError)


async def test_delivery_and_schedules_are_two_names_of_the_one_stored_source() -> None:
    # docs/lifecycle.md gives both writers the value "scheduler"; the code
    # names each, and the stored column cannot tell them apart.
    assert lc.Source.DELIVERY.value == lc.Source.SCHEDULES.value == "scheduler"
    assert lc.Source["SCHEDULES"] is lc.Source["DELIVERY"]  # an alias, one member
    assert [str(source) for source in lc.Source] == ["system", "scheduler", "consumer", "operator"]
    lc.check_edge("d" * 32, "pending", "delivering", source=lc.Source.DELIVERY)


@pytest.mark.parametrize(
    ("from_status", "to_status"), [("dead_letter", "pending"), ("expired", "pending")]
)
async def test_operator_only_edges_raise_for_scheduler_but_not_operator(
    from_status: str, to_status: str
) -> None:
    with pytest.raises(InvalidTransition, match="operator"):
        lc.check_edge("d" * 32, from_status, to_status, source="scheduler")
    lc.check_edge("d" * 32, from_status, to_status, source="operator")


@pytest.mark.parametrize(
    ("from_status", "to_status"),
    [("purged", "pending"), ("pending", "purged"), ("bogus", "pending"), ("pending", "bogus")],
)
async def test_check_edge_rejects_statuses_outside_the_six(
    from_status: str, to_status: str
) -> None:
    with pytest.raises(InvalidTransition):
        lc.check_edge("d" * 32, from_status, to_status, source="operator")


# -- the reason walk -------------------------------------------------------------
