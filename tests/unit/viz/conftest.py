"""Run directories copied from the fixtures of real ``tidal run`` outputs (configs/tiny.yaml)."""

import shutil
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "runs"


@pytest.fixture
def run_copy(tmp_path):
    """A writable copy of a fixture run directory: ``run_copy("tiny-waterlevel")``."""

    def copy(name: str, dest: str | None = None) -> Path:
        target = tmp_path / (dest or name)
        shutil.copytree(FIXTURES / name, target)
        return target

    return copy
