"""The webhook client's pool overrides one private method of httpcore's
``AsyncConnectionPool``. These tests name every private part it relies on,
so a change of shape in httpcore fails here, loudly, not in a delivery."""

from __future__ import annotations

import importlib.metadata
import inspect

import pytest

httpcore = pytest.importorskip("httpcore")

from trio_dispatch.transports.webhook.pool import linear_pool_class  # noqa: E402


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:3] if part.isdigit())


def test_httpcore_is_inside_the_range_the_override_was_written_for() -> None:
    found = _version(importlib.metadata.version("httpcore"))
    assert (1, 0, 5) <= found < (1, 1), (
        f"httpcore {found} is outside >=1.0.5,<1.1: check linear_pool_class against its "
        "AsyncConnectionPool._assign_requests_to_connections before widening the pin"
    )


def test_the_private_method_it_replaces_exists_and_returns_the_connections_to_close() -> None:
    original = httpcore.AsyncConnectionPool._assign_requests_to_connections
    assert list(inspect.signature(original).parameters) == ["self"]
    source = inspect.getsource(original)
    for part in (
        "self._connections",
        "self._requests",
        "self._max_keepalive_connections",
        "self._max_connections",
        "create_connection",
        "is_queued",
        "assign_to_connection",
        "closing_connections",
    ):
        assert part in source, f"httpcore's pool no longer uses {part}"


def test_the_connection_and_request_methods_it_calls_exist() -> None:
    for method in ("is_closed", "is_idle", "has_expired", "is_available", "can_handle_request"):
        assert callable(getattr(httpcore.AsyncConnectionInterface, method, None)), method
    from httpcore._async.connection_pool import AsyncPoolRequest

    for method in ("is_queued", "assign_to_connection"):
        assert callable(getattr(AsyncPoolRequest, method, None)), method


def test_a_linear_pool_is_built_with_the_attributes_it_reads() -> None:
    pool = linear_pool_class()(max_connections=4, max_keepalive_connections=2)
    assert isinstance(pool, httpcore.AsyncConnectionPool)
    assert pool._connections == [] and pool._requests == []
    assert (pool._max_connections, pool._max_keepalive_connections) == (4, 2)
    assert pool._assign_requests_to_connections() == []  # nothing queued, nothing to close
