"""What a newcomer meets first: the deployment launcher, relative paths in a
configuration file, the warnings of check-config and the worker's log."""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import anyio
import pytest

from trio_dispatch import Delivery, TransportResult, enqueue_dispatch, open_store
from trio_dispatch.config import load_config
from trio_dispatch.store import SQLiteStore
from trio_dispatch.worker import DispatchWorker

from ..conftest import RawDB
from ..helpers import assert_one_line_error, run_cli, statuses, wait_for

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "trio_dispatch"]


def _checkout_copy(tmp_path: Path) -> Path:
    """The launchers and the example configuration in a folder of their own,
    sharing this checkout's installed .venv (the test extras hold every
    runtime extra, so the launcher installs nothing)."""
    stamp = ROOT / ".venv" / ".trio_dispatch-installed-test"
    if not stamp.is_file() or (ROOT / "pyproject.toml").stat().st_mtime > stamp.stat().st_mtime:
        if os.environ.get("CI") == "true":  # .ci/run installs it: never skip there
            pytest.fail("the .venv that ./scripts/test installs is missing or stale")
        pytest.skip("needs the .venv that ./scripts/test installs")
    checkout = tmp_path / "checkout"
    shutil.copytree(ROOT / "scripts", checkout / "scripts")
    for name in ("config.example.yaml", "pyproject.toml"):
        shutil.copy2(ROOT / name, checkout / name)  # keeps pyproject's time: no reinstall
    (checkout / ".venv").symlink_to(ROOT / ".venv")
    return checkout


def test_the_documented_deployment_command_starts_the_worker_and_delivers(
    tmp_path: Path,
) -> None:
    """`scripts/worker --config FILE`, as the README gives it, run in the
    service's own folder: the launcher bootstraps without taking `--config`
    for an extra, FILE is the caller's (not the checkout's), the worker
    delivers through the example's relative template, and Ctrl-C stops it
    cleanly."""
    checkout = _checkout_copy(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "scripts").mkdir(parents=True)
    shutil.copy2(ROOT / "config.example.yaml", elsewhere / "config.example.yaml")
    shutil.copy2(ROOT / "scripts" / "demo_transport.py", elsewhere / "scripts")
    worker = subprocess.Popen(
        [str(checkout / "scripts" / "worker"), "--config", "config.example.yaml"],
        cwd=elsewhere,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    try:
        assert worker.stdout is not None
        for line in worker.stdout:
            lines.append(line)
            if "worker started" in line:
                break
        assert any("worker started" in line for line in lines), "".join(lines)
        assert f"{elsewhere / 'outbox.db'} " in lines[-1], lines[-1]

        async def enqueue() -> str:
            async with open_store(str(elsewhere / "outbox.db")) as db:
                return await enqueue_dispatch(
                    db, kind="build_finished", deliver_to="seat-1", body={"build": 1}
                )

        dispatch_id = anyio.run(enqueue)
        for line in worker.stdout:
            lines.append(line)
            if dispatch_id in line:
                break
        worker.send_signal(signal.SIGINT)
        rest, _ = worker.communicate(timeout=30)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    text = "".join(lines) + rest
    assert worker.returncode == 0, text
    assert "InvalidRequirement" not in text
    outcome = next(line for line in lines if dispatch_id in line)
    assert "deliver_to=seat-1" in outcome and "result=delivered" in outcome, text
    assert "output='delivered build_finished to seat-1: {'build': 1}'" in outcome.replace('"', "'")
    assert "worker stopped" in text
    assert not (checkout / "outbox.db").exists()


def test_a_missing_configuration_is_named_by_the_path_looked_at(tmp_path: Path) -> None:
    """From another folder, the launcher looks for a relative --config in
    the caller's folder and says where; so does the command itself, and a
    missing store or ./trio-dispatch.yaml are named whole too."""
    checkout = _checkout_copy(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    launched = subprocess.run(
        [str(checkout / "scripts" / "worker"), "--config", "trio-dispatch.yaml"],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=120,
    )
    wanted = elsewhere / "trio-dispatch.yaml"
    assert_one_line_error(launched, 2, "trio-dispatch.yaml: config file not found", f"{wanted})")
    # The command itself, in this process (a relative path is the working
    # folder's either way).
    done = run_cli("--config", "nothere.yaml", "ls", cwd=elsewhere)
    assert_one_line_error(done, 2, f"no file at {elsewhere / 'nothere.yaml'})")
    done = run_cli("ls", cwd=elsewhere)
    assert_one_line_error(done, 2, f"{elsewhere / 'trio-dispatch.yaml'} (not found)")
    done = run_cli("--db", "outbox.db", "ls", cwd=elsewhere)
    assert_one_line_error(done, 2, "does not exist", f"no file at {elsewhere / 'outbox.db'})")


SECRETS_BY_VARIABLE = """\
store: outbox.db
http:
  listen: 127.0.0.1:0
  token: env:TD_TEST_VIEWER_TOKEN
  operator_token: env:TD_TEST_OPERATOR_TOKEN
dispatch:
  transport: webhook
  webhook:
    endpoints:
      billing:
        url: https://billing.example.com/hooks
        secrets: [env:TD_TEST_HOOK_SECRET]
"""


def test_store_commands_need_no_dashboard_token_or_webhook_secret(tmp_path: Path) -> None:
    """Only the commands that serve the dashboard or sign read the secrets
    a configuration names as env:NAME: ls works where the worker's
    variables are not set, and the worker still refuses to start without
    them."""
    (tmp_path / "trio-dispatch.yaml").write_text(SECRETS_BY_VARIABLE)
    assert not {"TD_TEST_VIEWER_TOKEN", "TD_TEST_HOOK_SECRET"} & set(os.environ)
    # In this process (what is read is the configuration, in the folder's
    # environment): six interpreters' starts took 3 s of CPU.
    done = run_cli("migrate", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    done = run_cli("ls", cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "no dispatches", done.stderr
    done = run_cli("stats", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for command in (["worker"], ["web"], ["check-config"]):
        done = run_cli(*command, cwd=tmp_path)
        assert done.returncode == 2, (command, done.stdout, done.stderr)
        assert "'TD_TEST_VIEWER_TOKEN' is not set" in done.stderr, (command, done.stderr)
    assert "'TD_TEST_HOOK_SECRET' is not set" in done.stderr  # check-config names them all


def test_bootstrap_refuses_to_be_sourced_without_its_argument(tmp_path: Path) -> None:
    checkout = _checkout_copy(tmp_path)
    done = subprocess.run(
        ["bash", "-c", "set -- --config x.yaml; source scripts/bootstrap.sh", "launcher"],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "exactly one argument" in done.stderr
    bad = subprocess.run(
        ["bash", "-c", "source scripts/bootstrap.sh --config"],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode == 2 and "'--config'" in bad.stderr


# -- relative paths are taken from the configuration file's folder ----------


def _write_config(folder: Path, template: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "trio-dispatch.yaml"
    path.write_text(
        f"store: outbox.db\ndispatch:\n  notify_template: {template}\n"
        "worker:\n  tick_seconds: 3600\n"
    )
    return path


@pytest.mark.anyio
async def test_a_relative_template_path_is_taken_from_the_config_folder(tmp_path: Path) -> None:
    """The worker runs the command in the configuration file's folder, as it
    opens the store there, whatever directory the process started in."""
    folder = tmp_path / "service"
    config_path = _write_config(
        folder, f'[{sys.executable}, bin/notify.py, "--", "{{deliver_to}}"]'
    )
    (folder / "bin").mkdir()
    (folder / "bin" / "notify.py").write_text(
        "import os, sys\nsys.stdin.read()\nprint(os.getcwd(), sys.argv[1])\n"
    )
    assert Path.cwd() != folder
    config = load_config(config_path)
    assert config.transport_warnings() == []
    async with open_store(config.store_target()) as db, anyio.create_task_group() as tg:
        worker = DispatchWorker.from_config(db, config)
        await tg.start(worker.run)
        dispatch_id = await enqueue_dispatch(db, kind="k", deliver_to="seat-9")
        raw = RawDB(folder / "outbox.db")
        await wait_for(lambda: raw.row(dispatch_id)["status"] != "pending", timeout=15)
        await wait_for(lambda: raw.row(dispatch_id)["status"] != "delivering", timeout=15)
        tg.cancel_scope.cancel()
    assert raw.row(dispatch_id)["status"] == "delivered", raw.row(dispatch_id)["last_error"]


@pytest.mark.slow
def test_check_config_warns_when_the_program_or_script_does_not_exist(tmp_path: Path) -> None:
    folder = tmp_path / "service"
    missing_script = _write_config(folder, '[python3, bin/gone.py, "--", "{deliver_to}"]')
    done = subprocess.run(
        [*CLI, "check-config", str(missing_script)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert (
        f"warning: notify_template[1] 'bin/gone.py' does not exist (relative paths are "
        f"taken from {folder})" in done.stderr
    )
    missing_program = _write_config(folder, '[./notify-nowhere, "--", "{deliver_to}"]')
    done = subprocess.run(
        [*CLI, "check-config", str(missing_program)], capture_output=True, text=True, timeout=60
    )
    assert "notify_template[0] './notify-nowhere' does not exist" in done.stderr
    not_on_path = _write_config(folder, '[no-such-notifier-xyz, "--", "{deliver_to}"]')
    done = subprocess.run(
        [*CLI, "check-config", str(not_on_path)], capture_output=True, text=True, timeout=60
    )
    assert "notify_template[0] 'no-such-notifier-xyz' is not found on PATH" in done.stderr
    present = _write_config(folder, f'[{sys.executable}, "-c", "pass", "--", "{{deliver_to}}"]')
    done = subprocess.run(
        [*CLI, "check-config", str(present)], capture_output=True, text=True, timeout=60
    )
    assert "warning" not in done.stderr


def test_the_example_configuration_checks_clean_from_any_directory(tmp_path: Path) -> None:
    done = subprocess.run(
        [*CLI, "check-config", str(ROOT / "config.example.yaml")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    assert "warning" not in done.stderr


# -- the worker's log line ----------------------------------------------------


@pytest.mark.anyio
async def test_each_outcome_line_names_the_route_and_a_retry_says_when_it_is_due(
    store: SQLiteStore, raw: RawDB, caplog: pytest.LogCaptureFixture
) -> None:
    async def send(delivery: Delivery) -> TransportResult:
        if delivery.deliver_to == "ok":
            return TransportResult.success(output="sent \x1b[31m fine")
        return TransportResult.failure("down")

    caplog.set_level(logging.INFO, logger="trio_dispatch.worker")
    async with anyio.create_task_group() as tg:
        worker = DispatchWorker(store, transport=send, tick_seconds=3600, retry_schedule=[90])
        await tg.start(worker.run)
        ok = await enqueue_dispatch(store, kind="k", deliver_to="ok")
        later = await enqueue_dispatch(store, kind="k", deliver_to="flaky")
        dead = await enqueue_dispatch(store, kind="k", deliver_to="gone", max_attempts=1)
        await wait_for(lambda: statuses(raw) == {"delivered": 1, "pending": 1, "dead_letter": 1})
        tg.cancel_scope.cancel()
    records = {
        dispatch_id: next(
            r for r in caplog.records if r.getMessage().startswith(f"dispatch {dispatch_id}")
        )
        for dispatch_id in (ok, later, dead)
    }
    delivered = records[ok].getMessage()
    assert records[ok].levelno == logging.INFO
    assert "deliver_to=ok" in delivered and "result=delivered" in delivered
    assert "output='sent \\x1b[31m fine'" in delivered  # escapes made visible
    retry = records[later]
    assert retry.levelno == logging.WARNING
    message = retry.getMessage()
    assert "deliver_to=flaky" in message and "result=retry" in message
    due = raw.row(later)["next_attempt_at"]
    stamp = re.search(r"next_attempt=(\S+) next_in=90s", message)
    assert stamp is not None, message
    logged = datetime.strptime(stamp.group(1), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    assert abs(logged.timestamp() - due) < 2
    assert records[dead].levelno == logging.WARNING
    assert "result=dead_letter" in records[dead].getMessage()
    assert time.time() < due
