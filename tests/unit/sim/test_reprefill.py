"""Re-prefill is charged once per reroute or sync, at prefill speed, never as decode work.

A property test drives a small world and, between events, aborts engines (a weight sync's
flush), moves executions (with and without KV handoff, held or not), rebalances and
redistributes (verl V1), in random
order; after every event and every action the world's invariants hold, including: a request's
pending or remaining work never exceeds its turn's decode tokens, and a queued prefill never
exceeds one prefill of the request's whole context. Then a multi-turn fully-async run on the
cost model (frequent syncs that abort long contexts) finishes every execution it launched.
"""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tidal.sim import moves, sync
from tidal.sim.engines import Engine
from tidal.sim.runner import run_policy
from tidal.sim.world import World
from tidal.testing.sim_scenarios import tiny_scenario

OPS = st.lists(
    st.tuples(
        st.sampled_from(
            ["events", "abort", "resume", "move", "rebalance", "redistribute", "release"]
        ),
        st.integers(0, 10_000),
        st.booleans(),
    ),
    min_size=5,
    max_size=40,
)


def _world(seed: int) -> World:
    sc = tiny_scenario(
        seed=seed,
        control={"group_size": 4, "batch_groups": 3, "updates_per_burst": 2, "bursts": 3},
        workload={
            "classes": [
                {
                    "turns": {"median": 3, "sigma": 0.5},
                    "decode_tokens": {"median": 600, "sigma": 0.8, "cap": 4000},
                    "tool_s": {"median": 2.0, "sigma": 1.0, "cap": 30},
                    "tool_output_tokens": {"median": 200},
                }
            ]
        },
        engine={"decode_tok_s_per_gpu": 400.0, "seq_cap_tok_s": 100.0, "prefill_equiv": 0.05},
        sim={"max_virtual_s": 86400.0},
    )
    return World(sc, "verl-fixed-ratio", check=True)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 1000), ops=OPS)
def test_random_syncs_and_moves_never_compound_prefill(seed, ops):
    w = _world(seed)
    w.run_events(1)
    held = []
    for op, k, flag in ops:
        live = sorted(
            (ex for ex in w.live.values() if ex.engine is not None), key=lambda x: x.seq_no
        )
        if op == "events":
            w.run_events(1 + k % 60)
        elif op == "abort":
            e = w.engines[k % len(w.engines)]
            sync.abort_requests(w, e, w.now)
            e.set_paused(True, w.now)
            w.resched(e)
        elif op == "resume":
            for e in w.engines:
                if e.paused and not w.syncing:
                    sync.resume_requests(w, e)
        elif op == "move" and live:
            ex = live[k % len(live)]
            if ex.hold:
                continue
            dests = [e for e in w.engines if e.admitting and e is not ex.engine]
            dest = moves.pick_destination(w, dests, ordered=False)
            moves.move(w, ex, dest, kv=flag, hold=flag and dest is not None)
            if ex.hold:
                held.append(ex)
        elif op == "rebalance":
            moves.rebalance(w)
        elif op == "redistribute":
            moves.redistribute(w)
        elif op == "release" and held:
            moves.release_hold(w, held.pop(0), kv=flag)
        w.check_invariants()
    for ex in held:
        moves.release_hold(w, ex, kv=False)
    for e in w.engines:
        if e.paused and not w.syncing:
            sync.resume_requests(w, e)
    w.check_invariants()
    while w.run_events(5000):
        pass
    assert w.trainer.step == w.trainer.total_steps


def test_repeated_aborts_charge_one_prefill_of_the_context():
    # One request of 1000 decode tokens at 9000 tokens of context, aborted ten times before
    # it decodes anything: its work stays 1000 tokens and its prefill is one prefill.
    e = Engine(
        "e", gpus=8, slots=4, throughput_tok_s=1000.0, seq_cap_tok_s=100.0, prefill_equiv=0.1
    )
    now = 0.0
    for i in range(10):
        e.add(i, 1000.0, now, ctx_tokens=10_000, prefill_tokens=9000)
        assert e.prefills()[0][1] == e.prefill_s(9000) == 0.9
        now += 0.5
        assert e.remove(i, now) == 1000.0  # the prefill was not finished: nothing decoded
    e.add(99, 1000.0, now, ctx_tokens=10_000, prefill_tokens=9000)
    assert e.next_finish() == now + 0.9  # the prefill first, decode waits
    e.advance(now + 0.9)
    assert e.prefilling == 0 and e.remaining(99) == 1000.0
    assert e.next_finish() == now + 0.9 + 10.0  # then 1000 tokens at the 100 tok/s cap


def test_multi_turn_fully_async_finishes_every_execution():
    # Multi-turn agents reaching ~60K tokens of context on the cost model, verl's fully-async
    # mechanics (every sync aborts and flushes, partial rollout), a sync every step and a
    # large staleness budget. Before the fix pending work compounded at every sync: after 30
    # versions executions of version 0 were still running (and never would finish).
    sc = tiny_scenario(
        seed=3,
        cluster={
            "cells": [{"gpus": 4, "slots": 64, "kind": "hybrid"}],
            "standalone_count": 2,
            "standalone_gpus": 4,
            "standalone_slots": 64,
        },
        control={"group_size": 4, "batch_groups": 2, "updates_per_burst": 1, "bursts": 30},
        workload={
            "classes": [
                {
                    "turns": {"median": 10, "sigma": 0.3, "cap": 20},
                    "decode_tokens": {"median": 1500, "sigma": 0.7, "cap": 8000},
                    "tool_s": {"median": 5.0, "sigma": 1.0, "cap": 60},
                    "tool_output_tokens": {"median": 5000, "sigma": 0.5, "cap": 20000},
                    "prompt_tokens": 4000,
                }
            ]
        },
        sim={"staleness_threshold": 4.0},
        costmodel={
            "gpu": "H20",
            "model": "qwen2.5-7b",
            "engine_tp": 4,
            "efficiency": {"decode": 0.27, "mfu": 0.44},
        },
    )
    res = run_policy(sc, "static:cells=1", check=True)
    w = res.world
    assert res.summary["trainer_steps"] == sc.total_steps
    # (55 retries since training counts its attention FLOPs: 69K-token contexts train 2x
    # slower, so fewer executions meet a sync)
    assert res.summary["request_retries"] > 40 and res.summary["reprefill_tokens"] > 0
    # Executions still running at the end are recent ones (an execution takes a few
    # versions); none of the early ones is stuck.
    assert all(ex.burst >= sc.control.bursts - 10 for ex in w.live.values())
