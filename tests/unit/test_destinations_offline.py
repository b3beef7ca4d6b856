"""Destinations without a store (docs/destinations.md): ``check-config`` shows
the ``destinations:`` section ("*" first) and names each bad policy by its
dotted key, one problem each; the starts a rate admits; the command's
argument checks, which refuse a bad value before any store is opened."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trio_dispatch.destinations import Destination, parse_destinations
from trio_dispatch.destinations.listing import policy_text, starts_available
from trio_dispatch.errors import ConfigError

from ..helpers import assert_one_line_error
from ..helpers import run_cli as cli

GOOD = """\
store: outbox.db
destinations:
  billing:
    rate: 50/s
    burst: 10
    concurrency: 4
    breaker: {failures: 5, cool_down_seconds: 30, disable_after_seconds: 600}
  "*":
    concurrency: 8
  mailer: {}
"""


def test_check_config_shows_each_destination_policy_defaults_first(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(GOOD)
    done = cli("check-config", str(config))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    start = lines.index("  destinations: 3")
    assert lines[start + 1 : start + 4] == [
        '    "*" (every other deliver_to): rate none, concurrency 8, throttle_max 3600s, '
        "breaker off",
        "    billing: rate 50/s burst 10, concurrency 4, throttle_max 3600s, breaker 5 "
        "failures in a row over >= 60s, cool-down 30s up to 3600s, disabled after 600s open",
        "    mailer: rate none, concurrency none, throttle_max 3600s, breaker off",
    ]
    document = json.loads(cli("check-config", str(config), "--json").stdout)
    shown = document["destinations"]
    assert list(shown) == ["*", "billing", "mailer"]
    assert shown["billing"]["rate"] == "50/s" and shown["billing"]["burst"] == 10
    assert shown["billing"]["breaker"]["disable_after_seconds"] == 600
    assert shown["*"] == {
        "concurrency": 8,
        "rate": None,
        "burst": 1,
        "throttle_max_seconds": 3600.0,
        "breaker": None,
    }


def test_check_config_without_destinations_says_none(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("store: outbox.db\n")
    done = cli("check-config", str(config))
    assert "  destinations: none (no shared limits)" in done.stdout.splitlines()
    assert json.loads(cli("check-config", str(config), "--json").stdout)["destinations"] == {}


def test_each_bad_policy_is_its_own_problem_naming_its_dotted_key(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        "store: outbox.db\n"
        "destinations:\n"
        '  "*": {concurrency: 0}\n'
        "  billing: {rate: 5/d}\n"
        "  mailer: {breaker: {failures: 3, cooldown: 5}}\n"
        "  ok: {rate: 1/s}\n"
    )
    done = cli("check-config", str(config), "--json")
    assert done.returncode == 2
    errors = json.loads(done.stdout)["errors"]
    assert len(errors) == 3
    assert errors[0].startswith("destinations.*.concurrency must be an integer from 1")
    assert errors[1].startswith("destinations.billing.rate must be a count per second")
    assert errors[2].startswith("destinations.mailer.breaker: unknown setting 'cooldown'")
    assert_one_line_error(cli("check-config", str(config)), 2, "destinations.billing.rate")


def test_one_bad_policy_raises_as_before_and_several_a_config_error() -> None:
    with pytest.raises(ValueError, match=r"^destinations\.a\.burst must be") as one:
        parse_destinations({"a": {"burst": 0}})
    assert not isinstance(one.value, ConfigError)
    with pytest.raises(ConfigError) as several:
        parse_destinations({"a": {"burst": 0}, "b": {"rate": "x"}})
    assert [problem.split(" ")[0] for problem in several.value.problems] == [
        "destinations.a.burst",
        "destinations.b.rate",
    ]


@pytest.mark.parametrize(
    ("tat", "expected"),
    [
        (None, 10),  # never started: the whole burst
        (1000.0 - 5, 10),  # idle since: the whole burst
        (1000.0, 10),  # the rate has caught up just now
        (1000.0 + 0.1, 9),  # one start ahead (10/s: one interval is 0.1 s)
        (1000.0 + 0.95, 0),  # more than burst - 1 intervals ahead: 0.05 s short of one
        (1000.0 + 1.0, 0),  # the whole burst spent
        (1000.0 + 30, 0),  # never below zero
    ],
)
def test_starts_available_follows_the_gcra(tat: float | None, expected: int) -> None:
    policy = Destination(rate="10/s", burst=10)
    assert starts_available(policy, tat, 1000.0) == expected


def test_starts_available_is_none_without_a_rate() -> None:
    assert starts_available(Destination(concurrency=2), 5.0, 1.0) is None
    assert policy_text(Destination()) == (
        "rate none, concurrency none, throttle_max 3600s, breaker off"
    )


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["destinations", "pause", "*"], ["'*' names the defaults"]),
        (["destinations", "pause", "a\x1bb"], ["deliver_to must not contain control", "\\x1b"]),
        (["destinations", "pause", "b", "--for", "soon"], ["invalid duration 'soon'"]),
        (["destinations", "pause", "b", "--for", "0"], ["invalid duration '0'", "at least 1ms"]),
        (["destinations", "pause", "b", "--until", "tomorrow"], ["invalid time 'tomorrow'"]),
        (
            ["destinations", "pause", "b", "--until", "2030-01-01T10:00"],
            ["no UTC offset", "2030-01-01T10:00"],
        ),
        (
            ["destinations", "pause", "b", "--until", "2001-01-01T10:00Z"],
            ["'2001-01-01T10:00Z'", "not in the future"],
        ),
        (
            ["destinations", "pause", "b", "--for", "1h", "--until", "2030-01-01T10:00Z"],
            ["not allowed with argument"],
        ),
        (["destinations", "show", "b", "--reason", "x"], ["unrecognized arguments"]),
        (["destinations", "stop", "b"], ["invalid choice: 'stop'"]),
    ],
)
def test_a_bad_argument_is_one_line_and_exit_2_before_any_store_opens(
    tmp_path: Path, argv: list[str], words: list[str]
) -> None:
    # The store named does not exist: an argument error must come first.
    done = cli("--db", str(tmp_path / "absent.db"), *argv)
    assert_one_line_error(done, 2, *words)
    assert not (tmp_path / "absent.db").exists()
