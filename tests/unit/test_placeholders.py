"""The portable SQL's ``?`` placeholders in each driver's style: never
inside a literal, a quoted name or a comment; ``%`` doubled for psycopg."""

from __future__ import annotations

import pytest

from trio_dispatch.store.dialect import Typed
from trio_dispatch.store.pg_session import placeholders as _placeholders
from trio_dispatch.store.placeholders import to_paramstyle

SQL = "SELECT ? FROM t WHERE a = '?' AND \"b?\" = ? -- ?\n AND c LIKE '5%' AND d = $$?$$"


@pytest.mark.parametrize(
    ("style", "binary", "expected"),
    [
        ("qmark", False, SQL),
        (
            "format",
            False,
            "SELECT %s FROM t WHERE a = '?' AND \"b?\" = %s -- ?\n AND c LIKE '5%%' AND d = $$?$$",
        ),
        (
            "format",
            True,
            "SELECT %b FROM t WHERE a = '?' AND \"b?\" = %b -- ?\n AND c LIKE '5%%' AND d = $$?$$",
        ),
        (
            "numeric_dollar",
            False,
            "SELECT $1 FROM t WHERE a = '?' AND \"b?\" = $2 -- ?\n AND c LIKE '5%' AND d = $$?$$",
        ),
    ],
)
def test_each_style_rewrites_only_the_placeholders(style: str, binary: bool, expected: str) -> None:
    assert to_paramstyle(SQL, style, binary) == expected


def test_a_typed_statement_sends_binary_and_a_plain_one_text_however_they_compare() -> None:
    # Equal strings: the cache must not hand one's form to the other.
    plain = "UPDATE t SET a = ?::text[]"
    assert _placeholders(Typed(plain)) == "UPDATE t SET a = %b::text[]"
    assert _placeholders(plain) == "UPDATE t SET a = %s::text[]"
    assert _placeholders(Typed(plain)) == "UPDATE t SET a = %b::text[]"


def test_an_unknown_style_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="'named'"):
        to_paramstyle("SELECT ?", "named")


def test_qmark_placeholders_named_as_text_are_cast_and_literals_are_left_alone() -> None:
    sql = "UPDATE t SET a = ? WHERE b = '?' AND id = ? AND c = ?"
    assert to_paramstyle(sql, "qmark", as_text=frozenset({1})) == (
        "UPDATE t SET a = ? WHERE b = '?' AND id = CAST(? AS TEXT) AND c = ?"
    )
    assert to_paramstyle(sql, "qmark") is sql
