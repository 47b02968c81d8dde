"""The summary names engines whose end-of-run describe failed by their ids as strings: an
``EngineId`` there made the summary contract refuse the run's end (seen in a multinode run)."""

from __future__ import annotations

from tidal.contracts.run_files import Summary
from tidal.runtime.engines import EngineId
from tidal.runtime.run_end import undescribed_names


def test_undescribed_engines_reach_the_summary_as_names():
    undescribed = {
        EngineId("s", 1): TimeoutError("describe"),
        EngineId.cell(0): RuntimeError("gone"),
        EngineId("s", 0): TimeoutError("describe"),
    }
    names = undescribed_names(undescribed)
    assert names == ["c0", "s0", "s1"]
    assert Summary.model_validate({"engines_undescribed": names}).engines_undescribed == names
