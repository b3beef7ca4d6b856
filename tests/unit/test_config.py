"""The config file: strict validation, safe loading, lookup order, and the
never-raising transport template reader."""

from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from trio_dispatch.config import (
    CONFIG_ENV_VAR,
    DEFAULT_CONFIG_NAME,
    WORKER_KEYS,
    Config,
    ConfigError,
    DispatchConfig,
    HttpConfig,
    find_config_path,
    load_config,
    parse_config,
    resolve_notify_template,
)
from trio_dispatch.schedules.spec import ENQUEUE_FIELDS
from trio_dispatch.settings import WorkerSettings
from trio_dispatch.transports.plugins import transport_plugins

EXAMPLE = Path(__file__).resolve().parents[2] / "config.example.yaml"
TEMPLATE = ["python3", "scripts/demo_transport.py", "--", "{deliver_to}"]


def write(directory: Path, text: str, name: str = "config.yaml") -> Path:
    path = directory / name
    path.write_text(text, encoding="utf-8")
    return path


def config_error(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: ")
    return message


# --- defaults and accepted values ---------------------------------------------


@pytest.mark.parametrize("text", ["", "# only a comment\n", "dispatch:\nworker: null\n"])
def test_empty_file_and_empty_sections_mean_defaults(tmp_path: Path, text: str) -> None:
    config = load_config(write(tmp_path, text))
    assert config == Config(
        store="outbox.db",
        durability="full",
        busy_timeout_seconds=10.0,
        dispatch=DispatchConfig(),
        worker=WorkerSettings(
            tick_seconds=30.0,
            concurrency=16,
            batch_size=100,
            grace_seconds=5.0,
            retry_jitter=0.0,
            listen=True,
            timeout_seconds=10.0,
            retry_schedule=None,
            ordering_on_dead_letter="block",
            # A file says the step, 300 unless set (the library's None
            # leaves the store's alone).
            priority_step_seconds=300.0,
        ),
        http=HttpConfig(),
        log_level="INFO",
        path=tmp_path / "config.yaml",
    )


def test_parse_config_of_none_is_defaults_without_path() -> None:
    config = parse_config(None)
    assert config.path is None
    assert config.worker.concurrency == 16
    assert config.store_target() == "outbox.db"


def test_example_file_loads_and_its_values_are_the_defaults() -> None:
    config = load_config(EXAMPLE)
    assert config.dispatch.notify_template == tuple(TEMPLATE)
    # Apart from the template (no default), the example documents the defaults.
    defaults = parse_config(None)
    assert config.worker == defaults.worker
    assert config.dispatch.timeout_seconds == defaults.dispatch.timeout_seconds
    assert (config.store, config.durability, config.log_level) == (
        defaults.store,
        defaults.durability,
        defaults.log_level,
    )


def test_example_file_documents_every_key() -> None:
    raw = yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))
    top = {f.name for f in fields(Config)} - {"path"}
    assert set(raw) == top
    plugins = transport_plugins().values()
    # The worker's settings written under dispatch (on_dead_letter as the
    # ordering section's key).
    settings = {key.split(".")[1] for key in WORKER_KEYS if key.startswith("dispatch.")}
    assert settings == {"retry_schedule", "ordering", "priority_step_seconds"}
    shared = {f.name for f in fields(DispatchConfig)} - {"transports"} | settings
    assert raw["dispatch"]["ordering"] == {"on_dead_letter": "block"}
    schedules_text = EXAMPLE.read_text(encoding="utf-8").split("schedules:", 1)[1]
    for key in ("cron", "every", "timezone", "kind", "deliver_to", "body", "missed"):
        assert f"{key}:" in schedules_text or f"or {key}" in schedules_text, key
    for key in ("catch_up_seconds", "jitter_seconds", *ENQUEUE_FIELDS):
        assert f"{key}:" in schedules_text, key
    own = {key for plugin in plugins if plugin.section is None for key in plugin.options}
    sections = {plugin.section for plugin in plugins if plugin.section is not None}
    assert set(raw["dispatch"]) == shared | own | sections
    for plugin in plugins:
        if plugin.section is not None:
            assert set(raw["dispatch"][plugin.section]) == set(plugin.options), plugin.name
    assert {f"worker.{key}" for key in raw["worker"]} == {
        key for key in WORKER_KEYS if key.startswith("worker.")
    }


def test_values_are_normalised() -> None:
    config = parse_config(
        {
            "durability": "normal",
            "dispatch": {"notify_template": ["notify", "{payload}"], "timeout_seconds": 2},
            "worker": {"tick_seconds": 0.5, "grace_seconds": 0, "retry_jitter": 1},
            "log_level": "debug",
        }
    )
    assert config.durability == "normal"
    assert config.dispatch.notify_template == ("notify", "{payload}")
    assert type(config.dispatch.timeout_seconds) is float
    assert config.worker.grace_seconds == 0.0
    assert config.worker.retry_jitter == 1.0
    assert config.log_level == "DEBUG"


def test_null_template_means_none() -> None:
    assert parse_config({"dispatch": {"notify_template": None}}).dispatch.notify_template is None


# --- errors name the key --------------------------------------------------------

BAD_VALUES = [
    ("store", ""),
    ("store", "   "),
    ("store", 5),
    ("store", None),
    ("durability", "fast"),
    ("busy_timeout_seconds", -1),
    ("busy_timeout_seconds", "10s"),
    ("network_timeout_seconds", 0),
    ("network_timeout_seconds", "5s"),
    ("network_timeout_seconds", float("inf")),
    ("network_timeout_seconds", True),
    ("durability", "FULL"),
    ("dispatch", [1]),
    ("dispatch", "x"),
    ("dispatch.notify_template", []),
    ("dispatch.notify_template", ["notify", 1]),
    ("dispatch.notify_template", "notify {payload}"),
    ("dispatch.timeout_seconds", 0),
    ("dispatch.timeout_seconds", "10"),
    ("dispatch.timeout_seconds", True),
    ("dispatch.timeout_seconds", float("inf")),
    ("dispatch.timeout_seconds", float("nan")),
    ("dispatch.timeout_seconds", 10**400),
    ("worker", 3),
    ("worker.tick_seconds", -1),
    ("worker.tick_seconds", None),
    ("worker.concurrency", "many"),
    ("worker.concurrency", 0),
    ("worker.concurrency", 1.5),
    ("worker.concurrency", True),
    ("worker.batch_size", 0),
    ("worker.batch_size", 16.0),
    ("worker.grace_seconds", -0.1),
    ("worker.grace_seconds", False),
    ("worker.retry_jitter", 1.5),
    ("worker.retry_jitter", -0.1),
    ("worker.listen", "yes"),
    ("worker.listen", 1),
    ("log_level", "LOUD"),
    ("log_level", 10),
]


@pytest.mark.parametrize(("key", "value"), BAD_VALUES, ids=[f"{k}={v!r}" for k, v in BAD_VALUES])
def test_wrong_value_error_names_the_key(key: str, value: object) -> None:
    section, _, name = key.rpartition(".")
    data: dict[str, object] = {section: {name: value}} if section else {key: value}
    with pytest.raises(ConfigError) as info:
        parse_config(data, source="config.yaml")
    message = str(info.value)
    assert message.startswith(f"config.yaml: {key} must be ")
    assert "\n" not in message


def test_wrong_value_error_from_file_shows_value_and_rule(tmp_path: Path) -> None:
    path = write(tmp_path, "worker:\n  concurrency: many\n")
    message = config_error(path)
    assert message == f"{path}: worker.concurrency must be an integer >= 1, got 'many'"


def test_yaml_boolean_is_not_a_number(tmp_path: Path) -> None:
    message = config_error(write(tmp_path, "worker:\n  concurrency: yes\n"))
    assert "worker.concurrency must be an integer >= 1, got True" in message


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("stor: outbox.db\n", "stor"),
        ("worker:\n  concurency: 4\n", "worker.concurency"),
        ("dispatch:\n  template: [x]\n", "dispatch.template"),
        ("1: x\n", "1"),
    ],
)
def test_unknown_key_is_an_error_listing_allowed_keys(tmp_path: Path, text: str, key: str) -> None:
    message = config_error(write(tmp_path, text))
    assert f"unknown key {key!r} (allowed: " in message
    if key.startswith("worker."):
        allowed = "tick_seconds, concurrency, batch_size, grace_seconds, retry_jitter, listen"
        assert allowed in message


def test_every_problem_of_a_file_is_reported_at_once(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "stor: x.db\n"
        "durability: maybe\n"
        "dispatch:\n  timeout_seconds: -1\n  transport: webhook\n"
        "worker:\n  concurrency: many\n  concurency: 4\n"
        "http:\n  listen: 0.0.0.0:9464\n",
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    problems = info.value.problems
    assert [p.split()[0] for p in problems] == [
        "unknown",  # stor
        "durability",
        "dispatch.timeout_seconds",
        "unknown",  # worker.concurency
        "worker.concurrency",
        "http.listen",  # beyond loopback without a token
    ]
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}: ")
    assert message == f"{path}: " + "; ".join(problems)
    # one bad key alone reads as before
    single = write(tmp_path, "worker:\n  concurrency: many\n", "single.yaml")
    with pytest.raises(ConfigError) as info:
        load_config(single)
    assert info.value.problems == (str(info.value).removeprefix(f"{single}: "),)


@pytest.mark.parametrize(
    ("text", "kind"), [("- a\n- b\n", "list"), ("just text\n", "str"), ("3\n", "int")]
)
def test_top_level_must_be_a_mapping(tmp_path: Path, text: str, kind: str) -> None:
    path = write(tmp_path, text)
    assert config_error(path) == f"{path}: top level must be a mapping, got {kind}"


# --- unsafe and malformed YAML -----------------------------------------------------


@pytest.mark.parametrize(
    "template",
    [
        '!!python/object/apply:os.system ["touch {canary}"]\n',
        'store: !!python/object/apply:os.system ["touch {canary}"]\n',
        'dispatch:\n  notify_template: !!python/object/new:os.system ["touch {canary}"]\n',
    ],
)
def test_python_object_tag_is_refused_and_never_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, template: str
) -> None:
    monkeypatch.chdir(tmp_path)
    canary = tmp_path / "CANARY"
    path = write(tmp_path, template.format(canary=canary), name=DEFAULT_CONFIG_NAME)
    message = config_error(path)
    assert "unsupported YAML at line " in message
    assert "python/object" in message
    assert resolve_notify_template(tmp_path) is None
    assert not canary.exists()


def test_python_name_tag_is_refused(tmp_path: Path) -> None:
    message = config_error(write(tmp_path, "store: !!python/name:os.system\n"))
    assert "unsupported YAML at line 1" in message
    assert "python/name:os.system" in message


@pytest.mark.parametrize(
    "text",
    [
        "worker: [1, 2\n",
        "store: a: b\n",
        'store: "unterminated\n',
        "---\nstore: a\n---\nstore: b\n",
        "\tstore: a\n",
    ],
)
def test_malformed_yaml_is_a_one_line_error_with_position(tmp_path: Path, text: str) -> None:
    message = config_error(write(tmp_path, text))
    assert ": not valid YAML: " in message
    assert " at line " in message


@pytest.mark.parametrize(
    "content", [b"store: 2024-13-45\n", b"store: !!int abc\n", b"store: \x00\n", b"\xff\xfe\xfd"]
)
def test_unbuildable_or_undecodable_yaml_is_a_config_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "config.yaml"
    path.write_bytes(content)
    assert ": not valid YAML: " in config_error(path)


def test_missing_file_error_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    assert config_error(path) == f"{path}: config file not found"


def test_directory_instead_of_file_is_a_config_error(tmp_path: Path) -> None:
    assert "cannot read config file" in config_error(tmp_path)


# --- store_target ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("store", "expected"),
    [
        ("outbox.db", "{dir}/outbox.db"),
        ("data/outbox.db", "{dir}/data/outbox.db"),
        ("/var/lib/outbox.db", "/var/lib/outbox.db"),
        ("sqlite:///outbox.db", "sqlite:///outbox.db"),
        ("postgresql://user@db/outbox", "postgresql://user@db/outbox"),
        (":memory:", ":memory:"),
    ],
)
def test_store_target_joins_relative_paths_to_config_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, store: str, expected: str
) -> None:
    config_dir = tmp_path / "etc"
    config_dir.mkdir()
    path = write(config_dir, f"store: {store!r}\n")
    monkeypatch.chdir(tmp_path)  # a relative config path, resolved at load time
    config = load_config(path.relative_to(tmp_path))
    assert config.path == path
    assert config.store_target() == expected.format(dir=config_dir)


def test_store_target_expands_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    config = load_config(write(tmp_path, "store: ~/outbox.db\n"))
    assert config.store_target() == str(tmp_path / "outbox.db")


# --- find_config_path ---------------------------------------------------------------


def test_find_config_path_prefers_explicit_even_if_missing(tmp_path: Path) -> None:
    write(tmp_path, "", name=DEFAULT_CONFIG_NAME)
    found = find_config_path("missing.yaml", environ={CONFIG_ENV_VAR: "/env.yaml"}, cwd=tmp_path)
    assert found == tmp_path / "missing.yaml"


def test_find_config_path_uses_env_before_cwd_file(tmp_path: Path) -> None:
    write(tmp_path, "", name=DEFAULT_CONFIG_NAME)
    assert find_config_path(environ={CONFIG_ENV_VAR: "/etc/td.yaml"}, cwd=tmp_path) == Path(
        "/etc/td.yaml"
    )


def test_find_config_path_ignores_empty_env(tmp_path: Path) -> None:
    path = write(tmp_path, "", name=DEFAULT_CONFIG_NAME)
    assert find_config_path(environ={CONFIG_ENV_VAR: ""}, cwd=tmp_path) == path


def test_find_config_path_is_none_without_any_source(tmp_path: Path) -> None:
    assert find_config_path(environ={}, cwd=tmp_path) is None


def test_find_config_path_defaults_to_process_env_and_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(CONFIG_ENV_VAR, raising=False)
    monkeypatch.chdir(tmp_path)
    assert find_config_path() is None
    write(tmp_path, "", name=DEFAULT_CONFIG_NAME)
    assert find_config_path() == tmp_path / DEFAULT_CONFIG_NAME


# --- resolve_notify_template -----------------------------------------------------------


def test_resolve_notify_template_reads_project_dir(tmp_path: Path) -> None:
    write(tmp_path, f"dispatch:\n  notify_template: {TEMPLATE}\n", name=DEFAULT_CONFIG_NAME)
    assert resolve_notify_template(tmp_path) == TEMPLATE
    assert resolve_notify_template(str(tmp_path)) == TEMPLATE


def test_resolve_notify_template_ignores_errors_elsewhere_in_the_file(tmp_path: Path) -> None:
    text = f"unknown: 1\nworker: many\ndispatch:\n  notify_template: {TEMPLATE}\n"
    write(tmp_path, text, name=DEFAULT_CONFIG_NAME)
    assert resolve_notify_template(tmp_path) == TEMPLATE


@pytest.mark.parametrize(
    "text",
    [
        "dispatch:\n  notify_template: []\n",
        "dispatch:\n  notify_template: [notify, 1]\n",
        "dispatch:\n  notify_template: notify {payload}\n",
        "dispatch:\n  notify_template: null\n",
        "dispatch: [notify]\n",
        "dispatch:\n  timeout_seconds: 5\n",
        "- notify\n",
        "",
        "dispatch: [unclosed\n",
        "dispatch:\n  notify_template: [a, 2024-13-45]\n",
        # As deep as Python's recursion limit: the parser needs more than a
        # frame a level (PyYAML scans it in quadratic time: 5,000 took 2 s).
        "[" * sys.getrecursionlimit() + "]" * sys.getrecursionlimit(),
    ],
    ids=[
        "empty-list",
        "list-with-int",
        "string",
        "null",
        "dispatch-not-mapping",
        "absent",
        "top-level-list",
        "empty-file",
        "malformed",
        "bad-timestamp",
        "deeply-nested",
    ],
)
def test_resolve_notify_template_returns_none_for_invalid_template(
    tmp_path: Path, text: str
) -> None:
    write(tmp_path, text, name=DEFAULT_CONFIG_NAME)
    assert resolve_notify_template(tmp_path) is None


def test_resolve_notify_template_returns_none_for_missing_file(tmp_path: Path) -> None:
    assert resolve_notify_template(tmp_path) is None
    assert resolve_notify_template(tmp_path / "no-such-dir") is None


def test_resolve_notify_template_returns_none_for_undecodable_file(tmp_path: Path) -> None:
    (tmp_path / DEFAULT_CONFIG_NAME).write_bytes(b"\xff\xfe\xfd")
    assert resolve_notify_template(tmp_path) is None


def test_resolve_notify_template_uses_env_var_without_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    path = write(elsewhere, f"dispatch:\n  notify_template: {TEMPLATE}\n", name="td.yaml")
    # The cwd file says something else; the env var must win over it.
    write(tmp_path, "dispatch:\n  notify_template: [cwd]\n", name=DEFAULT_CONFIG_NAME)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(CONFIG_ENV_VAR, str(path))
    assert resolve_notify_template() == TEMPLATE


def test_resolve_notify_template_uses_cwd_file_without_dir_or_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(CONFIG_ENV_VAR, raising=False)
    monkeypatch.chdir(tmp_path)
    assert resolve_notify_template() is None
    write(tmp_path, "dispatch:\n  notify_template: [cwd]\n", name=DEFAULT_CONFIG_NAME)
    assert resolve_notify_template() == ["cwd"]


def test_resolve_notify_template_returns_none_when_env_points_nowhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(CONFIG_ENV_VAR, str(tmp_path / "missing.yaml"))
    assert resolve_notify_template() is None


def test_the_transport_registry_decides_what_a_file_may_name() -> None:
    plugins = transport_plugins()
    assert set(plugins) == {"command", "webhook"}
    with pytest.raises(ConfigError) as caught:
        parse_config({"dispatch": {"transport": "carrier-pigeon"}})
    assert f"must be one of {', '.join(plugins)}" in str(caught.value)
    for name, plugin in plugins.items():
        assert plugin.name == name
        options = parse_config(None).dispatch.transports[name]
        assert plugin.timeout(options) > 0
        described = plugin.describe(options)
        assert described and all(isinstance(key, str) for key in described)
        assert plugin.summary(options)[0].startswith(f"  transport: {name} ")


def test_the_ordering_policy_is_read_checked_and_reaches_the_worker() -> None:
    assert parse_config(None).worker_settings().ordering_on_dead_letter == "block"
    skip = parse_config({"dispatch": {"ordering": {"on_dead_letter": "skip"}}})
    assert skip.worker.ordering_on_dead_letter == "skip"
    assert skip.worker_settings().ordering_on_dead_letter == "skip"
    with pytest.raises(ConfigError, match=r"dispatch\.ordering\.on_dead_letter must be"):
        parse_config({"dispatch": {"ordering": {"on_dead_letter": "drop"}}})


def test_the_priority_step_is_read_checked_and_reaches_the_worker() -> None:
    assert parse_config(None).worker.priority_step_seconds == 300.0  # a file's default
    assert WorkerSettings().priority_step_seconds is None  # the library's: the store's
    minute = parse_config({"dispatch": {"priority_step_seconds": 60}})
    assert minute.worker_settings().priority_step_seconds == 60.0
    kept = parse_config({"dispatch": {"priority_step_seconds": None}})
    assert kept.worker.priority_step_seconds is None
    with pytest.raises(
        ConfigError,
        match=r"dispatch\.priority_step_seconds must be a number of seconds from 1 to 86400, "
        "got 'soon'",
    ):
        parse_config({"dispatch": {"priority_step_seconds": "soon"}})


WORKER_SETTING_VALUES = [
    ("worker.tick_seconds", 0),
    ("worker.concurrency", "many"),
    ("worker.batch_size", 2**31),
    ("worker.grace_seconds", -1),
    ("worker.retry_jitter", 2),
    ("worker.listen", "on"),
    ("worker.per_destination_concurrency", 0),
    ("dispatch.retry_schedule", [1, -5]),
    ("dispatch.ordering.on_dead_letter", "drop"),
    ("dispatch.priority_step_seconds", 0),
    ("dispatch.priority_step_seconds", True),
    ("dispatch.priority_step_seconds", 86401),
]


@pytest.mark.parametrize(("key", "value"), WORKER_SETTING_VALUES)
def test_a_worker_setting_in_the_file_is_refused_with_the_workers_own_message(
    key: str, value: object
) -> None:
    # One check per setting: the file says what DispatchWorker(name=value)
    # says, under the dotted key.
    name = WORKER_KEYS[key]
    with pytest.raises((TypeError, ValueError)) as direct:
        WorkerSettings().updated({name: value})
    *sections, last = key.split(".")
    data: dict[str, object] = {last: value}
    for section in reversed(sections):
        data = {section: data}
    with pytest.raises(ConfigError) as filed:
        parse_config(data, source="config.yaml")
    assert str(direct.value).startswith(name)
    assert str(filed.value) == f"config.yaml: {key}{str(direct.value).removeprefix(name)}"


def test_the_files_worker_settings_are_the_object_the_worker_runs_with() -> None:
    config = parse_config(
        {
            "dispatch": {
                "timeout_seconds": 4,
                "retry_schedule": [1, 2],
                "ordering": {"on_dead_letter": "skip"},
            },
            "worker": {"concurrency": 3, "tick_seconds": 0.5, "per_destination_concurrency": 2},
        }
    )
    assert config.worker == WorkerSettings(
        concurrency=3,
        tick_seconds=0.5,
        per_destination_concurrency=2,
        timeout_seconds=4.0,
        retry_schedule=(1.0, 2.0),
        ordering_on_dead_letter="skip",
        priority_step_seconds=300.0,
    )
    assert config.worker_options()["settings"] is config.worker
    assert WorkerSettings.from_config(config) is config.worker
    assert config.worker.lease_seconds == 4.0 + config.worker.lease_margin_seconds


def test_a_file_read_without_its_secrets_leaves_every_env_reference_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a store command reads (``load_config(secrets=False)``): the
    variables need not be set, no value is read even where one is, and a
    transport built from it refuses to sign."""
    pytest.importorskip("httpx")
    from trio_dispatch.transports.webhook import WebhookTransport

    path = tmp_path / "trio-dispatch.yaml"
    path.write_text(
        "http:\n  token: env:TD_UNIT_VIEWER\n"
        "dispatch:\n  transport: webhook\n  webhook:\n    endpoints:\n      billing:\n"
        "        url: https://billing.example.com/hooks\n"
        "        secrets: [env:TD_UNIT_HOOK]\n"
    )
    monkeypatch.delenv("TD_UNIT_HOOK", raising=False)
    monkeypatch.setenv("TD_UNIT_VIEWER", "a-viewer-token-of-32-characters!")
    with pytest.raises(ConfigError, match="'TD_UNIT_HOOK' is not set"):
        load_config(path)
    config = load_config(path, secrets=False)
    assert config.http.token == "env:TD_UNIT_VIEWER"  # the reference, not the value
    endpoints = config.dispatch.webhook.endpoints
    assert endpoints is not None
    [secret] = endpoints["billing"].secrets
    assert secret.unread and secret.label == "env:TD_UNIT_HOOK"
    with pytest.raises(ValueError, match=r"secret env:TD_UNIT_HOOK was never read"):
        WebhookTransport(endpoints)
    monkeypatch.setenv("TD_UNIT_HOOK", "whsec_" + "QUJD" * 8)
    assert load_config(path).http.token == "a-viewer-token-of-32-characters!"
