"""Processor sharing inside an engine, advanced analytically."""

import pytest

from tidal.sim.engines import Engine


def test_single_sequence_runs_at_the_speed_cap():
    e = Engine("e", gpus=8, slots=4, throughput_tok_s=1000.0, seq_cap_tok_s=100.0)
    e.add(1, 500.0, now=0.0)
    assert e.next_finish() == pytest.approx(5.0)
    assert e.pop_finished(4.9) == []
    assert e.pop_finished(5.0) == [1]


def test_throughput_is_shared_among_active_sequences():
    e = Engine("e", gpus=8, slots=64, throughput_tok_s=1000.0, seq_cap_tok_s=100.0)
    for s in range(20):  # 20 sequences share 1000 tok/s: 50 tok/s each
        e.add(s, 100.0, now=0.0)
    assert e.rate() == pytest.approx(50.0)
    assert e.next_finish() == pytest.approx(2.0)
    assert sorted(e.pop_finished(2.0)) == list(range(20))
    assert e.busy_work == pytest.approx(2000.0)


def test_rate_changes_when_a_sequence_leaves_and_remaining_work_is_kept():
    e = Engine("e", gpus=8, slots=64, throughput_tok_s=100.0, seq_cap_tok_s=100.0)
    e.add(1, 100.0, now=0.0)
    e.add(2, 300.0, now=0.0)  # 50 tok/s each
    assert e.next_finish() == pytest.approx(2.0)
    assert e.pop_finished(2.0) == [1]
    assert e.remaining(2) == pytest.approx(200.0)
    assert e.next_finish() == pytest.approx(4.0)  # alone now: 100 tok/s
    assert e.remove(2, now=3.0) == pytest.approx(100.0)
    assert e.active == 0 and e.next_finish() is None


def test_pause_stops_progress():
    e = Engine("e", gpus=1, slots=1, throughput_tok_s=10.0, seq_cap_tok_s=10.0)
    e.add(1, 10.0, now=0.0)
    e.set_paused(True, now=0.5)
    assert e.next_finish() is None
    e.set_paused(False, now=10.0)
    assert e.next_finish() == pytest.approx(10.5)


def test_the_decode_meter_reads_tokens_and_sequence_seconds_without_advancing():
    e = Engine("e", gpus=8, slots=64, throughput_tok_s=1000.0, seq_cap_tok_s=100.0)
    for s in range(20):  # 50 tok/s each: past the knee (10 would get 100 each)
        e.add(s, 1000.0, now=0.0)
    assert e.meter_at(2.0) == pytest.approx((2000.0, 40.0))
    assert e.t == 0.0  # a reading moves nothing
    e.advance(2.0)
    assert (e.decoded, e.seq_s) == pytest.approx((2000.0, 40.0))
    e.set_paused(True, 2.0)  # a paused engine decodes nothing and its time is not counted
    assert e.meter_at(5.0) == pytest.approx((2000.0, 40.0))


def test_a_prefill_with_a_rounding_hair_left_finishes_at_its_due_time():
    """Its timer fires at ``now`` (``t + 3e-18 == t``): the prefill must end there, or the
    timer re-fires at ``now`` for ever (a generated scenario hung so)."""
    e = Engine(
        "e", gpus=8, slots=64, throughput_tok_s=1000.0, seq_cap_tok_s=100.0, prefill_equiv=1.0
    )
    e.add(1, 100.0, now=0.0, ctx_tokens=100.0, prefill_tokens=100.0)
    assert e.prefilling == 1
    due = e.next_finish()
    e.advance(due / 2)
    e._pf[0][1] = 3e-18  # what floats left of it in a generated scenario
    assert e.next_finish() == e.t
    e.advance(e.t)
    assert e.prefilling == 0 and e.active == 1
