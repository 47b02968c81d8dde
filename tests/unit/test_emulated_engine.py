"""The emulated engine's timing model (a test double at scale): on an injected clock, its tokens
come at the simulator's engine's rates over the time scale k, prefill first, batches slower per
sequence, pauses stop them; sleep, wake and loads take the scenario's times over k; aborts keep
partial tokens and a KV export / import or a conversation's next call prefills only what is new;
token ids are seeded."""

from __future__ import annotations

import asyncio

import pytest

from tidal.clock import ManualClock
from tidal.errors import ConfigError
from tidal.serving.emulated import EmulatedEngine
from tidal.serving.emulated_timing import (
    EmulatedTiming,
    engine_slot,
    resolved_scenario,
    scenario_engines,
    sim_engine,
)
from tidal.serving.protocol import BadRequest, GenerateRequest, SamplingParams

SC = resolved_scenario("dapo-math-32gpu")


def _timing(k: float = 10.0, name: str = "s0") -> tuple[EmulatedTiming, ManualClock]:
    clock = ManualClock(100.0)
    return EmulatedTiming(SC, engine_slot(SC, name), k, clock), clock


def test_the_scenarios_engines_are_named_as_the_runtime_names_them():
    assert [(e.name, e.kind, e.gpus, e.slots) for e in scenario_engines(SC)] == [
        ("s0", "standalone", 8, 128),
        ("s1", "standalone", 8, 128),
        ("c0", "hybrid", 8, 128),
        ("c1", "hybrid", 8, 128),
    ]
    with pytest.raises(ConfigError, match=r"no engine 'c7' \(s0, s1, c0, c1\)"):
        engine_slot(SC, "c7")


def test_one_sequence_decodes_at_the_cost_models_rate_over_k():
    t, clock = _timing(k=10.0)
    model = sim_engine(SC, engine_slot(SC, "s0")).model
    t.add("a", 1000, prompt_tokens=300)
    prefill = model.prefill_s(300)  # emulated seconds on one replica
    assert t.decoded("a") == 0
    # the first event is the prefill's end, k times sooner in real time
    assert t.next_event_real_s() == pytest.approx(prefill / 10.0)
    clock.advance(prefill / 10.0)
    t.decoded("a")
    rate = model.seq_rate(1, 300 + 500)  # the sim counts a turn's context at its mean
    clock.advance(10.0)  # 100 emulated seconds
    assert t.decoded("a") == min(1000, int(rate * 100))
    assert t.pop_finished() == ([] if rate * 100 < 1000 else ["a"])


def test_a_batch_decodes_slower_per_sequence_and_faster_in_all():
    one, c1 = _timing()
    many, c2 = _timing()
    one.add("x", 100000, 300)
    for i in range(64):
        many.add(f"x{i}", 100000, 300)
    for t, c in ((one, c1), (many, c2)):
        c.advance(5.0)
        t.decoded("x" if t is one else "x0")  # past the prefills
        c.advance(5.0)
    per_one = one.decoded("x")
    per_many = many.decoded("x0")
    assert per_many < per_one
    assert 64 * per_many > 2 * per_one
    assert many.tokens_per_s() > one.tokens_per_s()


def test_k_divides_every_duration_and_pauses_stop_decoding():
    slow, c1 = _timing(k=1.0)
    fast, c2 = _timing(k=20.0)
    for t in (slow, fast):
        t.add("a", 400, 300)
    assert slow.next_event_real_s() == pytest.approx(20.0 * fast.next_event_real_s())
    assert (slow.sleep_real_s, slow.wake_real_s) == (3.0, 3.0)  # the scenario's costs
    assert fast.sleep_real_s == pytest.approx(3.0 / 20) and fast.load_real_s == pytest.approx(
        SC.costs.sync_s / 20
    )
    c2.advance(1.0)
    before = fast.decoded("a")
    fast.set_paused(True)
    c2.advance(5.0)
    assert fast.decoded("a") == before and fast.next_event_real_s() is None
    fast.set_paused(False)
    c2.advance(60.0)
    assert fast.pop_finished() == ["a"] and len(fast) == 0
    with pytest.raises(ConfigError, match="time scale"):
        _timing(k=0.0)


def _req(rid: str, prompt: list[int], n: int, **kw) -> GenerateRequest:
    return GenerateRequest(rid, prompt, SamplingParams(max_tokens=n, **kw))


def test_the_engine_finishes_seeded_aborts_partial_and_hands_kv_over():
    async def go():
        a, ca = _timing(k=10.0, name="s0")
        b, _ = _timing(k=10.0, name="c0")
        ea, eb = EmulatedEngine(a, "s0", seed=1, clock=ca), EmulatedEngine(b, "c0", clock=ca)
        prompt = list(range(1, 301))
        # seeded: the same seed gives the same ids
        for rid in ("r1", "r2"):
            ea._admit(_req(rid, prompt, 50, seed=7))
        ca.advance(30.0)
        ea._loop_once()
        r1, r2 = ea._requests["r1"], ea._requests["r2"]
        assert r1.finish_reason == r2.finish_reason == "stop"
        assert r1.tokens == r2.tokens and len(r1.tokens) == 50
        assert r1.tokens[-1] == ea.tokenizer.eos_id and r1.versions == ["v0"] * 50
        # an abort keeps the tokens decoded so far; keep_kv pins them for export
        other = [2, *prompt[1:]]  # another conversation: it finds no prefix of the first's
        ea._admit(_req("long", other, 100000, ignore_eos=True))
        ca.advance(5.0)
        assert ea.abort(["long"], keep_kv=True) == 1
        long = ea._requests["long"]
        assert long.finish_reason == "abort" and 0 < len(long.tokens) < 100000
        blob = await ea.export_kv("long")
        handle, n = await eb.import_kv(blob)
        assert n == 300 + len(long.tokens)
        # the moved call prefills only its new tokens
        again = other + long.tokens + [7, 8]
        eb._admit(GenerateRequest("long2", again, SamplingParams(max_tokens=5), kv_handle=handle))
        assert eb._requests["long2"].cached_tokens == n
        # a conversation's next call on the same engine finds its prefix
        ea._admit(_req("next", prompt + r1.tokens + [9], 5))
        assert ea._requests["next"].cached_tokens == 350
        with pytest.raises(BadRequest, match="already in flight"):
            ea._admit(_req("next", prompt, 5))
        with pytest.raises(BadRequest, match="not an emulated"):
            await eb.import_kv(b"garbage")
        s = ea.stats()
        assert s["emulated"] is True and s["k"] == 10.0 and s["finished"] == 2

    asyncio.run(go())


def test_sleep_wake_and_load_take_the_scenarios_times_over_k():
    async def go():
        t, clock = _timing(k=4.0)
        e = EmulatedEngine(t, "s0", clock=clock)
        e._admit(_req("a", [1, 2, 3, 4, 5], 1000))
        t0 = clock.now()
        await e.sleep(2)
        assert clock.now() - t0 == pytest.approx(SC.costs.sleep_s / 4)
        assert e.is_sleeping and e._requests["a"].finish_reason == "abort"
        await e.wake_up()
        assert clock.now() - t0 == pytest.approx((SC.costs.sleep_s + SC.costs.wake_s) / 4)
        await e.update_weights("ignored", "v3")
        assert e.weight_version == "v3" and e.last_pause_s == pytest.approx(SC.costs.sync_s / 4)

    asyncio.run(go())
