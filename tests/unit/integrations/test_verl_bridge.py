"""tidal's policies inside verl: subclasses of verl 0.9.1's own ``DynamicSchedulePolicyBase``
(from the released wheel, fetched with pip; skipped only when no package registry is
reachable), registered in verl's registry, driven with verl's ``DynamicScheduleContext`` and
the hook calls recorded from a simulated verl run (``benchmarks/verl_contexts.py``)."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
from pathlib import Path

import pytest

from tidal.control.policy import Action
from tidal.integrations import verl_wheel

FIXTURE = Path(__file__).parents[2] / "fixtures/verl/contexts.jsonl"


@pytest.fixture(scope="module")
def verl():
    return verl_wheel.ensure_loaded(pytest.skip)


@pytest.fixture
def bridge(verl):
    """``tidal.integrations.verl`` imported while verl's package is importable."""
    import tidal.integrations.verl as mod

    with verl_wheel.importable(verl):
        mod = importlib.reload(mod)
    yield mod
    for name in mod.POLICIES:
        verl.registry.pop(name, None)


def stats_of(line):
    return lambda: dict(line["stats"])


def test_importing_it_registers_tidal_policies_in_verls_registry(verl, bridge):
    assert set(bridge.REGISTERED) == {"waterlevel", "tidal"}
    for name in ("waterlevel", "tidal"):
        p = verl.build_policy(name, deactivate_ratio=0.3, only_hybrid=False)
        assert isinstance(p, verl.DynamicSchedulePolicyBase)
        assert isinstance(p, bridge.VerlBridge) and p.policy.name == name
    assert {"default", "fixed_ratio", "static_fully_async"} <= set(verl.registry)


@pytest.mark.skipif(importlib.util.find_spec("verl") is not None, reason="verl is installed")
def test_without_verl_nothing_is_registered():
    import tidal.integrations.verl as mod

    mod = importlib.reload(mod)  # no verl package in this process
    assert mod.REGISTERED == {}


def ctx(verl, **kw):
    base = dict(
        required_samples=16,
        trigger_parameter_sync_step=4,
        total_generated_samples=0,
        expected_samples=64,
        buffer_samples=64.0,
    )
    base.update(kw)
    return verl.DynamicScheduleContext(**base)


def test_waterlevel_waits_until_the_standalone_capacity_covers_the_waterlevel(verl, bridge):
    """Standalone capacity 32 samples, 40 in generation, nothing left to dispatch, 10 in the
    queue: the move is safe once 8 more complete (32 >= 40 - 8); the supply (8 of 16) holds."""
    st = {
        "monitor/active_tasks_size": 40,
        "monitor/queue/mq_queue_size": 10,
        "static/max_concurrent_samples": 32,
        "static/max_required_samples": 96,
        "count/staleness_samples": 96,
        "count/total_generated_samples": 50,
    }
    p = bridge.register(verl.base)["waterlevel"](
        0.3, False, stats=lambda: dict(st), clock=lambda: 0.0
    )
    c = ctx(verl)
    assert p.should_activate_after_step(0, False, c) is False  # learns the standalone 32
    st["static/max_concurrent_samples"] = 64  # hybrids active: 32 more
    assert p.should_deactivate(1, True, c) is True
    assert p.deactivate_wait_samples(c) == 18
    st["monitor/active_tasks_size"], st["monitor/queue/mq_queue_size"] = 20, 30
    assert p.deactivate_wait_samples(c) == 30  # safe now: no wait
    # a sync is a burst end: the core returns unless supply and capacity both pass
    st["static/max_concurrent_samples"] = 32
    st["count/staleness_samples"] = 0  # a new version's budget: 96 to dispatch
    assert p.should_activate_after_step(1, False, c) is True
    assert "core returns" in p.last_reason


def test_driven_by_recorded_contexts(verl, bridge):
    """Every recorded hook call, answered by the bridge on verl's own context class; each
    deactivation threshold is exactly where the tidal policy (a copy, in the same state) first
    moves the hybrid cell to training as samples complete."""
    lines = [json.loads(x) for x in FIXTURE.read_text().splitlines()]
    assert {x["hook"] for x in lines} >= {
        "should_deactivate",
        "deactivate_wait_samples",
        "should_activate_after_step",
        "update_after_step",
    }
    for name in ("waterlevel", "tidal"):
        p = verl.build_policy(name, deactivate_ratio=0.3, only_hybrid=False)
        active, acts, waits = False, [], []
        for line in lines:
            p._stats = stats_of(line)
            p._clock = lambda t=line["t"]: t
            c = verl.DynamicScheduleContext(**line["ctx"])
            hook, args = line["hook"], line["args"]
            if hook == "should_deactivate":
                assert p.should_deactivate(args[0], active, c) is active
            elif hook == "deactivate_wait_samples":
                if not active:
                    continue  # verl asks only after should_deactivate said True
                ref = copy.deepcopy(p)
                out = p.deactivate_wait_samples(c)
                queue = line["stats"]["monitor/queue/mq_queue_size"]
                first = ref.policy.decide(ref.observe(ref._step[0], True, c, True, line["stats"]))
                k = out - queue
                moves = [first.action is Action.TO_TRAINING] + [
                    copy.deepcopy(ref.policy)
                    .decide(ref.observe(ref._step[0], True, c, True, line["stats"], done=j))
                    .action
                    is Action.TO_TRAINING
                    for j in range(1, k + 1)
                ]
                assert k >= 0 and not any(moves[:k])
                assert moves[k] or "keeps the hybrids" in p.last_reason
                waits.append(out)
                active = False
            elif hook == "should_activate_after_step":
                out = p.should_activate_after_step(args[0], active, c)
                assert isinstance(out, bool) and p.last_reason
                acts.append(out)
                active = active or out
            else:
                assert getattr(p, hook)(*args, c) is None
        assert len(acts) == 12
        if name == "waterlevel":
            assert any(acts) and waits, "the core never went back and forth"


def test_tidal_is_a_verl_plugin():
    """verl 0.9.1 imports every ``verl.plugins`` entry point when it is imported (Ray workers
    included): tidal's points at the bridge, which registers the policies."""
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="verl.plugins") if ep.name == "tidal"]
    if not eps:
        pytest.skip("tidal is not installed as a distribution here (pip install -e .)")
    assert eps[0].value == "tidal.integrations.verl"
    assert eps[0].load().register is not None
