"""``tidal simulate --costs-from``: the switch costs of a GPU check's JSON, scaled to a
scenario's bytes per GPU, priced into the scenario exactly (the shipped 2026-12-04 H200 check)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tidal.errors import ConfigError
from tidal.sim import perf
from tidal.sim import scenario as scenarios
from tidal.sim.measured_costs import apply, assumed, read_check

H200 = Path(__file__).parents[3] / "benchmarks" / "gpu" / "results" / "2026-12-04-h200.json"


def test_the_h200_check_gives_its_sleep_wake_and_sync():
    m = read_check(H200)
    assert (round(m.sleep_s, 2), round(m.wake_s, 2)) == (10.70, 3.65)
    assert round(m.sync_gbps, 3) == 0.493 and m.weights_gib == 14.2
    assert m.sync_figure == "tidal: trainer -> engine"


def test_measured_costs_are_scaled_to_the_scenarios_bytes_per_gpu_and_priced_exactly():
    sc = scenarios.load("dapo-math-32gpu")
    m = read_check(H200)
    sc_m, used = apply(sc, m)
    c = perf.resolve(sc).costs
    per_gpu_gb = c.weight_gb / sc.costmodel.engine_tp
    scale = per_gpu_gb / (14.2 * 2**30 / 1e9)
    assert used["sleep_s"] == pytest.approx(m.sleep_s * scale)
    assert used["wake_s"] == pytest.approx(m.wake_s * scale)
    resolved = perf.resolve(sc_m).costs  # what a run of the scenario prices a sync at
    assert resolved.sync_s == pytest.approx(c.sync_latency_s + per_gpu_gb / m.sync_gbps)
    assert (resolved.sleep_s, resolved.wake_s) == (used["sleep_s"], used["wake_s"])
    assert assumed(sc) == {"sleep_s": 3.0, "wake_s": 3.0, "sync_s": pytest.approx(c.sync_s)}


def test_a_check_without_the_figures_is_refused_naming_the_option(tmp_path):
    bad = tmp_path / "check.json"
    bad.write_text(json.dumps({"steps": {"decode": {"figures": []}}}))
    with pytest.raises(ConfigError, match=r"--costs-from.*sleep level 1"):
        read_check(bad)
    with pytest.raises(ConfigError, match="--costs-from"):
        read_check(tmp_path / "missing.json")
