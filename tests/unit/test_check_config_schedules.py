"""``check-config`` and the ``schedules:`` section (docs/schedules.md): each
schedule shown with its cadence, timezone, missed policy and next fire; a
bad schedule reported as one line naming its dotted key."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import pytest

from ..helpers import assert_one_line_error
from ..helpers import run_cli as cli

GOOD = """\
schedules:
  nightly-report:
    cron: "30 2 * * *"
    timezone: Europe/Berlin
    kind: report.nightly
    deliver_to: reports
    missed: all
    catch_up_seconds: 86400
  every-5m:
    every: 5m
    kind: tick
    deliver_to: ticks
    coalesce_key: ticks
    coalesce: debounce
    coalesce_seconds: 30
    coalesce_max_wait_seconds: 120
"""


def test_check_config_shows_each_schedule_with_its_next_fire(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(GOOD)
    done = cli("check-config", str(config))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    start = lines.index("  schedules: 2")
    nightly, every = lines[start + 1], lines[start + 2]
    assert nightly.startswith("    nightly-report: cron 30 2 * * * (Europe/Berlin), ")
    assert "missed all (catch-up 86400s)" in nightly
    assert re.search(r"next fire \d{4}-\d\d-\d\dT0[01]:30:00Z \(in \d", nightly), nightly
    assert every.startswith("    every-5m: every 5m (UTC), kind tick to ticks, missed latest")
    assert "coalesce debounce by key ticks (30s, at most 120s), next fire" in every
    document = json.loads(cli("check-config", str(config), "--json").stdout)
    shown = {entry["name"]: entry for entry in document["schedules"]}
    assert shown["nightly-report"]["cron"] == "30 2 * * *"
    assert shown["nightly-report"]["timezone"] == "Europe/Berlin"
    assert shown["nightly-report"]["missed"] == "all"
    assert shown["nightly-report"]["next_fire"].endswith(("T01:30:00Z", "T00:30:00Z"))
    five = shown["every-5m"]
    assert (five["cron"], five["every"], five["missed"]) == (None, "5m", "latest")
    assert (five["coalesce_key"], five["coalesce"], five["coalesce_seconds"]) == (
        "ticks",
        "debounce",
        30,
    )
    after = time.time()
    expected = {(math.floor(after / 300) + n) * 300 for n in (1, 2)}
    fire = five["next_fire"]
    assert any(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t)) == fire for t in expected)


def test_check_config_without_schedules_says_none(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("store: o.db\n")
    assert "  schedules: none" in cli("check-config", str(config)).stdout
    assert json.loads(cli("check-config", str(config), "--json").stdout)["schedules"] == []


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        (
            "every: 5s\n    kind: k\n    deliver_to: d\n    bogus: 1",
            ["unknown key 'schedules.nightly.bogus'", "allowed: cron, every"],
        ),
        (
            'cron: "* * * * *"\n    every: 5s\n    kind: k\n    deliver_to: d',
            ["schedules.nightly: set exactly one of cron or every"],
        ),
        ("kind: k\n    deliver_to: d", ["schedules.nightly: set exactly one of cron or every"]),
        (
            'cron: "61 * * * *"\n    kind: k\n    deliver_to: d',
            ["schedules.nightly.cron is not a valid cron expression", "'61 * * * *'"],
        ),
        (
            'cron: "* * * *"\n    kind: k\n    deliver_to: d',
            ["schedules.nightly.cron must have five fields", "'* * * *'"],
        ),
        (
            "every: 5s\n    timezone: Mars/Olympus\n    kind: k\n    deliver_to: d",
            ["schedules.nightly.timezone is not a known IANA time zone", "'Mars/Olympus'"],
        ),
        (
            "every: 5x\n    kind: k\n    deliver_to: d",
            ["schedules.nightly.every must be a duration", "'5x'"],
        ),
        (
            "every: 0s\n    kind: k\n    deliver_to: d",
            ["schedules.nightly.every must be between 1s and 366d", "'0s'"],
        ),
        ("every: 5s\n    deliver_to: d", ["schedules.nightly.kind is required"]),
        ("every: 5s\n    kind: k", ["schedules.nightly.deliver_to is required"]),
        (
            "every: 5s\n    kind: k\n    deliver_to: d\n    missed: never",
            ["schedules.nightly.missed must be one of skip, latest, all", "'never'"],
        ),
        (
            "every: 5s\n    kind: k\n    deliver_to: d\n    coalesce: replace",
            ["schedules.nightly.coalesce='replace' needs a coalesce_key"],
        ),
        (
            "every: 5s\n    kind: k\n    deliver_to: d\n    coalesce_key: k\n"
            "    coalesce: debounce\n    coalesce_seconds: 60\n    coalesce_max_wait_seconds: 5",
            ["schedules.nightly.coalesce_max_wait_seconds=5 must be at least coalesce_seconds=60"],
        ),
    ],
    ids=[
        "unknown-key",
        "cron-and-every",
        "neither",
        "bad-cron",
        "four-fields",
        "bad-timezone",
        "bad-every",
        "zero-every",
        "missing-kind",
        "missing-deliver-to",
        "bad-missed",
        "coalesce-without-key",
        "max-wait-below-debounce",
    ],
)
def test_a_bad_schedule_is_one_line_naming_its_dotted_key(
    tmp_path: Path, fields: str, words: list[str]
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(f"store: o.db\nschedules:\n  nightly:\n    {fields}\n")
    line = assert_one_line_error(cli("check-config", str(config)), 2, str(config), *words)
    assert "Traceback" not in line
    as_json = cli("check-config", str(config), "--json")
    assert as_json.returncode == 2
    document = json.loads(as_json.stdout)
    assert document["valid"] is False and len(document["errors"]) == 1
    assert words[0] in document["errors"][0]
    # every other command that reads the file refuses it the same way
    assert_one_line_error(cli("--config", str(config), "schedules"), 2, words[0])


def test_check_config_reports_every_bad_schedule_at_once(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        "store: o.db\nworker:\n  concurrency: many\nschedules:\n"
        "  a:\n    every: 0s\n    kind: k\n    deliver_to: d\n"
        "  good:\n    every: 5s\n    kind: k\n    deliver_to: d\n"
        "  b:\n    cron: '* * * *'\n    kind: k\n    deliver_to: d\n"
    )
    line = assert_one_line_error(
        cli("check-config", str(config)),
        2,
        "worker.concurrency",
        "schedules.a.every must be between",
        "schedules.b.cron must have five fields",
    )
    assert line.count(";") == 2
    document = json.loads(cli("check-config", str(config), "--json").stdout)
    assert sorted(error.split()[0] for error in document["errors"]) == [
        "schedules.a.every",
        "schedules.b.cron",
        "worker.concurrency",
    ]


def test_a_schedule_body_is_held_to_the_configured_body_limit(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    body = "{text: " + "x" * 200 + "}"
    schedule = (
        f"schedules:\n  big:\n    every: 5s\n    kind: k\n    deliver_to: d\n    body: {body}\n"
    )
    config.write_text(f"store: o.db\ndispatch:\n  max_body_bytes: 100\n{schedule}")
    words = [
        "schedules.big.body is 212 bytes of JSON, over the limit of 100 bytes "
        "(dispatch.max_body_bytes)"
    ]
    assert_one_line_error(cli("check-config", str(config)), 2, str(config), *words)
    document = json.loads(cli("check-config", str(config), "--json").stdout)
    assert document["valid"] is False and document["errors"] == words
    # every command that reads the file refuses it the same way (the worker too)
    assert_one_line_error(cli("--config", str(config), "schedules"), 2, words[0])
    assert_one_line_error(cli("--config", str(config), "worker"), 2, words[0])
    # Under a limit it fits, the same schedule is what the worker takes.
    config.write_text(f"store: o.db\ndispatch:\n  max_body_bytes: 212\n{schedule}")
    done = cli("check-config", str(config))
    assert done.returncode == 0, done.stderr
