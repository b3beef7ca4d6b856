"""Redaction: passwords, secrets and control characters never reach an error,
a log record or `check-config`'s output."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from trio_dispatch import (
    open_store,
)
from trio_dispatch.redact import mask_url, scrub, url_secrets, visible
from trio_dispatch.transports import ChildEnvironment, template_warnings

from ..helpers import (
    MASKED,
    PASSWORD,
    arun_cli,
    assert_one_line_error,
    no_secret,
    run_cli,
)


def test_mask_url_hides_passwords_and_nothing_else() -> None:
    assert mask_url(f"postgresql://postgres:{PASSWORD}@127.0.0.1:5432/db") == (
        "postgresql://postgres:***@127.0.0.1:5432/db"
    )
    assert mask_url(f"postgresql://u@h/db?password={PASSWORD}&sslmode=require") == (
        "postgresql://u@h/db?password=***&sslmode=require"
    )
    assert mask_url("postgresql://u@h/db") == "postgresql://u@h/db"
    assert mask_url("/var/lib/outbox.db") == "/var/lib/outbox.db"
    quoted = f'missing "=" after "postgresql://u:{PASSWORD}@h/db" in connection info'
    assert PASSWORD not in scrub(quoted, [PASSWORD])
    assert "***" in scrub(f"password {PASSWORD} rejected", [PASSWORD])
    # Unescaped reserved characters in a password still hide it whole.
    assert mask_url("postgresql://app:s3cr/et@db.example/app") == (
        "postgresql://app:***@db.example/app"
    )
    assert mask_url("postgresql://app:p@ss@host/db") == "postgresql://app:***@host/db"
    assert mask_url("https://example.com:8443/a@b") == "https://example.com:8443/a@b"
    assert mask_url("one postgresql://a:bb@c/d two mysql://e:ff@g") == (
        "one postgresql://a:***@c/d two mysql://e:***@g"
    )
    # A setting that is one URL may hold a space in its password.
    assert mask_url("postgresql://app:s3cr et@host/db") == "postgresql://app:***@host/db"
    assert "s3cr et" in url_secrets("postgresql://app:s3cr et@host/db")
    assert mask_url("postgresql://u@h/db?sslpassword=s3cr") == "postgresql://u@h/db?sslpassword=***"
    # ...but its search for the password's end stops at the next URL.
    assert mask_url("postgresql://host:notaport/db and postgresql://v:p@ss@h2/d") == (
        "postgresql://host:notaport/db and postgresql://v:***@h2/d"
    )


@pytest.mark.parametrize(
    "password",
    ["s3cr3t w0rdz", "s3c@r3t w0rdz", "s3c/r3t w0rdz", "s3c@r3t?x9z", "s3c?x9z=1@r3t"],
)
def test_a_password_libpq_cannot_parse_never_shows_in_an_open_error(password: str) -> None:
    done = run_cli("--db", f"postgresql://postgres:{password}@127.0.0.1:5432/postgres", "ls")
    if "@" in password or "/" in password:  # ambiguous: refused, the URL not even masked
        assert_one_line_error(done, 2, "--db: invalid store URL: its user name or password")
        assert "127.0.0.1" not in done.stderr
    else:
        assert_one_line_error(done, 2, "postgres:***@")
    for piece in password.replace("@", " ").replace("/", " ").replace("?", " ").split():
        piece = piece.removesuffix("=1")
        assert piece not in done.stdout + done.stderr, done.stderr


@pytest.mark.parametrize(
    "store_url",
    [
        "postgresql://app:s3cr/et@db.example/app",
        "postgresql://app:p@ss@host/db",
        "postgresql://app@host/db?password=s3cr%2Fet",
        "postgresql://app:s3cr et@host/db",
        "postgresql://app@host/db?sslpassword=s3cr&sslmode=require",
    ],
)
def test_check_config_hides_passwords_with_reserved_characters(
    tmp_path: Path, store_url: str
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"store": store_url}))
    # libpq itself refuses a space in the password: check-config refuses it
    # too, masked. An unencoded "/" or a second "@" makes the host a guess
    # (libpq reads "app:s3cr" as host and port): refused without the URL.
    ambiguous = "/et@" in store_url or "p@ss@" in store_url
    refused = " " in store_url
    for args in (["check-config", str(config)], ["check-config", str(config), "--json"]):
        done = run_cli(*args)
        if ambiguous:
            line = assert_one_line_error(done, 2, "store: invalid store URL: its user name")
            for fragment in ("app:", "db.example", "host/db", "et@", "ss@"):
                assert fragment not in line, line
        elif refused:
            assert_one_line_error(done, 2, "invalid store URL", "app:***@")
        else:
            assert done.returncode == 0, done.stderr
        for secret in ("s3cr", "p@ss"):
            assert secret not in done.stdout + done.stderr, done.stdout


def test_check_config_masks_the_store_password_in_text_and_json(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(f"store: postgresql://postgres:{PASSWORD}@127.0.0.1:5432/app\n")
    text = run_cli("check-config", str(config))
    as_json = run_cli("check-config", str(config), "--json")
    assert text.returncode == as_json.returncode == 0, text.stderr
    no_secret(text.stdout, text.stderr, as_json.stdout, as_json.stderr)
    assert MASKED in text.stdout
    assert json.loads(as_json.stdout)["store"] == "postgresql://postgres:***@127.0.0.1:5432/app"


@pytest.mark.anyio
async def test_an_unsupported_url_error_masks_its_password() -> None:
    with pytest.raises(ValueError) as info:
        async with open_store(f"mysql://u:{PASSWORD}@h/db"):
            pass
    no_secret(str(info.value))
    assert "mysql://u:***@h/db" in str(info.value)
    done = await arun_cli("--db", f"mysql://u:{PASSWORD}@h/db", "ls")
    assert_one_line_error(done, 2, "mysql://u:***@h/db")
    no_secret(done.stderr)


def test_a_config_path_that_is_not_a_regular_file_is_refused(tmp_path: Path) -> None:
    assert_one_line_error(
        run_cli("check-config", "/dev/zero"), 2, "/dev/zero", "not a regular file"
    )
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * (2 * 1024 * 1024) + "\n")
    assert_one_line_error(run_cli("check-config", str(big)), 2, "larger than")


def test_check_config_warns_about_option_like_placeholders_and_payload_in_argv(
    tmp_path: Path,
) -> None:
    risky = ["python3", "notify.py", "{deliver_to}", "{payload}"]
    warnings = template_warnings(risky)
    assert len(warnings) == 3 and "'--'" in warnings[0] and "cmdline" in warnings[2]
    assert template_warnings(["python3", "notify.py", "--", "{deliver_to}"]) == []
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"dispatch": {"notify_template": risky}}))
    (tmp_path / "notify.py").write_text("")  # present: only the template's risks remain
    done = run_cli("check-config", str(config), "--json")
    assert done.returncode == 0
    assert json.loads(done.stdout)["warnings"] == warnings
    assert done.stderr.count("warning:") == 3


def test_the_env_policy_comes_from_the_configuration(tmp_path: Path) -> None:
    from trio_dispatch.config import load_config

    config = tmp_path / "c.yaml"
    config.write_text("dispatch:\n  env:\n    allow: [PATH, MY_TOKEN]\n")
    assert load_config(config).dispatch.env == ChildEnvironment(allow=("PATH", "MY_TOKEN"))
    config.write_text("dispatch:\n  env:\n    inherit: true\n")
    assert load_config(config).dispatch.env == ChildEnvironment(inherit=True)


def test_visible_keeps_text_and_escapes_controls() -> None:
    assert visible("Grüße, 東京 ✓") == "Grüße, 東京 ✓"
    assert visible("a\nb\x1b[0m\u202e\x00\x85") == "a\\nb\\x1b[0m\\u202e\\x00\\x85"


def test_log_records_of_ours_never_carry_a_registered_secret(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from trio_dispatch.redact import register_secrets, scrubbed_logger

    register_secrets(["hunter2-rotated"])
    logger = scrubbed_logger("trio_dispatch.worker")
    caplog.set_level(logging.INFO, logger="trio_dispatch.worker")
    try:
        raise RuntimeError('cannot connect to "postgresql://app:hunter2-rotated@db/app"')
    except RuntimeError:
        logger.exception("scan failed: %s", "key=hunter2-rotated")
    record = caplog.records[-1]
    text = caplog.text
    assert "hunter2-rotated" not in text and "hunter2-rotated" not in str(record.exc_text)
    assert "scan failed: key=***" in text and "app:***@db" in text
