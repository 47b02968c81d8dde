"""The robustness benchmark's scenario generator: seeded, index-independent, valid, varied."""

import pytest

from tidal.config import validate_model
from tidal.errors import ConfigError
from tidal.sim.generate import generate, generate_set
from tidal.sim.runner import run_policy
from tidal.sim.scenario import Scenario
from tidal.testing.sim_scenarios import tiny_scenario


def test_same_seed_same_scenarios_and_each_index_stands_alone():
    a = generate_set(11, 6)
    assert [s.model_dump() for s in a] == [s.model_dump() for s in generate_set(11, 6)]
    assert generate(11, 4).model_dump() == a[4].model_dump()
    assert generate(12, 4).model_dump() != a[4].model_dump()


def test_the_set_spans_the_shipped_ranges():
    sets = generate_set(3, 40)
    assert {len(s.cluster.cell_specs()) for s in sets} >= {2, 6}
    assert {s.costmodel.model for s in sets} >= {"qwen3.5-35b-a3b", "qwen2.5-7b"}
    turns = {s.workload.classes[0].turns.median > 1 for s in sets}
    assert turns == {True, False}  # single-turn answers and multi-turn agents
    assert all(s.cluster.standalone_count >= 1 for s in sets)


def test_a_generated_scenario_runs_tidal_to_the_end():
    sc = generate(2026, 1).scaled(1.0, bursts=2).model_copy(update={"mechanics": "tidal"})
    res = run_policy(sc, "tidal", keep_log=False)
    assert res.summary["makespan_s"] >= res.summary["oracle_makespan_s"] > 0


def test_a_bad_profile_admission_is_a_config_error():
    data = tiny_scenario().model_dump(mode="json")
    data["profiles"] = {"tidal": {"admission": "sometimes"}}
    with pytest.raises(ConfigError, match=r"profiles\.tidal: must be 'off', 'saturation'"):
        validate_model(Scenario, data)
