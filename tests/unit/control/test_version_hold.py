"""The version hold of a deterministic run (``tidal.control.version_hold``): a boundary holds
while an engine in routing serves another version, never for one out of routing, and the time
from its first look to its release is what the run reports."""

from __future__ import annotations

from tidal.control.version_hold import EngineVersion, VersionHold, unserved


def ev(eid: str, version: str | None, routed: bool = True) -> EngineVersion:
    return EngineVersion(eid, routed, version)


def test_only_routed_engines_on_another_version_hold():
    engines = [ev("s0", "v2"), ev("c0", "v1", routed=False), ev("c1", None), ev("c2", "v1")]
    assert unserved("v2", engines) == ["c1", "c2"]  # unknown counts as another version
    assert unserved("v2", [ev("s0", "v2"), ev("c0", "v0", routed=False)]) == []


def test_hold_time_runs_from_first_look_to_release():
    hold = VersionHold()
    assert hold.look(1.0, "v0", [ev("s0", "v0")]) == []  # released at once: no wait
    assert hold.look(5.0, "v2", [ev("s0", "v2"), ev("c1", "v0")]) == ["c1"]
    assert hold.look(5.5, "v2", [ev("s0", "v2"), ev("c1", "v0")]) == ["c1"]
    assert hold.look(6.25, "v2", [ev("s0", "v2"), ev("c1", "v2")]) == []
    assert hold.report() == {
        "deterministic_hold_s": 1.25,
        "deterministic_boundaries": 2,
        "deterministic_held_boundaries": 1,
    }
    # the next boundary starts its own clock
    assert hold.look(9.0, "v4", [ev("s0", "v4")]) == []
    assert hold.report()["deterministic_hold_s"] == 1.25
    assert hold.report()["deterministic_boundaries"] == 3
