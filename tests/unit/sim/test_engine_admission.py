"""Admission control in the simulator: engines keep their concurrency target and fair order,
the world keeps every invariant, and the oracle stays a lower bound with admission on."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.control.admission import FairQueue
from tidal.control.policy import registered
from tidal.sim.engines import Engine
from tidal.sim.oracle import oracle_bound
from tidal.sim.runner import run_policy
from tidal.sim.scenario import load
from tidal.sim.world import World
from tidal.testing.sim_scenarios import tiny_scenario

CASES = {"dapo-math-32gpu": (0.5, 3), "qwengyre-long-tail": (0.25, 2)}  # as test_oracle


def specs(cells: int, standalone: int) -> list[str]:
    """Every registered policy; static on one cell and on all (all but one without a
    standalone engine)."""
    cells = cells if standalone else cells - 1
    out: list[str] = []
    for name in sorted(registered()):
        out += sorted({"static:cells=1", f"static:cells={cells}"}) if name == "static" else [name]
    return out


ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "remove", "finish"]), st.integers(0, 3), st.floats(1.0, 500.0)
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 6), ops)
def test_engine_keeps_its_target_and_fair_order(target, steps):
    e = Engine("e", 8, 64, 800.0, 100.0)
    e.admit(target, FairQueue())
    now, seq, started = 0.0, 0, []
    for op, group, x in steps:
        if op == "add":
            seq += 1
            before = set(e.sequences())
            e.add(seq, x, now, group=group)
            started += [s for s in e.sequences() if s not in before]
        elif op == "remove" and e.sequences():
            before = set(e.sequences())
            e.remove(e.sequences()[0], now)
            started += sorted(s for s in e.sequences() if s not in before)
        else:
            nf = e.next_finish()
            if nf is not None:
                now = nf
                before = set(e.sequences())
                e.pop_finished(now)
                started += sorted(s for s in e.sequences() if s not in before)
        assert e.active <= target
        assert e.waiting == 0 or e.active == target  # never idle below target with a queue
    assert len(started) == len(set(started))


def test_queued_sequences_are_removable_with_their_whole_work():
    e = Engine("e", 8, 64, 800.0, 100.0)
    e.admit(1, FairQueue())
    e.add(1, 100.0, 0.0)
    e.add(2, 50.0, 0.0)
    assert e.has(2) and e.remaining(2) == 50.0 and e.active == 1
    assert e.remove(2, 0.5) == 50.0 and not e.has(2)


def test_world_keeps_the_invariants_with_admission_on():
    sc = tiny_scenario(control={"admission": "saturation"})
    w = World(sc, "tidal", check=True)
    assert all(e.target < e.slots for e in w.engines)
    w.run()
    assert w.done


@pytest.mark.parametrize("rule", ["saturation", 0.02])
@pytest.mark.parametrize("scenario", ["dapo-math-32gpu", "qwengyre-long-tail"])
def test_no_policy_beats_the_bound_with_admission_on(scenario, rule):
    factor, bursts = CASES[scenario]
    base = load(scenario).scaled(factor, bursts=bursts)
    sc = base.model_copy(
        update={
            "control": base.control.model_copy(
                update={
                    "admission": rule,
                    "admission_order": "shortest_remaining" if rule == 0.02 else "longest_waiting",
                }
            )
        }
    )
    bound = oracle_bound(sc)
    for spec in specs(len(sc.cluster.cell_specs()), sc.cluster.standalone_count):
        res = run_policy(sc, spec, oracle=bound, keep_log=False)
        assert any(e.queue is not None for e in res.world.engines)
        assert res.summary["makespan_s"] >= bound.makespan_s, (spec, rule, bound)
