"""The webhook transport's configuration (``dispatch.transport: webhook``,
options under ``dispatch.webhook``): read, checked, shown and built into a
:class:`~.transport.WebhookTransport`. Importing it needs no httpx."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Final

from ...envsecrets import secret_environ
from ...validate import require_number
from ...values import show
from ..plugins import Option, PluginContext
from .endpoints import Endpoint, parse_endpoints

DEFAULT_WEBHOOK_TIMEOUT_SECONDS: Final = 15.0
MIN_TIMEOUT_SECONDS: Final = 0.001


def _check_timeout(key: str, value: object) -> float:
    return require_number(key, value, minimum=MIN_TIMEOUT_SECONDS)


def _check_endpoints(key: str, value: object) -> dict[str, Endpoint] | None:
    if value is None:
        return None
    from importlib.util import find_spec

    if find_spec("httpx") is None:
        raise ValueError(f"{key} needs httpx: install trio_dispatch[http]")
    return parse_endpoints(key, value, secret_environ())


def _check_ca_file(key: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or "\x00" in value:
        raise ValueError(
            f"{key} must be the path of a PEM file of CA certificates, got {show(value)}"
        )
    return value


@dataclasses.dataclass(frozen=True)
class WebhookConfig:
    """``dispatch.webhook``, checked."""

    timeout_seconds: float = DEFAULT_WEBHOOK_TIMEOUT_SECONDS
    endpoints: Mapping[str, Endpoint] | None = None
    """``deliver_to`` value -> endpoint, secrets read (``env:NAME`` at load)."""
    ca_file: str | None = None
    """PEM file of the CAs to trust instead of the system's (relative paths
    from the configuration file's folder)."""
    ca_path: str | None = None
    """:attr:`ca_file` resolved against the configuration file's folder."""

    def describe(self) -> dict[str, Any]:
        """What ``check-config`` shows: URLs and secrets masked."""
        return {
            "timeout_seconds": self.timeout_seconds,
            "ca_file": self.ca_file,
            "endpoints": {
                route: endpoint.describe() for route, endpoint in (self.endpoints or {}).items()
            },
        }


class WebhookPlugin:
    """How ``dispatch.webhook`` is configured."""

    name = "webhook"
    section = "webhook"
    requires: tuple[str, ...] = ("httpx",)
    extra = "http"
    options: Final = {
        "timeout_seconds": Option(_check_timeout, DEFAULT_WEBHOOK_TIMEOUT_SECONDS),
        "endpoints": Option(_check_endpoints, None),
        "ca_file": Option(_check_ca_file, None),
    }

    def build(self, values: Mapping[str, Any], context: PluginContext) -> WebhookConfig:
        ca_file = values["ca_file"]
        return WebhookConfig(
            values["timeout_seconds"],
            values["endpoints"],
            ca_file,
            None if ca_file is None else context.relative(ca_file),
        )

    def problems(self, options: WebhookConfig, context: PluginContext) -> list[str]:
        found: list[str] = []
        if options.endpoints is None:
            found.append(
                "dispatch.webhook.endpoints is required when dispatch.transport is webhook"
            )
        if options.ca_path is not None:
            from .tls import tls_context  # the worker would refuse it at start: so does the file

            try:
                tls_context(options.ca_path)
            except ValueError as exc:
                found.append(f"dispatch.webhook.ca_file: {exc}")
        return found

    def timeout(self, options: WebhookConfig) -> float:
        return options.timeout_seconds

    def worker_arguments(self, options: WebhookConfig, context: PluginContext) -> dict[str, Any]:
        from .transport import WebhookTransport

        assert options.endpoints is not None  # required: see problems()
        verify: str | bool = True if options.ca_path is None else options.ca_path
        return {
            "transport": WebhookTransport(
                options.endpoints, timeout=options.timeout_seconds, verify=verify
            )
        }

    def describe(self, options: WebhookConfig) -> dict[str, Any]:
        return {"webhook": options.describe()}

    def summary(self, options: WebhookConfig) -> list[str]:
        from ...redact import visible

        hook = options.describe()
        lines = [f"  transport: webhook (timeout {hook['timeout_seconds']:g}s)"]
        for route, endpoint in hook["endpoints"].items():
            secrets = ", ".join(endpoint["secrets"])
            private = ", allow_private" if endpoint["allow_private"] else ""
            lines.append(
                f"    {visible(route)}: {visible(endpoint['url'])} "
                f"(secrets: {visible(secrets)}{private})"
            )
        return lines

    def warnings(self, options: WebhookConfig, context: PluginContext) -> list[str]:
        return []


WEBHOOK_PLUGIN: Final = WebhookPlugin()
