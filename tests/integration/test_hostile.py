"""Hostile input (docs/usage.md, docs/guarantees.md, docs/configuration.md):
enqueue arguments of every type and size,
transport templates, payloads and routes full of shell syntax, NUL, invalid
UTF-8, 1 MiB bodies, and malformed or malicious YAML.

Only the documented exceptions escape (``TypeError``/``ValueError`` from
enqueue, ``ConfigError`` from the config loader), nothing partial is ever
written, and no input is ever interpreted by a shell or a YAML constructor:
canary files that such an interpretation would create never appear.

The property tests run synchronously under hypothesis. Writes go to one real
store per test, opened once inside an anyio blocking portal (trio or asyncio,
by parameter) and driven one call per example, so the database accumulates
across examples and each example is judged by what it added.
"""

from __future__ import annotations

import functools
import json
import math
import re
import sqlite3
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio.from_thread
import pytest
import yaml
from anyio.from_thread import BlockingPortal
from hypothesis import event, given
from hypothesis import strategies as st

from trio_dispatch import deliver_due_dispatches, enqueue_dispatch, enqueue_many, open_store
from trio_dispatch.config import (
    DEFAULT_CONFIG_NAME,
    Config,
    ConfigError,
    load_config,
    parse_config,
    resolve_notify_template,
)
from trio_dispatch.store import Store
from trio_dispatch.transports import (
    NOT_CONFIGURED_ERROR,
    CommandTransport,
    Delivery,
    TransportResult,
    render_argv,
)

from ..conftest import RawDB

T = TypeVar("T")

BACKENDS = ("trio", "asyncio")
HEX32 = re.compile(r"[0-9a-f]{32}")
MIB = 1024 * 1024

KNOWN_SESSION = "session-known"
KNOWN_RUN = "run-known"
ENQUEUE_ARGS = (
    "kind",
    "deliver_to",
    "body",
    "dedup_key",
    "ack_required",
    "max_attempts",
    "expires_at",
    "session_id",
    "schedule_run_id",
    "now",
)
KEY_POOL = ("key-a", "key-b", "key-c", "key; rm -rf ~", "$(touch key)")

# Records what the transport child received: argv after the results path,
# stdin, and the route/kind environment, all as raw bytes (hex).
RECORDER = (
    "import json, os, sys\n"
    "data = sys.stdin.buffer.read()\n"
    "env = os.environb\n"
    "record = {\n"
    "    'argv': [os.fsencode(a).hex() for a in sys.argv[2:]],\n"
    "    'stdin': data.hex(),\n"
    "    'route': env.get(b'TRIO_DISPATCH_DELIVER_TO', b'').hex(),\n"
    "    'kind': env.get(b'TRIO_DISPATCH_KIND', b'').hex(),\n"
    "}\n"
    "with open(sys.argv[1], 'w') as out:\n"
    "    json.dump(record, out)\n"
)


# --- a synchronous bridge to one open store -----------------------------------


@dataclass(repr=False)
class Bridge:
    """One open store, driven from the (synchronous) test thread through a
    blocking portal, plus a separate sqlite3 connection that reads what is
    committed."""

    portal: BlockingPortal
    db: Store
    path: Path
    reader: sqlite3.Connection
    keys: dict[str, str] = field(default_factory=dict)
    """Every dedup key committed so far, and the id of the row holding it."""

    def __repr__(self) -> str:
        return f"Bridge({self.path.name}, {len(self.keys)} dedup keys)"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))

    def call(self, fn: Callable[..., Any], /, **kwargs: Any) -> Any:
        return self.portal.call(functools.partial(fn, self.db, **kwargs))

    def counts(self) -> tuple[int, int]:
        """(dispatch rows, transition rows) as committed."""
        found = self.reader.execute(
            "SELECT (SELECT COUNT(*) FROM dispatch_outbox), "
            "(SELECT COUNT(*) FROM status_transitions)"
        ).fetchone()
        return int(found[0]), int(found[1])

    def row(self, dispatch_id: str) -> dict[str, Any]:
        found = self.reader.execute(
            "SELECT * FROM dispatch_outbox WHERE id = ?", (dispatch_id,)
        ).fetchone()
        assert found is not None, f"no row {dispatch_id}"
        return dict(found)


@pytest.fixture(params=BACKENDS)
def portal(request: pytest.FixtureRequest) -> Iterator[BlockingPortal]:
    """An event loop of the parametrized backend, running in its own thread."""
    with anyio.from_thread.start_blocking_portal(str(request.param)) as running:
        yield running


@pytest.fixture
def bridge(portal: BlockingPortal, tmp_path: Path) -> Iterator[Bridge]:
    """One store for the whole test (every example of a property), with a
    known session and schedule run to link to."""
    path = tmp_path / "outbox.db"
    # Durability does not matter here; skipping fsync keeps 1,000 commits fast.
    with portal.wrap_async_context_manager(open_store(path, durability="normal")) as db:
        raw = RawDB(path)
        raw.execute("INSERT INTO sessions (id, created_at) VALUES (?, 0)", (KNOWN_SESSION,))
        raw.execute("INSERT INTO schedule_runs (id, created_at) VALUES (?, 0)", (KNOWN_RUN,))
        reader = sqlite3.connect(path, isolation_level=None)
        reader.row_factory = sqlite3.Row
        try:
            yield Bridge(portal=portal, db=db, path=path, reader=reader)
        finally:
            reader.close()


def outcome(fn: Callable[[], T]) -> T | BaseException:
    """The value ``fn`` returns or the exception it raises (only TypeError
    and ValueError are caught: anything else fails the test at once)."""
    try:
        return fn()
    except (TypeError, ValueError) as exc:
        return exc


def names_an_argument(message: str, names: tuple[str, ...] = ENQUEUE_ARGS) -> bool:
    return any(name in message for name in names)


# --- strategies -----------------------------------------------------------------


class Opaque:
    """An arbitrary object: hashable, not JSON, not a string."""


def nested(depth: int, leaf: object = 1) -> dict[str, object]:
    value: object = leaf
    for _ in range(depth):
        value = {"a": value}
    return value  # type: ignore[return-value]


class Deep(dict[str, object]):
    """``{"a": {"a": ... leaf}}``, ``depth`` levels of plain dicts. To the
    library it is a dict like any other (same ``repr``, same JSON); only
    hypothesis prints it briefly, since its own printer cannot recurse that
    deep either."""

    def __init__(self, depth: int, leaf: object = 1) -> None:
        super().__init__(a=nested(depth - 1, leaf))
        self.depth = depth

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(f"Deep(depth={self.depth})")


@functools.cache
def deep(depth: int) -> Deep:
    """One shared instance per depth: building 3,000 levels per example
    would cost more than the test (nothing mutates it)."""
    return Deep(depth)


SURROGATES = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff", "\udc80"])
NASTY_SNIPPETS = (
    "",
    " ",
    "\t",
    "\x00",
    "\n",
    "\r\n",
    "\x1b[31m",
    "\x7f",
    "\x85",
    "\u2028",
    "\ufeff",
    "\u200b",
    "$(touch x)",
    "`id`",
    "; rm -rf ~",
    "| cat",
    "&&",
    ">",
    "<",
    "'",
    '"',
    "*",
    "~",
    "{payload}",
    "{deliver_to}",
    "%s",
    "\\",
    "\u00e9",
    "\u2603",
    "\U0001f600",
)
hostile_text = st.lists(
    st.one_of(
        st.text(st.characters(exclude_categories=()), max_size=8),
        st.sampled_from(NASTY_SNIPPETS),
        SURROGATES,
    ),
    max_size=4,
).map("".join)
huge_ints = st.one_of(
    st.sampled_from(
        [2**31, 2**53 + 1, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 10**300, 10**400, -(10**400)]
    ),
    # Past Python's int-to-str digit limit: repr() of these raises. Built
    # lazily, because hypothesis reprs the elements of sampled_from.
    st.builds(lambda: 10**5000),
    st.builds(lambda: -(10**5000)),
)
any_floats = st.floats()  # nan, +-inf, subnormals, -0.0 included
hashable_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    huge_ints,
    any_floats,
    hostile_text,
    st.binary(max_size=16),
    st.builds(Opaque),
)
hostile_values = st.recursive(
    hashable_values,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(hashable_values, inner, max_size=4),
        st.frozensets(hashable_values, max_size=3),
        st.sets(hashable_values, max_size=3),
    ),
    max_leaves=8,
)
DEPTHS = (1, 2, 50, 400, 1500, 3000)
deep_values = st.sampled_from(DEPTHS).map(deep)
"""Nesting of every depth, well within and well past the recursion limit."""
big_values = st.one_of(
    st.integers(0, 20).map(lambda n: "x" * 2**n),  # up to 1 MiB of text
    st.integers(0, 18).map(lambda n: "\u2603;$(x)" * 2**n),
    st.integers(0, 16).map(lambda n: list(range(2**n))),
    st.integers(0, 14).map(lambda n: {str(i): i for i in range(2**n)}),
)
"""Values of every size, cheap to draw (one integer each)."""
any_values = st.one_of(hostile_values, deep_values, big_values)

plain_chars = st.characters(exclude_categories=["Cs"], exclude_characters="\x00")
BIDI_CONTROLS = "".join(map(chr, (*range(0x202A, 0x202F), *range(0x2066, 0x206A))))
"""Refused in a kind and a route (they reorder what an operator reads)."""
kind_chars = st.characters(exclude_categories=["Cs"], exclude_characters="\x00" + BIDI_CONTROLS)
route_chars = st.characters(exclude_categories=("Cs", "Cc"), exclude_characters=BIDI_CONTROLS)


def not_blank(text: str) -> str:
    return text if text.strip() else f"x{text}"


valid_kinds = st.text(kind_chars, min_size=1, max_size=12).map(not_blank)
valid_routes = st.text(route_chars, min_size=1, max_size=12).map(not_blank)
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(plain_chars | st.just("\x00"), max_size=20),
)
json_values = st.one_of(
    json_scalars,
    st.lists(json_scalars, max_size=3),
    st.dictionaries(st.text(max_size=4), json_scalars, max_size=3),
)
valid_bodies = st.one_of(st.none(), st.dictionaries(st.text(max_size=6), json_values, max_size=3))
finite_numbers = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.integers(min_value=-(2**53), max_value=2**53),
)
valid_keys = st.one_of(
    st.sampled_from(KEY_POOL), st.text(plain_chars, min_size=1, max_size=10).map(not_blank)
)

VALID_OPTIONAL = {
    "body": valid_bodies,
    "dedup_key": st.one_of(st.none(), valid_keys),
    "ack_required": st.booleans(),
    "max_attempts": st.integers(min_value=1, max_value=1000),
    "expires_at": st.one_of(st.none(), finite_numbers),
    "session_id": st.sampled_from([None, KNOWN_SESSION]),
    "schedule_run_id": st.sampled_from([None, KNOWN_RUN]),
}
valid_items = st.fixed_dictionaries(
    {"kind": valid_kinds, "deliver_to": valid_routes}, optional=VALID_OPTIONAL
)
"""Keyword arguments that are valid by construction."""

HOSTILE_FOR: dict[str, st.SearchStrategy[Any]] = {
    "kind": st.one_of(any_values, hostile_text),
    "deliver_to": st.one_of(any_values, hostile_text),
    "body": st.one_of(
        any_values,
        st.dictionaries(hashable_values, any_values, max_size=4),
        st.builds(lambda deep: {"deep": deep}, deep_values),
    ),
    "dedup_key": st.one_of(any_values, hostile_text),
    "ack_required": any_values,
    "max_attempts": st.one_of(any_values, st.integers(), huge_ints),
    "expires_at": st.one_of(any_values, any_floats, huge_ints),
    "session_id": st.one_of(any_values, hostile_text),
    "schedule_run_id": st.one_of(any_values, hostile_text),
    "now": st.one_of(any_values, any_floats, huge_ints),
}


@st.composite
def enqueue_arguments(draw: st.DrawFn) -> dict[str, Any]:
    """Valid arguments with any subset of them (often none) replaced by a
    hostile value of any type and size."""
    args: dict[str, Any] = draw(valid_items)
    for name in draw(st.lists(st.sampled_from(ENQUEUE_ARGS), max_size=3, unique=True)):
        args[name] = draw(HOSTILE_FOR[name])
    return args


BATCH_BODIES: tuple[dict[Any, Any] | None, ...] = (
    None,
    {},
    {"a": 1},
    {"text": "$(touch x); rm -rf ~\n"},
    {"nul": "a\x00b", "snow": "\u2603"},
    {"nested": {"list": [1, "two", None, 3.5, {"deep": [True]}]}},
    {"1": (1, 2), 2: "int key"},
)
batch_items = st.fixed_dictionaries(
    {
        "kind": st.sampled_from(["k", "alert", "a;b", "\u2603"]),
        "deliver_to": st.sampled_from(["seat", "ops room", "a|b", "$(touch x)"]),
    },
    optional={
        "body": st.sampled_from(BATCH_BODIES),
        "dedup_key": st.sampled_from(KEY_POOL),
        "ack_required": st.booleans(),
        "max_attempts": st.integers(min_value=1, max_value=10),
        "expires_at": st.floats(0, 2e9),
        "session_id": st.just(KNOWN_SESSION),
        "schedule_run_id": st.just(KNOWN_RUN),
    },
)
"""Valid batch items, cheaper to draw than ``valid_items`` (the variety of
each value is property (a)'s job; batches are about atomicity)."""

CORRUPTIONS: dict[str, tuple[object, ...]] = {
    "kind": ("", "   ", "a\x00b", "\ud800", None, 5, b"k", ["k"]),
    "deliver_to": ("", " \t ", "a\nb", "seat\x00", "\x1b[0m", "\udfff", b"seat", None),
    "body": (
        [1],
        "text",
        b"{}",
        {"s": {1}},
        {"x": math.nan},
        {"o": Opaque()},
        {(1, 2): 1},
        {"b": b"\xff"},
    ),
    "dedup_key": ("", 7, b"k", "k\x00"),
    "ack_required": (1, "yes", None),
    "max_attempts": (0, -1, 2.0, True, "8", None),
    "expires_at": (math.nan, math.inf, -math.inf, "soon", True),
    "session_id": ("", 3, "ghost-session"),
    "schedule_run_id": ("", b"run", "ghost-run"),
}


@st.composite
def invalid_items(draw: st.DrawFn) -> object:
    """An item that is invalid by construction, in one of several ways."""
    how = draw(st.sampled_from(["value", "unknown", "missing", "not a mapping"]))
    if how == "not a mapping":
        return draw(st.sampled_from([None, 3, "kind=k", [("kind", "k")], b"kind"]))
    item: dict[str, Any] = draw(batch_items)
    if how == "unknown":
        item[draw(st.sampled_from(["colour", "Kind", "deliverTo", ""]))] = "x"
    elif how == "missing":
        del item[draw(st.sampled_from(["kind", "deliver_to"]))]
    else:
        name = draw(st.sampled_from(sorted(CORRUPTIONS)))
        item[name] = draw(st.sampled_from(CORRUPTIONS[name]))
    return item


@st.composite
def hostile_items(draw: st.DrawFn) -> object:
    """A valid item with one argument replaced by a value of any type and size."""
    item: dict[str, Any] = draw(batch_items)
    name = draw(st.sampled_from(ENQUEUE_ARGS[:-1]))  # not ``now``: it is per batch
    item[name] = draw(HOSTILE_FOR[name])
    return item


VALID, INVALID, UNKNOWN = "valid", "invalid", "unknown"
tagged_items = st.one_of(
    batch_items.map(lambda item: (VALID, item)),
    batch_items.map(lambda item: (VALID, item)),
    invalid_items().map(lambda item: (INVALID, item)),
    hostile_items().map(lambda item: (UNKNOWN, item)),
)


def check_committed_row(bridge: Bridge, dispatch_id: str, args: dict[str, Any]) -> None:
    """The row holds exactly what was enqueued."""
    row = bridge.row(dispatch_id)
    assert row["kind"] == args["kind"]
    assert row["deliver_to"] == args["deliver_to"]
    assert row["dedup_key"] == args.get("dedup_key")
    assert row["max_attempts"] == args.get("max_attempts", 8)
    assert row["ack_required"] == int(args.get("ack_required", False))
    assert (row["ack_token"] is not None) == bool(args.get("ack_required", False))
    expires_at = args.get("expires_at")
    assert row["expires_at"] == (None if expires_at is None else float(expires_at))
    assert row["session_id"] == args.get("session_id")
    assert row["schedule_run_id"] == args.get("schedule_run_id")
    assert row["status"] == "pending"
    payload = json.loads(row["payload"])
    assert payload["dispatch_id"] == dispatch_id
    assert (payload["kind"], payload["deliver_to"]) == (args["kind"], args["deliver_to"])
    body = args.get("body")
    assert payload["body"] == json.loads(json.dumps({} if body is None else body))


# --- enqueue: arguments of every type and size ------------------------------------


@given(args=enqueue_arguments())
def test_enqueue_dispatch_with_any_arguments_commits_one_row_or_raises_type_or_value_error(
    bridge: Bridge, args: dict[str, Any]
) -> None:
    before = bridge.counts()
    result = outcome(lambda: bridge.call(enqueue_dispatch, **args))
    after = bridge.counts()
    if isinstance(result, BaseException):
        event(f"refused: {type(result).__name__}")
        assert after == before, "a refused enqueue wrote something"
        assert names_an_argument(str(result)), f"error names no argument: {result!r}"
        return
    assert isinstance(result, str) and HEX32.fullmatch(result)
    key = args.get("dedup_key")
    if key is not None and key in bridge.keys:
        event("dedup hit")
        assert result == bridge.keys[key]
        assert after == before, "a dedup hit wrote something"
        return
    event("committed")
    assert after == (before[0] + 1, before[1] + 1)
    check_committed_row(bridge, result, args)
    if key is not None:
        bridge.keys[key] = result


@given(tagged=st.lists(tagged_items, max_size=5))
def test_enqueue_many_commits_every_item_or_names_the_bad_item_and_writes_nothing(
    bridge: Bridge, tagged: list[tuple[str, Any]]
) -> None:
    tags = [tag for tag, _ in tagged]
    items = [item for _, item in tagged]
    first_invalid = tags.index(INVALID) if INVALID in tags else None
    before = bridge.counts()
    result = outcome(lambda: bridge.call(enqueue_many, items=items))
    after = bridge.counts()
    if isinstance(result, BaseException):
        event(f"refused: {type(result).__name__}")
        assert after == before, "a refused batch wrote something"
        named = re.match(r"item (\d+)[: ]", str(result))
        assert named, f"error does not start with 'item <index>': {result!r}"
        index = int(named[1])
        assert index < len(items) and tags[index] != VALID, f"blamed a valid item: {result!r}"
        return
    event("committed" if items else "empty batch")
    assert first_invalid is None, f"accepted invalid item {first_invalid}: {items}"
    assert len(result) == len(items)
    seen = dict(bridge.keys)
    added = 0
    for item, got in zip(items, result, strict=True):
        assert HEX32.fullmatch(got.id)
        key = item.get("dedup_key")
        if key is not None and key in seen:
            assert got.dedup_hit and got.id == seen[key]
            continue
        assert not got.dedup_hit
        added += 1
        check_committed_row(bridge, got.id, item)
        if key is not None:
            seen[key] = got.id
    assert after == (before[0] + added, before[1] + added)
    bridge.keys = seen


# --- invalid UTF-8, NUL -----------------------------------------------------------------

TEXT_ARGS = ("kind", "deliver_to", "dedup_key", "session_id", "schedule_run_id")
some_text = st.text(plain_chars, max_size=10)
with_surrogate = st.builds(lambda a, s, b: a + s + b, some_text, SURROGATES, some_text)
with_nul = st.builds(lambda a, b: a + "\x00" + b, some_text, some_text)
invalid_utf8 = st.one_of(
    st.binary(),
    st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"k\x00"]),
)
encoding_cases = st.one_of(
    st.tuples(st.sampled_from((*TEXT_ARGS, "body")), invalid_utf8, st.just(TypeError)),
    st.tuples(st.sampled_from(TEXT_ARGS), with_surrogate, st.just(ValueError)),
    st.tuples(st.sampled_from(TEXT_ARGS), with_nul, st.just(ValueError)),
    st.tuples(
        st.just("body"),
        st.one_of(
            st.builds(lambda v: {"text": v}, with_surrogate),
            st.builds(lambda v: {"raw": v}, invalid_utf8),
            st.builds(lambda k: {k: 1}, invalid_utf8),
            st.builds(lambda k: {k: 1}, with_surrogate),
        ),
        st.just(ValueError),
    ),
    # NUL is fine inside body text: JSON escapes it.
    st.tuples(
        st.just("body"),
        st.one_of(
            st.builds(lambda v: {"text": v}, with_nul), st.builds(lambda k: {k: [k]}, with_nul)
        ),
        st.none(),
    ),
)


@given(case=encoding_cases)
def test_bytes_lone_surrogates_and_nul_get_the_documented_error_and_write_nothing(
    bridge: Bridge, case: tuple[str, object, type[Exception] | None]
) -> None:
    name, value, expected = case
    args = {"kind": "k", "deliver_to": "seat", name: value}
    before = bridge.counts()
    if expected is None:
        dispatch_id = bridge.call(enqueue_dispatch, **args)
        payload = bridge.row(dispatch_id)["payload"]
        assert "\x00" not in payload and "\\u0000" in payload
        assert json.loads(payload)["body"] == value
        assert bridge.counts() == (before[0] + 1, before[1] + 1)
        return
    with pytest.raises(expected) as caught:
        bridge.call(enqueue_dispatch, **args)
    assert type(caught.value) is expected
    assert name in str(caught.value)
    assert bridge.counts() == before


# --- regression pins for the bugs the properties found ----------------------------


@pytest.mark.parametrize("name", ["expires_at", "now"])
@pytest.mark.parametrize("value", [10**400, -(10**400)], ids=["1e400", "-1e400"])
def test_a_number_too_large_for_a_float_is_a_value_error_naming_it(
    bridge: Bridge, name: str, value: int
) -> None:
    before = bridge.counts()
    with pytest.raises(ValueError, match=name):
        bridge.call(enqueue_dispatch, **{"kind": "k", "deliver_to": "seat", name: value})
    assert bridge.counts() == before


@pytest.mark.parametrize("value", [2**63, 2**64, 10**30], ids=["2**63", "2**64", "1e30"])
def test_max_attempts_beyond_the_database_integer_range_is_stored_or_refused_by_name(
    bridge: Bridge, value: int
) -> None:
    before = bridge.counts()
    result = outcome(
        lambda: bridge.call(enqueue_dispatch, kind="k", deliver_to="seat", max_attempts=value)
    )
    if isinstance(result, BaseException):
        assert "max_attempts" in str(result)
        assert bridge.counts() == before
    else:
        assert bridge.row(result)["max_attempts"] == value


def test_enqueue_many_names_the_item_with_an_out_of_range_max_attempts(bridge: Bridge) -> None:
    items = [
        {"kind": "k", "deliver_to": "a"},
        {"kind": "k", "deliver_to": "b", "max_attempts": 2**63},
    ]
    with pytest.raises((TypeError, ValueError), match=r"^item 1: .*max_attempts"):
        bridge.call(enqueue_many, items=items)
    assert bridge.counts() == (0, 0)


@pytest.mark.parametrize("column", ["session_id", "schedule_run_id"])
def test_enqueue_many_names_the_item_with_an_unknown_provenance_link(
    bridge: Bridge, column: str
) -> None:
    items = [
        {"kind": "k", "deliver_to": "a"},
        {"kind": "k", "deliver_to": "b"},
        {"kind": "k", "deliver_to": "c", column: "ghost"},
    ]
    with pytest.raises(ValueError, match=rf"^item 2: {column} 'ghost' does not exist"):
        bridge.call(enqueue_many, items=items)
    assert bridge.counts() == (0, 0)


@pytest.mark.parametrize(
    "name, value, expected",
    [
        ("kind", 10**5000, TypeError),
        ("deliver_to", [10**5000], TypeError),
        ("max_attempts", -(10**5000), ValueError),
        ("body", {"n": 10**5000}, ValueError),
        ("deliver_to", nested(5000), TypeError),
        ("body", nested(5000), ValueError),
        ("body", {"deep": [nested(2000)]}, ValueError),
    ],
    ids=[
        "kind-huge-int",
        "route-list-of-huge-int",
        "max-attempts-huge-negative",
        "body-huge-int",
        "route-deep-dict",
        "body-deep-dict",
        "body-deep-list",
    ],
)
def test_a_value_without_a_printable_repr_is_still_refused_by_name(
    bridge: Bridge, name: str, value: object, expected: type[Exception]
) -> None:
    before = bridge.counts()
    with pytest.raises(expected, match=name):
        bridge.call(enqueue_dispatch, **{"kind": "k", "deliver_to": "seat", name: value})
    assert bridge.counts() == before


# --- 1 MiB bodies -----------------------------------------------------------------------

BIG_BODIES: dict[str, dict[str, Any]] = {
    "ascii-blob": {"blob": "x" * MIB},
    "unicode-and-shell": {
        "text": ("h\u00e9llo \u2603 \U0001f600 $(touch x) `id` ; | & > \n\x00 ' \" * ~ " * 20_000)
    },
    "many-keys": {f"k{i}": [i, str(i), {"v": i * 0.5}] for i in range(40_000)},
}


@pytest.fixture
async def big_store(db_target: str) -> AsyncIterator[Store]:
    """A store that takes bodies of up to 8 MiB (the default limit is 1 MiB)."""
    async with open_store(db_target, max_body_bytes=8 * MIB) as db:
        yield db


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("body", BIG_BODIES.values(), ids=BIG_BODIES.keys())
async def test_a_one_mebibyte_body_is_stored_and_round_trips_exactly(
    big_store: Store, raw: RawDB, body: dict[str, Any]
) -> None:
    store = big_store
    assert len(json.dumps(body)) >= MIB
    dispatch_id = await enqueue_dispatch(store, kind="big", deliver_to="seat", body=body)
    assert raw.counts() == (1, 1)
    assert json.loads(str(raw.row(dispatch_id)["payload"]))["body"] == body
    [result] = await enqueue_many(store, [{"kind": "big", "deliver_to": "seat", "body": body}])
    assert json.loads(str(raw.row(result.id)["payload"]))["body"] == body
    assert raw.counts() == (2, 2)


@pytest.mark.anyio
async def test_a_one_mebibyte_body_with_a_set_deep_inside_is_a_value_error_writing_nothing(
    big_store: Store, raw: RawDB
) -> None:
    store = big_store
    body = {"blob": "x" * MIB, "deep": [{"a": {"b": [1, 2, {"c": {"tags": {"x", "y"}}}]}}]}
    with pytest.raises(ValueError, match="body"):
        await enqueue_dispatch(store, kind="big", deliver_to="seat", body=body)
    with pytest.raises(ValueError, match=r"^item 1: body"):
        await enqueue_many(
            store,
            [{"kind": "k", "deliver_to": "a"}, {"kind": "big", "deliver_to": "seat", "body": body}],
        )
    assert raw.counts() == (0, 0)


@pytest.mark.anyio
async def test_a_one_mebibyte_payload_reaches_the_transport_on_stdin_byte_for_byte(
    big_store: Store, raw: RawDB, tmp_path: Path
) -> None:
    store = big_store
    results = tmp_path / "received.json"
    body = BIG_BODIES["unicode-and-shell"]
    dispatch_id = await enqueue_dispatch(store, kind="big", deliver_to="seat", body=body)
    template = [sys.executable, "-I", "-S", "-c", RECORDER, str(results), "{deliver_to}"]
    counts = await deliver_due_dispatches(store, notify_template=template)
    assert counts["delivered"] == 1, raw.row(dispatch_id)["last_error"]
    received = json.loads(results.read_text())
    assert bytes.fromhex(received["stdin"]) == str(raw.row(dispatch_id)["payload"]).encode()
    assert [bytes.fromhex(arg) for arg in received["argv"]] == [b"seat"]


@pytest.mark.anyio
async def test_a_one_mebibyte_payload_in_argv_is_a_recorded_failure_not_a_crash(
    big_store: Store, raw: RawDB, tmp_path: Path
) -> None:
    # One argv element is limited by the kernel (128 KiB on Linux): exec fails
    # with E2BIG, the same way on every attempt, so the dispatch is
    # dead-lettered at once (docs/security.md) instead of retried for hours.
    store = big_store
    dispatch_id = await enqueue_dispatch(
        store, kind="big", deliver_to="seat", body=BIG_BODIES["ascii-blob"]
    )
    template = [sys.executable, "-I", "-S", "-c", "pass", "{payload}"]
    counts = await deliver_due_dispatches(store, notify_template=template)
    assert counts == {"attempted": 1, "delivered": 0, "dead_letter": 1, "expired": 0, "retried": 0}
    row = raw.row(dispatch_id)
    assert row["status"] == "dead_letter"
    assert str(row["last_error"]).startswith("cannot execute")


# --- the transport: argv templates and shell syntax ----------------------------------

TOKENS = ("{payload}", "{deliver_to}")
NEAR_TOKENS = (
    "x{payload}",
    "{payload} ",
    " {payload}",
    "{PAYLOAD}",
    "{payload}}",
    "{{payload}}",
    "{ payload }",
    "{deliver_to}x",
    "{Deliver_To}",
    "{deliver-to}",
    "$payload",
    "{payload",
    "payload}",
    "{}",
    "{payload}{deliver_to}",
    "{payload}\x00",
    "{payload}\n",
)
template_elements = st.one_of(st.sampled_from(TOKENS), st.sampled_from(NEAR_TOKENS), hostile_text)


def encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@given(
    template=st.lists(template_elements, max_size=8),
    route=hostile_text,
    payload=st.one_of(hostile_text, st.sampled_from(TOKENS)),
)
def test_render_argv_substitutes_only_whole_token_elements(
    template: list[str], route: str, payload: str
) -> None:
    delivery = Delivery(dispatch_id="d", kind="k", deliver_to=route, attempt=1, payload=payload)
    payload_in_argv = any(element == "{payload}" for element in template)
    if not payload_in_argv and not encodes(payload):
        with pytest.raises(UnicodeEncodeError):
            render_argv(template, delivery)
        return
    argv, stdin = render_argv(template, delivery)
    assert len(argv) == len(template)
    for element, arg in zip(template, argv, strict=True):
        if element == "{payload}":
            assert arg == payload
        elif element == "{deliver_to}":
            assert arg == route
        else:
            assert arg == element
    assert stdin == (None if payload_in_argv else payload.encode("utf-8"))


def is_runnable_template(value: object) -> bool:
    """What docs/guarantees.md calls a valid template (a non-empty list of str; a tuple
    of str counts too): these would start a process."""
    return (
        isinstance(value, list | tuple)
        and len(value) > 0
        and all(isinstance(element, str) for element in value)
    )


def with_a_non_str(elements: list[Any], intruder: object, at: int) -> list[Any]:
    return [*elements[:at], intruder, *elements[at:]]


invalid_templates = st.one_of(
    st.none(),
    st.just([]),
    st.just(()),
    hostile_text,  # a str is never split into argv, let alone run by a shell
    st.binary(),
    hostile_values,
    st.builds(
        with_a_non_str,
        st.lists(template_elements, max_size=5),
        st.one_of(
            st.none(),
            st.integers(),
            st.binary(),
            st.lists(st.text(), max_size=2),
            st.tuples(st.text()),
            st.builds(Opaque),
            any_floats,
        ),
        st.integers(0, 5),
    ),
    st.builds(lambda n: ["x"] * n + [None], st.integers(10_000, 100_000)),
    st.builds(lambda n: [[sys.executable, "-c", "pass"]] * n, st.integers(1, 1000)),
    st.builds(lambda n: list(range(n)), st.integers(1, 10_000)),
).filter(lambda value: not is_runnable_template(value))


@given(template=invalid_templates, route=valid_routes, command_line=st.booleans())
def test_command_transport_with_an_invalid_template_reports_failure_and_never_raises(
    portal: BlockingPortal, tmp_path: Path, template: object, route: str, command_line: bool
) -> None:
    canary = tmp_path / "CANARY"
    if command_line:  # a shell command line is a str, never a template
        template = f"touch {canary}; {sys.executable} -c pass"
    transport = CommandTransport(template)  # type: ignore[arg-type]
    assert transport.template is None
    delivery = Delivery(
        dispatch_id="d",
        kind="k",
        deliver_to=route,
        attempt=1,
        payload=json.dumps({"cmd": f"$(touch {canary}); touch {canary}"}),
    )
    result = portal.call(transport, delivery)
    assert isinstance(result, TransportResult)
    assert (result.ok, result.error) == (False, NOT_CONFIGURED_ERROR)
    assert not canary.exists()


def shell_pieces(canary: Path) -> list[str]:
    return [
        f"touch {canary}",
        f"$(touch {canary})",
        f"`touch {canary}`",
        f"; touch {canary}",
        f"| touch {canary}",
        f"&& touch {canary}",
        f"|| touch {canary}",
        f"> {canary}",
        f">> {canary}",
        f"$(echo > {canary})",
        f"'; touch {canary}; '",
        f'"; touch {canary}; "',
        f"%0atouch {canary}",
        "${IFS}",
        "$HOME",
        "~",
        "~root",
        "*",
        "?",
        "[a-z]",
        "!",
        "#",
        "\\",
        "'",
        '"',
        "&",
        "|",
        ";",
        "(",
        ")",
        "{",
        "}",
        "<",
        ">",
        " ",
        "{payload}",
        "{deliver_to}",
    ]


@st.composite
def shell_text(draw: st.DrawFn, canary: Path, *, newlines: bool) -> str:
    pieces = shell_pieces(canary) + (["\n", "\r\n", "\n\n"] if newlines else [])
    chars = plain_chars if newlines else route_chars
    parts = draw(
        st.lists(
            st.one_of(st.sampled_from(pieces), st.text(chars, max_size=6)), min_size=1, max_size=6
        )
    )
    return "".join(parts)


# Each example spawns one real transport process; the property still runs
# the suite's 1,000 examples per backend (the argv/stdin contract alone is
# also covered by test_render_argv_substitutes_only_whole_token_elements).
# About a minute on a quiet machine; a loaded one needs more than the
# suite's default timeout.
@pytest.mark.slow
@pytest.mark.timeout(600)
@given(data=st.data(), payload_in_argv=st.booleans())
def test_routes_and_bodies_full_of_shell_syntax_reach_the_transport_verbatim(
    bridge: Bridge, tmp_path: Path, data: st.DataObject, payload_in_argv: bool
) -> None:
    canary = tmp_path / "CANARY"
    results = tmp_path / "received.json"
    route = data.draw(shell_text(canary, newlines=False).filter(lambda t: t.strip() != ""))
    kind = data.draw(shell_text(canary, newlines=False).filter(lambda t: t.strip() != ""))
    body = data.draw(
        st.dictionaries(
            st.one_of(st.sampled_from(shell_pieces(canary)), st.text(max_size=5)),
            shell_text(canary, newlines=True),
            max_size=4,
        )
    )
    dispatch_id = bridge.call(enqueue_dispatch, kind=kind, deliver_to=route, body=body)
    template = [
        sys.executable,
        "-I",
        "-S",
        "-c",
        RECORDER,
        str(results),
        "{deliver_to}",
        "x{payload}",
        "{PAYLOAD}",
    ]
    if payload_in_argv:
        template.append("{payload}")

    counts = bridge.call(deliver_due_dispatches, notify_template=template)

    row = bridge.row(dispatch_id)
    assert counts["delivered"] == 1, row["last_error"]
    assert row["status"] == "delivered"
    payload = str(row["payload"]).encode("utf-8")
    assert json.loads(payload)["body"] == body
    received = json.loads(results.read_text())
    results.unlink()
    argv = [bytes.fromhex(arg) for arg in received["argv"]]
    expected = [route.encode(), b"x{payload}", b"{PAYLOAD}"]
    assert argv == ([*expected, payload] if payload_in_argv else expected)
    assert bytes.fromhex(received["stdin"]) == (b"" if payload_in_argv else payload)
    assert bytes.fromhex(received["route"]) == route.encode()
    assert bytes.fromhex(received["kind"]) == kind.encode()
    assert not canary.exists()


# --- config: malformed and malicious YAML --------------------------------------------


def yaml_tags(canary: Path) -> list[str]:
    """Constructors that, under any unsafe loader, would create ``canary``
    (through a shell, a subprocess, or plain ``open``) or import code."""
    target = json.dumps(str(canary))
    return [
        f"!!python/object/apply:os.system [{json.dumps(f'touch {canary}')}]",
        f"!!python/object/apply:subprocess.call [[touch, {target}]]",
        f"!!python/object/apply:builtins.open [{target}, w]",
        f"!!python/object/new:builtins.open [{target}, w]",
        f"!!python/object/apply:pathlib.Path.touch [!!python/object/apply:pathlib.Path [{target}]]",
        "!!python/name:os.system",
        "!!python/module:os",
        "!!python/object:builtins.object {}",
        f"!<tag:yaml.org,2002:python/object/apply:os.system> [{json.dumps(f'touch {canary}')}]",
        f"!python/object/apply:os.system [{json.dumps(f'touch {canary}')}]",
        "!!binary AAAA",
        "!!set {a, b}",
        "!!omap [a: 1]",
        "!!timestamp 2024-13-45",
        "!!float abc",
        "!!int 0x" + "f" * 4000,
    ]


SCHEMA_KEYS = ("store", "durability", "dispatch", "worker", "log_level")
SECTION_KEYS = {
    "dispatch": ("notify_template", "timeout_seconds"),
    "worker": ("tick_seconds", "concurrency", "batch_size", "grace_seconds", "retry_jitter"),
}
yaml_text_chars = st.characters(exclude_categories=["Cs"])
yaml_keys = st.one_of(st.text(yaml_text_chars, max_size=8), st.integers())
yaml_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(),
    st.text(yaml_text_chars, max_size=12),
    st.sampled_from(
        [
            "full",
            "normal",
            "INFO",
            "debug",
            "outbox.db",
            "sqlite:///x.db",
            "0x10",
            "1:30",
            "~",
            "yes",
            "no",
            "on",
            ".inf",
            "-.nan",
            "2024-01-01",
        ]
    ),
)
yaml_values = st.one_of(
    yaml_scalars,
    st.lists(yaml_scalars, max_size=3),
    st.dictionaries(yaml_keys, yaml_scalars, max_size=3),
)
GOOD_CONFIG_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "store": st.sampled_from(["outbox.db", "sqlite:///o.db", ":memory:", "~/o.db"]),
    "durability": st.sampled_from(["full", "normal"]),
    "log_level": st.sampled_from(["INFO", "debug", "Error"]),
    "notify_template": st.one_of(
        st.none(), st.lists(st.text(yaml_text_chars, max_size=8), min_size=1, max_size=3)
    ),
    "timeout_seconds": st.floats(0.001, 100),
    "tick_seconds": st.integers(1, 100),
    "concurrency": st.integers(1, 64),
    "batch_size": st.integers(1, 1000),
    "grace_seconds": st.floats(0, 10),
    "retry_jitter": st.floats(0, 1),
}


def config_value(key: str) -> st.SearchStrategy[Any]:
    """Right (twice as likely) or wrong values for ``key``."""
    good = GOOD_CONFIG_VALUES[key]
    return st.one_of(good, good, yaml_values)


def config_section(keys: tuple[str, ...]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.fixed_dictionaries({}, optional={key: config_value(key) for key in keys}),
        st.fixed_dictionaries({}, optional={key: config_value(key) for key in keys}),
        yaml_values,
    )


config_mappings = st.builds(
    lambda known, extra: {**known, **extra},
    st.fixed_dictionaries(
        {},
        optional={
            "store": config_value("store"),
            "durability": config_value("durability"),
            "dispatch": config_section(SECTION_KEYS["dispatch"]),
            "worker": config_section(SECTION_KEYS["worker"]),
            "log_level": config_value("log_level"),
        },
    ),
    st.one_of(st.just({}), st.just({}), st.dictionaries(yaml_keys, yaml_values, max_size=2)),
)
"""Mappings shaped like a config: mostly the real keys, with right and
wrong values, sometimes unknown keys."""


@st.composite
def yaml_documents(draw: st.DrawFn, canary: Path) -> bytes:
    how = draw(st.sampled_from(["dumped", "text", "bytes", "tagged", "huge-int"]))
    if how == "bytes":
        return draw(st.binary(max_size=200))
    if how == "text":
        alphabet = st.one_of(
            st.sampled_from([*":-[]{}!&*#|>'\"%@`,?\n\t \\", "  ", "- ", ": ", "\n  "]),
            st.sampled_from([*SCHEMA_KEYS, "notify_template", "concurrency", "1", "x"]),
            st.characters(exclude_categories=["Cs"]),
        )
        return "".join(draw(st.lists(alphabet, max_size=40))).encode("utf-8")
    mapping = draw(config_mappings)
    dumped = yaml.safe_dump(mapping, allow_unicode=draw(st.booleans()))
    if how == "dumped":
        return dumped.encode("utf-8")
    if how == "huge-int":
        # 3,600 hex digits is past 4,300 decimal ones: an int with no repr.
        scalar = "0x" + "f" * draw(st.integers(3600, 3700))
    else:
        scalar = draw(st.sampled_from(yaml_tags(canary)))
    line = draw(
        st.sampled_from(
            [
                "{s}\n",
                "store: {s}\n",
                "log_level: {s}\n",
                "dispatch:\n  notify_template: {s}\n",
                "dispatch:\n  notify_template: [python3, {s}]\n",
                "worker:\n  concurrency: {s}\n",
                "worker:\n  tick_seconds: {s}\n",
                "{s}: 1\n",
                "? {s}\n: 1\n",
                "- {s}\n",
            ]
        )
    )
    text = line.format(s=scalar)
    return (text if draw(st.booleans()) else dumped + text).encode("utf-8")


def key_paths(data: object, prefix: str = "") -> set[str] | None:
    """Every dotted key path in ``data``; None if a key has no ``str`` (an
    int past the digit limit), so no message could quote it."""
    if not isinstance(data, dict):
        return set()
    paths: set[str] = set()
    for key, value in data.items():
        try:
            path = prefix + str(key)
        except ValueError:
            return None
        inner = key_paths(value, path + ".")
        if inner is None:
            return None
        paths |= inner | {path}
    return paths


def assert_one_line_naming(message: str, source: str) -> None:
    assert message.startswith(f"{source}: "), message
    assert len(message.splitlines()) == 1, f"not one line: {message!r}"


@given(data=st.data())
def test_any_yaml_file_loads_or_is_refused_with_a_one_line_config_error_and_runs_nothing(
    tmp_path: Path, data: st.DataObject
) -> None:
    canary = tmp_path / "CANARY"
    document = data.draw(yaml_documents(canary))
    path = tmp_path / DEFAULT_CONFIG_NAME
    path.write_bytes(document)
    try:
        config = load_config(path)
    except ConfigError as exc:
        assert_one_line_naming(str(exc), str(path))
    else:
        assert isinstance(config, Config)
        assert config.path == path.absolute()
    template = resolve_notify_template(tmp_path)  # documented never to raise
    assert template is None or (
        isinstance(template, list) and template and all(isinstance(e, str) for e in template)
    )
    assert not canary.exists()


@given(data=st.one_of(config_mappings, yaml_values, hostile_values))
def test_any_mapping_parses_or_is_refused_with_a_one_line_config_error_naming_the_key(
    data: object,
) -> None:
    try:
        config = parse_config(data, source="cfg.yaml")
    except ConfigError as exc:
        message = str(exc)
        assert_one_line_naming(message, "cfg.yaml")
        paths = key_paths(data)
        # A long key may be shown cut short (``'abc...xyz'``): its start counts.
        assert (
            paths is None
            or "top level" in message
            or any(path in message or repr(path)[:24] in message for path in paths)
        ), f"names no key: {message!r}"
    else:
        assert isinstance(config, Config)
        assert isinstance(data, dict | type(None))
        assert set(data or {}) <= set(SCHEMA_KEYS)


HUGE_HEX = "0x" + "f" * 4000
"""A YAML int with no decimal repr: hex literals are not bound by Python's
int-to-str digit limit, so a file can hold one."""


@pytest.mark.parametrize(
    "text, key",
    [
        (f"store: {HUGE_HEX}\n", "store"),
        (f"log_level: {HUGE_HEX}\n", "log_level"),
        (f"worker:\n  tick_seconds: {HUGE_HEX}\n", "worker.tick_seconds"),
        (f"worker:\n  retry_jitter: -{HUGE_HEX}\n", "worker.retry_jitter"),
        (f"dispatch:\n  timeout_seconds: {HUGE_HEX}\n", "dispatch.timeout_seconds"),
        (f"dispatch:\n  notify_template: [python3, {HUGE_HEX}]\n", "dispatch.notify_template"),
        (f"? {HUGE_HEX}\n: 1\n", "unknown key"),  # explicit key: it is over 1024 chars
        (f"worker:\n  ? {HUGE_HEX}\n  : 1\n", "unknown key"),
    ],
    ids=[
        "store",
        "log_level",
        "tick_seconds",
        "retry_jitter",
        "timeout_seconds",
        "notify_template",
        "top-level-key",
        "worker-key",
    ],
)
def test_a_huge_hex_integer_in_the_config_is_a_one_line_config_error(
    tmp_path: Path, text: str, key: str
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert_one_line_naming(str(caught.value), str(path))
    assert key in str(caught.value)
