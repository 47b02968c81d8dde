"""Simulator mechanics of the real runtime that ``tidal calibrate`` relies on: paced burst
dispatch, a shared host's decode throughput, a separate weight-load cost for a waking cell."""

import itertools
import json

import pytest

from tidal.control.plans import StepKind
from tidal.sim import dispatch
from tidal.sim.costs import step_duration_s
from tidal.sim.scenario import CostConfig
from tidal.sim.world import World
from tidal.testing.sim_scenarios import tiny_scenario


def _exact(**over):
    """1 training cell, 2 standalone engines of 1 slot; 2 executions of exactly 100 tokens."""
    base = {
        "cluster": {
            "cells": [{"gpus": 1, "slots": 1}],
            "standalone_count": 2,
            "standalone_gpus": 1,
            "standalone_slots": 1,
        },
        "control": {"group_size": 2, "batch_groups": 1, "updates_per_burst": 1, "bursts": 1},
        "workload": {"classes": [{"decode_tokens": {"median": 100}, "prompt_tokens": 0}]},
        "engine": {"decode_tok_s_per_gpu": 100.0, "seq_cap_tok_s": 100.0, "prefill_equiv": 0.0},
        "trainer": {"train_tok_s_per_gpu": 1e9, "optimizer_s": 0.0},
    }
    base.update(over)
    return tiny_scenario(**base)


def test_a_shared_host_splits_its_throughput_among_engines():
    alone = World(_exact(), "static:cells=1").run().makespan_s
    shared = World(_exact(engine={"host_tok_s": 100.0}), "static:cells=1").run().makespan_s
    assert alone == pytest.approx(1.0, abs=1e-3)  # each engine decodes its 100 tokens at 100/s
    assert shared == pytest.approx(2.0, abs=1e-3)  # two engines share 100/s: 50/s each
    roomy = World(_exact(engine={"host_tok_s": 1000.0}), "static:cells=1").run().makespan_s
    assert roomy == pytest.approx(alone, abs=1e-9)  # a host that never binds changes nothing


@pytest.mark.parametrize("interval_s", [5.0, 0.0])
def test_paced_burst_dispatch_spaces_the_groups_of_a_burst(interval_s, monkeypatch):
    sc = tiny_scenario(
        sim={"dispatch_interval_s": interval_s},
        profiles={
            "waterlevel": {
                "dispatch": "burst",
                "trainer": "batch",
                "sync": "keep",
                "staleness_threshold": 0.0,
            }
        },
    )
    times: list[tuple[int, float]] = []
    orig = dispatch.dispatch_group

    def record(w) -> None:
        times.append((w.burst, w.now))
        orig(w)

    monkeypatch.setattr(dispatch, "dispatch_group", record)
    World(sc, "waterlevel").run()
    quota = sc.control.batch_groups * sc.control.updates_per_burst
    for burst in range(sc.control.bursts):
        ts = [t for b, t in times if b == burst]
        assert len(ts) == quota
        assert [b - a for a, b in itertools.pairwise(ts)] == pytest.approx(
            [interval_s] * (quota - 1)
        )


def test_setup_and_final_step_hold_an_execution_open(tmp_path):
    trace = tmp_path / "t.jsonl"
    line = {
        "group": "g",
        "prompt_tokens": 0,
        "setup_s": 0.5,
        "reward": 0.0,
        "turns": [{"decode_tokens": 100, "tool_s": 0.25, "tool_output_tokens": 0}],
    }
    trace.write_text((json.dumps(line) + "\n") * 2)
    bare = {**line, "setup_s": 0.0, "turns": [{**line["turns"][0], "tool_s": 0.0}]}
    (tmp_path / "bare.jsonl").write_text((json.dumps(bare) + "\n") * 2)
    t_bare = (
        World(_exact(workload={"trace": str(tmp_path / "bare.jsonl")}), "static:cells=1")
        .run()
        .makespan_s
    )
    t_full = World(_exact(workload={"trace": str(trace)}), "static:cells=1").run().makespan_s
    assert t_bare == pytest.approx(1.0, abs=1e-3)
    assert t_full == pytest.approx(1.0 + 0.5 + 0.25, abs=1e-3)


def test_load_weights_has_its_own_cost_when_given():
    c = CostConfig(weight_gb=10.0, sync_gb_s=10.0, sync_latency_s=1.0)
    assert step_duration_s(StepKind.LOAD_WEIGHTS, c) == pytest.approx(2.0)  # = sync_s
    c2 = c.model_copy(update={"load_weights_s": 0.25})
    assert step_duration_s(StepKind.LOAD_WEIGHTS, c2) == pytest.approx(0.25)
    assert step_duration_s(StepKind.SYNC_WEIGHTS, c2) == pytest.approx(2.0)
