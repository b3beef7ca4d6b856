"""Hypothesis profiles for the test suite.

- ``ci``: 1,000 examples per property, derandomized (seeded from each test,
  so every CI run tries the same examples), no example database, blobs
  printed so a failure reproduces with ``@reproduce_failure``.
- ``dev``: 100 random examples per property -- the loop a developer runs
  after every change -- with the local example database (failures are
  replayed first on the next run).

``HYPOTHESIS_PROFILE`` picks a profile explicitly; otherwise ``ci`` when the
``CI`` environment variable is set (CI runs with ``CI=true``), else ``dev``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from hypothesis import HealthCheck, settings

SUPPRESSED = (
    # Each example can touch the database or spawn a transport.
    HealthCheck.too_slow,
    # Property tests share one store (or portal) across their examples on
    # purpose: they measure what each example adds to it.
    HealthCheck.function_scoped_fixture,
)

settings.register_profile(
    "ci",
    max_examples=1000,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=SUPPRESSED,
    print_blob=True,
)
settings.register_profile(
    "dev",
    max_examples=100,
    deadline=None,
    suppress_health_check=SUPPRESSED,
)


def chosen_profile(environ: Mapping[str, str] = os.environ) -> str:
    explicit = environ.get("HYPOTHESIS_PROFILE", "").strip()
    if explicit:
        return explicit
    ci = environ.get("CI", "").strip().lower()
    return "ci" if ci not in ("", "0", "false", "no") else "dev"


settings.load_profile(chosen_profile())
