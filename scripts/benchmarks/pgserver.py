"""Throwaway databases on the local PostgreSQL server
(``TRIO_DISPATCH_TEST_POSTGRES``, by default ``postgres@127.0.0.1:5432``)
for the sections that measure PostgreSQL; none when no server answers.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable


def postgres_database() -> tuple[str, Callable[[], None]] | None:
    """A throwaway database on the local PostgreSQL server, or None."""
    try:
        import psycopg
    except ImportError:
        return None
    admin = os.environ.get(
        "TRIO_DISPATCH_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres"
    )
    name = f"trio_dispatch_bench_{uuid.uuid4().hex[:8]}"
    try:
        with psycopg.connect(admin, autocommit=True, connect_timeout=3) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError:
        return None

    def drop() -> None:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    return f"{admin.rsplit('/', 1)[0]}/{name}", drop


def fresh_postgres(url: str) -> str:
    """Empty the database (its ``public`` schema) and return its URL."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP SCHEMA public CASCADE")
        conn.execute("CREATE SCHEMA public")
    return url
