"""Metrics, health and a read-only dashboard over HTTP (docs/dashboard.md;
the ``web`` extra: hypercorn and prometheus_client).

- :mod:`.binding`: listen addresses and the bearer-token rule;
- :mod:`.app`: :class:`WebApp`, the ASGI application;
- :mod:`.metrics`: the Prometheus families;
- :mod:`.pages`: the dashboard's pages, of the HTML pieces of :mod:`.markup`;
- :mod:`.destinations`: the destinations' pages, actions and state metric;
- :mod:`.server`: :func:`serve_app`, hypercorn on trio or asyncio.

Embedding, next to a worker::

    app = WebApp(db, worker=worker)
    url = await nursery.start(serve_app, app, parse_listen("http", "127.0.0.1:9464"))
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .binding import Listen, check_binding, parse_listen, parse_token

if TYPE_CHECKING:
    from .app import WebApp
    from .server import serve_app

__all__ = ["Listen", "WebApp", "check_binding", "parse_listen", "parse_token", "serve_app"]


def __getattr__(name: str) -> object:
    # The application and server need the web extra: imported on first use.
    if name == "WebApp":
        from .app import WebApp

        return WebApp
    if name == "serve_app":
        from .server import serve_app

        return serve_app
    raise AttributeError(name)
