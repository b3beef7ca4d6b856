"""The command line without a store: help, usage errors, `check-config` and
the way it shows durations and times."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from trio_dispatch.cli import build_parser, parse_duration, relative_time
from trio_dispatch.config import ConfigError, parse_config

from ..helpers import assert_one_line_error, run_cli
from ..helpers import run_cli as cli


def test_a_missing_store_is_an_error_naming_what_was_tried_and_creates_nothing(
    tmp_path: Path,
) -> None:
    done = cli("ls", cwd=tmp_path)
    assert_one_line_error(done, 2, "--db", "--config", "TRIO_DISPATCH_CONFIG", "trio-dispatch.yaml")
    missing = tmp_path / "missing.db"
    assert_one_line_error(cli("--db", str(missing), "stats"), 2, str(missing), "does not exist")
    config = tmp_path / "c.yaml"
    config.write_text("store: nowhere.db\n")
    assert_one_line_error(cli("--config", str(config), "ls"), 2, "nowhere.db", str(config))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]


def test_a_bad_config_file_is_a_one_line_error_naming_the_key(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("store: x.db\nworker:\n  concurrency: many\n")
    assert_one_line_error(cli("--config", str(config), "ls"), 2, "worker.concurrency", "'many'")
    assert_one_line_error(cli("check-config", str(config)), 2, "worker.concurrency")
    assert_one_line_error(cli("--config", str(tmp_path / "nope.yaml"), "ls"), 2, "nope.yaml")


def test_check_config_accepts_the_example_file() -> None:
    example = Path(__file__).resolve().parents[2] / "config.example.yaml"
    done = cli("check-config", str(example), "--json")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["valid"] is True
    assert document["notify_template"][1:3] == ["scripts/demo_transport.py", "--"]
    assert document["warnings"] == []


def test_durations_and_relative_times() -> None:
    assert [parse_duration(t) for t in ("90", "45s", "30m", "12h", "7d", "2w", "1.5h")] == [
        90,
        45,
        1800,
        43200,
        604800,
        1209600,
        5400,
    ]
    assert [relative_time(t, 1000.0) for t in (1000.4, 1065.0, 940.0, 1000.0 + 7200)] == [
        "now",
        "in 1m05s",
        "1m00s ago",
        "in 2h00m",
    ]
    assert relative_time(None, 0) == "-"


def test_every_argument_and_default_has_help() -> None:
    parser = build_parser()
    subparsers = next(
        a for a in parser._actions if isinstance(a, argparse._SubParsersAction)
    ).choices
    for name, sub in [("trio-dispatch", parser), *subparsers.items()]:
        for action in sub._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            label = f"{name} {action.dest}"
            assert action.help, label
            optional_value = action.option_strings and action.nargs != 0
            if optional_value or action.nargs == "?":
                # what happens when it is left out
                assert "default" in action.help or "unless" in action.help, label
    help_text = cli("ack", "--help").stdout
    assert "unique" in help_text or "only it starts with" in help_text


def test_check_config_reports_every_problem_at_once(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("stor: x.db\nworker:\n  concurrency: many\n  tick_seconds: -1\n")
    line = assert_one_line_error(
        cli("check-config", str(config)), 2, "'stor'", "worker.concurrency", "worker.tick_seconds"
    )
    assert line.count(";") == 2
    as_json = cli("check-config", str(config), "--json")
    assert as_json.returncode == 2 and len(as_json.stderr.splitlines()) == 1
    document = json.loads(as_json.stdout)
    assert document["valid"] is False and len(document["errors"]) == 3
    assert [e.split()[0] for e in document["errors"]] == [
        "unknown",
        "worker.tick_seconds",
        "worker.concurrency",
    ] or [e.split()[0] for e in document["errors"]] == [
        "unknown",
        "worker.concurrency",
        "worker.tick_seconds",
    ]


def test_check_config_shows_the_retry_schedule_and_worker_settings(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        "dispatch:\n  notify_template: [echo]\n  retry_schedule: [5, 300]\n"
        "worker:\n  concurrency: 3\n  tick_seconds: 7\n  per_destination_concurrency: 2\n"
    )
    done = cli("check-config", str(config))
    assert done.returncode == 0 and done.stderr == ""
    assert "  retry_schedule: 5s, 300s (the last repeats)" in done.stdout
    worker = next(line for line in done.stdout.splitlines() if line.startswith("  worker:"))
    for part in ("tick 7s", "concurrency 3", "batch_size 100", "grace 5s"):
        assert part in worker, worker
    assert "per_destination_concurrency 2" in worker
    default = tmp_path / "d.yaml"
    default.write_text("dispatch:\n  notify_template: [echo]\n")
    shown = cli("check-config", str(default)).stdout
    assert "retry_schedule: not set: min(30 * 2^attempt, 1800)s" in shown
    assert "  priority_step_seconds: 300s (a row of priority p goes as if due p x 300s" in shown
    minute = tmp_path / "m.yaml"
    minute.write_text("dispatch:\n  notify_template: [echo]\n  priority_step_seconds: 60\n")
    assert "  priority_step_seconds: 60s" in cli("check-config", str(minute)).stdout
    document = json.loads(cli("check-config", str(minute), "--json").stdout)
    assert document["priority_step_seconds"] == 60


def test_the_operator_token_is_shown_masked_and_must_differ_from_the_viewers(
    tmp_path: Path,
) -> None:
    viewer, operator = "viewer-token-0123456789", "operator-token-0123456789"
    config = tmp_path / "c.yaml"
    config.write_text(f"http:\n  token: {viewer}\n  operator_token: {operator}\n")
    text = run_cli("check-config", str(config))
    assert "operator_token set (operators may act)" in text.stdout
    assert operator not in text.stdout + text.stderr and viewer not in text.stdout
    assert json.loads(run_cli("check-config", "--json", str(config)).stdout)["http"][
        "operator_token"
    ]
    same = tmp_path / "same.yaml"
    same.write_text(f"http:\n  token: {viewer}\n  operator_token: {viewer}\n")
    refused = run_cli("check-config", str(same))
    assert refused.returncode == 2 and "http.operator_token must differ" in refused.stderr
    assert viewer not in refused.stdout + refused.stderr
    short = tmp_path / "short.yaml"
    short.write_text("http:\n  operator_token: short\n")
    refused = run_cli("check-config", str(short))
    assert "http.operator_token (***) must be at least 16" in refused.stderr


def test_http_max_connections_defaults_to_64_and_is_validated() -> None:
    assert parse_config(None).http.max_connections == 64
    assert parse_config({"http": {"max_connections": 5}}).http.max_connections == 5
    for bad in (0, -1, 10_001, "64", True, 2.5):
        with pytest.raises(ConfigError, match=r"http\.max_connections must be a whole number"):
            parse_config({"http": {"max_connections": bad}})


def test_check_config_reports_the_hosts_the_dashboard_answers_to(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("store: o.db\nhttp:\n  listen: 127.0.0.1:9464\n")
    text = run_cli("check-config", str(config))
    assert text.stdout.count("allowed_hosts") == 1
    assert (
        "allowed_hosts the listener's own: localhost:9464, 127.0.0.1:9464, [::1]:9464"
    ) in text.stdout
    config.write_text(
        "store: o.db\nhttp:\n  listen: 127.0.0.1:9464\n"
        "  allowed_hosts: [Dash.Example.com, '10.0.0.5:9464']\n"
    )
    text = run_cli("check-config", str(config))
    assert "max_connections 64, allowed_hosts dash.example.com, 10.0.0.5:9464" in text.stdout
    data = json.loads(run_cli("check-config", "--json", str(config)).stdout)
    assert data["http"]["allowed_hosts"] == ["dash.example.com", "10.0.0.5:9464"]
    config.write_text("store: o.db\nhttp:\n  allowed_hosts: [dash.example.com/admin]\n")
    refused = run_cli("check-config", str(config))
    assert_one_line_error(refused, 2, "http.allowed_hosts", "'dash.example.com/admin'")


def test_check_config_reports_http_max_connections(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("store: o.db\nhttp:\n  listen: 127.0.0.1:9464\n  max_connections: 12\n")
    text = run_cli("check-config", str(config))
    assert text.returncode == 0, text.stderr
    assert (
        "  http: listen 127.0.0.1:9464, token none, operator_token none (read-only), "
        "max_connections 12"
    ) in text.stdout
    data = run_cli("check-config", "--json", str(config))
    assert json.loads(data.stdout)["http"] == {
        "listen": "127.0.0.1:9464",
        "token": False,
        "operator_token": False,
        "max_connections": 12,
        "allowed_hosts": None,
    }
    bad = tmp_path / "bad.yaml"
    bad.write_text("http:\n  max_connections: 0\n  listen: nowhere\n")
    both = run_cli("check-config", "--json", str(bad))
    errors = json.loads(both.stdout)["errors"]
    assert any("http.max_connections" in error for error in errors)
    assert any("http.listen" in error for error in errors)  # every problem at once
    assert not (tmp_path / "o.db").exists()


def test_web_help_says_what_each_role_may_do() -> None:
    done = cli("web", "--help")
    text = " ".join(done.stdout.split())
    assert done.returncode == 0
    assert "read-only dashboard" not in text
    assert "With http.operator_token an operator may also act" in text
    assert "without one the store is opened read-only and nobody can change anything" in text
    listing = " ".join(cli("--help").stdout.split())
    assert "serve the dashboard (viewers read; with http.operator_token, operators act)" in listing
