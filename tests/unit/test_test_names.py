"""Every test module's file name is unique in tests/: the tree has no packages (rootdir-relative
imports), so two ``test_x.py`` in different folders make pytest stop at collection, and CI
runs nothing. This has happened twice when parallel work merged."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_name_is_unique():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    doubled = sorted(n for n, c in names.items() if c > 1)
    assert not doubled, f"test module names used twice under tests/: {doubled}"
