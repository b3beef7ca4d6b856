"""The public surface: what ``trio_dispatch`` exports, the error tree, and
what importing the enqueue-only module costs."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys
from typing import get_type_hints

import pytest

import trio_dispatch
from trio_dispatch import errors
from trio_dispatch.outbox.enqueue import ENQUEUE_DEFAULTS, ENQUEUE_KEYS, EnqueueArgs

MODULES = sorted(
    info.name
    for info in pkgutil.walk_packages(trio_dispatch.__path__, "trio_dispatch.")
    if not info.name.endswith("__main__")
)


def test_every_exported_name_resolves_and_is_listed_once() -> None:
    names = trio_dispatch.__all__
    assert len(names) == len(set(names))
    for name in names:
        assert getattr(trio_dispatch, name) is not None, name
    assert set(names) <= set(dir(trio_dispatch))


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        trio_dispatch.no_such_name  # type: ignore[attr-defined]  # noqa: B018


@pytest.mark.parametrize("module", MODULES)
def test_each_modules_all_names_exist_and_it_states_its_concern(module: str) -> None:
    loaded = importlib.import_module(module)
    assert (loaded.__doc__ or "").strip(), f"{module} has no docstring"
    for name in getattr(loaded, "__all__", ()):
        assert hasattr(loaded, name), f"{module}.__all__ names missing {name!r}"


def test_every_error_has_the_one_root_and_keeps_its_builtin() -> None:
    builtin = {
        "AckRefused": ValueError,
        "ActionRefused": ValueError,
        "CancelTooLate": ValueError,
        "ConfigError": ValueError,
        "ConnectionLostError": RuntimeError,
        "DispatchNotFound": LookupError,
        "InvalidTransition": ValueError,
        "SchemaError": RuntimeError,
        "StoreError": RuntimeError,
        "TransactionMisuse": RuntimeError,
        "WorkerError": RuntimeError,
    }
    assert set(errors.__all__) == {*builtin, "DispatchError"}
    for name, base in builtin.items():
        cls = getattr(errors, name)
        assert issubclass(cls, errors.DispatchError) and issubclass(cls, base), name
        assert getattr(trio_dispatch, name) is cls, name
    # The older import paths name the same classes.
    from trio_dispatch.config import ConfigError
    from trio_dispatch.lifecycle import InvalidTransition
    from trio_dispatch.store import ConnectionLostError, SchemaError, StoreError

    assert ConfigError is errors.ConfigError
    assert InvalidTransition is errors.InvalidTransition
    assert (StoreError, SchemaError, ConnectionLostError) == (
        errors.StoreError,
        errors.SchemaError,
        errors.ConnectionLostError,
    )


def test_the_enqueue_arguments_are_declared_once() -> None:
    declared = set(get_type_hints(EnqueueArgs))
    assert declared == set(ENQUEUE_KEYS)
    assert EnqueueArgs.__required_keys__ == {"kind", "deliver_to"}
    assert set(ENQUEUE_DEFAULTS) == declared - {"kind", "deliver_to"}
    # Every enqueue entry point takes exactly those (and ``now``).
    import trio_dispatch.sync as sync

    for function in (trio_dispatch.enqueue_dispatch, sync.enqueue_dispatch):
        parameters = inspect.signature(function).parameters
        assert list(parameters)[1:] == ["now", "args"], function


def test_importing_the_sync_module_loads_no_worker_yaml_http_or_web_stack() -> None:
    probe = (
        "import sys, trio_dispatch.sync\n"
        "heavy = ('yaml', 'httpx', 'httpcore', 'hypercorn', 'prometheus_client',\n"
        "         'trio_dispatch.worker', 'trio_dispatch.web', 'trio_dispatch.config',\n"
        "         'trio_dispatch.cli')\n"
        "print(','.join(name for name in heavy if name in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == ""


def test_importing_the_package_alone_loads_none_of_its_parts() -> None:
    probe = (
        "import sys, trio_dispatch\n"
        "print(','.join(sorted(m for m in sys.modules if m.startswith('trio_dispatch.'))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "trio_dispatch._version"


def test_the_store_options_are_declared_once_and_typed_alike() -> None:
    from dataclasses import fields

    from trio_dispatch.store import StoreOptionArgs, StoreOptions

    assert set(get_type_hints(StoreOptionArgs)) == {field.name for field in fields(StoreOptions)}
    with pytest.raises(TypeError, match="unexpected keyword argument 'durabilty'"):
        StoreOptions().updated({"durabilty": "full"})
    with pytest.raises(ValueError, match="durability"):
        StoreOptions(durability="fast")  # type: ignore[arg-type]
