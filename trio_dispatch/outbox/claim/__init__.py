"""The claim's one room: what a claim may take, and in what order.

- :mod:`.order` -- the claim order, named once (:data:`CLAIM_ORDER`), and
  the indexes that serve it;
- :mod:`.rules` -- the interface every rule that narrows a claim
  implements (:class:`ClaimRule`), and their composition
  (:class:`ClaimRules`);
- a module per rule: :mod:`.keys` (ordering keys, docs/ordering.md), :mod:`.caps`
  (a worker's per-destination caps, docs/webhooks.md), :mod:`.destinations` (each
  destination's state and shared limits, docs/destinations.md; its rate is
  :mod:`.gcra`);
- :mod:`.fair` -- fair share: how a claim shares itself round-robin
  between destinations, and how consecutive claims take turns
  (:class:`~.fair.Turns`) (docs/destinations.md);
- :mod:`.statements` -- the claim's reads, built from the order and the
  rules' term; :mod:`.scan` -- which due rows a claim reads, bounded
  whatever a left-out destination holds.

The claim itself -- the fenced move to ``delivering`` with its history --
is the state machine's (:func:`~trio_dispatch.outbox.machine.claim_batch`);
it asks the rules :func:`claim_rules` lists. A new rule is its module and
one line there.
"""

from __future__ import annotations

from collections.abc import Mapping

from ...destinations.policy import Destination
from ..ordering import DEFAULT_ORDERING_POLICY, OrderingPolicy
from .caps import DestinationCaps
from .destinations import DestinationAdmission
from .fair import Turns
from .keys import OrderingKeys
from .order import CLAIM_ORDER, ClaimOrder
from .pins import Pins
from .rules import NO_BOUNDS, NO_RULES, Bounds, ClaimRule, ClaimRules


def claim_rules(
    *,
    ordering: OrderingPolicy = DEFAULT_ORDERING_POLICY,
    caps: DestinationCaps | None = None,
    destinations: Mapping[str, Destination] | None = None,
    pins: Pins | None = None,
) -> ClaimRules:
    """The rules of a claim, in the order they apply: the ordering keys'
    rule under ``ordering`` (every claim has it), given, a worker's
    per-destination ``caps``, and the destinations' admission under the
    ``destinations`` policies (every claim has it: a paused destination is
    paused for every claimant); with a fresh fair-share rotation
    (:class:`~.fair.Turns`), so that the claims made with these rules take
    turns between destinations. ``pins``: the claimant holds rows ahead
    of its slots, its rated rows admitted as held starts (:mod:`.pins`)."""
    return ClaimRules(
        (
            OrderingKeys(ordering),
            caps,
            DestinationAdmission(destinations, pins),
        ),
        Turns(),
    )


__all__ = [
    "CLAIM_ORDER",
    "NO_BOUNDS",
    "NO_RULES",
    "Bounds",
    "ClaimOrder",
    "ClaimRule",
    "ClaimRules",
    "DestinationAdmission",
    "DestinationCaps",
    "OrderingKeys",
    "Pins",
    "Turns",
    "claim_rules",
]
