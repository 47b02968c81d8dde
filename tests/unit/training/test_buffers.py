"""Trajectory and packing buffers: grouping, staleness at consumption, exactly-once claims."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.clock import ManualClock
from tidal.contracts import CallRecord, ExecutionRecord, Segment
from tidal.errors import InvariantViolation
from tidal.training.packing import PackingBuffer, PackingConfig
from tidal.training.records import RecordError, record_to_sequences, single_call_record
from tidal.training.trajectory_buffer import (
    TrajectoryBuffer,
    TrajectoryBufferConfig,
    group_advantages,
)


def rec(
    eid: str, gid: str, version: int = 0, reward: float = 0.0, n_out: int = 5, n_prompt: int = 3
) -> ExecutionRecord:
    return single_call_record(
        eid, gid, list(range(1, n_prompt + 1)), [7] * n_out, [-1.0] * n_out, version, reward
    )


def _call(
    prompt: list[int], out: list[int], logprobs: list[float], versions: list[str]
) -> CallRecord:
    seg = Segment(
        engine_id="e0", request_id="r", token_ids=out, logprobs=logprobs, versions=versions
    )
    return CallRecord(prompt_token_ids=prompt, segments=[seg])


def test_multi_turn_record_chains_calls_and_masks_injected_tokens():
    calls = [
        _call([1, 2], [3, 4], [-0.1, -0.2], ["v3", "v4"]),
        # The harness appends a tool result (5, 6) before the next call: context, not trainable.
        _call([1, 2, 3, 4, 5, 6], [7], [-0.3], ["v4"]),
        # Context compaction: the prompt no longer extends the stream -> a new sequence.
        _call([9, 7], [8], [-0.4], ["v5"]),
    ]
    r = ExecutionRecord(execution_id="e", group_id="g", calls=calls, reward=1.0, reason="timeout")
    first, second = record_to_sequences(r)
    assert first.token_ids == [1, 2, 3, 4, 5, 6, 7]
    assert first.trainable == [False, False, True, True, False, False, True]
    assert first.versions == [-1, -1, 3, 4, -1, -1, 4]
    assert first.behaviour_logprobs[2:4] == [-0.1, -0.2]
    assert second.token_ids == [9, 7, 8] and second.trainable == [False, False, True]
    assert r.min_version() == 3 and r.trainable_tokens() == 4


def test_engine_version_labels_are_read():
    assert _call([1], [2, 3], [0.0, 0.0], ["v12", "12"]).versions() == [12, 12]


def test_a_segment_needs_a_logprob_and_a_version_per_token():
    with pytest.raises(RecordError):
        _call([1], [2, 3], [0.0, 0.0], ["v0"])
    with pytest.raises(RecordError):
        _call([1], [2, 3], [0.0], ["v0", "v0"])


def test_group_advantages_are_normalised():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    assert group_advantages([0.5, 0.5]) == [0.0, 0.0]


def test_groups_become_ready_when_complete_and_duplicates_are_ignored():
    buf = TrajectoryBuffer(TrajectoryBufferConfig(group_size=2), ManualClock())
    buf.add(rec("a", "g1"))
    buf.add(rec("a", "g1"))
    assert len(buf) == 0
    buf.add(rec("b", "g1", reward=1.0))
    (g,) = buf.take(4, version=0)
    assert [r.execution_id for r in g.records] == ["a", "b"]
    assert g.advantages[1] > 0 > g.advantages[0]


@pytest.mark.parametrize("on_stale", ["drop", "wait"])
def test_data_older_than_the_max_lag_is_never_handed_out(on_stale):
    cfg = TrajectoryBufferConfig(group_size=1, max_policy_lag=2, on_stale=on_stale)
    buf = TrajectoryBuffer(cfg, ManualClock())
    for v in range(6):
        buf.add(rec(f"e{v}", f"g{v}", version=v))
    taken = buf.take(6, version=5, timeout_s=0.0)
    if on_stale == "wait":
        assert taken == []  # only 3 fresh groups, 6 asked: wait hands out nothing yet
        buf.close()
        taken = buf.take(6, version=5)
    assert sorted(g.group_id for g in taken) == ["g3", "g4", "g5"]
    assert buf.stats.groups_dropped_stale == 3
    assert sorted(buf.stats.dropped_group_ids) == ["g0", "g1", "g2"]
    assert buf.stats.max_staleness_taken == 2
    g3 = next(g for g in taken if g.group_id == "g3")
    assert max(g3.staleness[0][0]) == 2  # per-token staleness recorded on trainable tokens


def test_mixed_version_execution_is_stale_by_its_oldest_token():
    call = _call([1], [2, 3], [0.0, 0.0], ["v1", "v4"])
    r = ExecutionRecord(execution_id="e", group_id="g", calls=[call], reward=0.0)
    buf = TrajectoryBuffer(TrajectoryBufferConfig(group_size=1, max_policy_lag=2), ManualClock())
    buf.add(r)
    assert buf.take(1, version=4) == []


def _groups(n_groups: int, sizes: list[int]):
    buf = TrajectoryBuffer(TrajectoryBufferConfig(group_size=2), ManualClock())
    for g in range(n_groups):
        for i in range(2):
            buf.add(
                rec(f"g{g}e{i}", f"g{g}", n_out=sizes[(2 * g + i) % len(sizes)], reward=float(i))
            )
    return buf.take(n_groups, version=0)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    n_groups=st.integers(1, 6),
    budget=st.integers(8, 64),
    ops=st.lists(
        st.tuples(st.sampled_from(["claim", "complete", "tick", "die"]), st.integers(0, 2)),
        max_size=80,
    ),
    seed=st.integers(0, 1000),
)
def test_every_micro_step_is_done_exactly_once_despite_deaths_and_expiry(
    sizes, n_groups, budget, ops, seed
):
    clock = ManualClock()
    pb = PackingBuffer(PackingConfig(token_budget=budget, claim_timeout_s=5.0), clock)
    pb.open_batch(0, version=0)
    groups = _groups(n_groups, sizes)
    pb.add_groups(groups[: len(groups) // 2])
    pb.add_groups(groups[len(groups) // 2 :])
    pb.seal()
    held: dict[str, list] = {f"w{i}": [] for i in range(3)}
    accepted: dict[int, str] = {}
    rng = random.Random(seed)
    for op, w in ops:
        worker = f"w{w}"
        if op == "claim":
            c = pb.claim(worker)
            if c.kind == "micro_step":
                held[worker].append(c.micro_step)
        elif op == "complete" and held[worker]:
            ms = held[worker].pop(rng.randrange(len(held[worker])))
            if pb.complete(worker, ms.batch_id, ms.index):
                assert ms.index not in accepted
                accepted[ms.index] = worker
        elif op == "tick":
            clock.advance(3.0)
        elif op == "die":
            held[worker].clear()
            for i in [i for i, x in accepted.items() if x == worker]:
                del accepted[i]
            pb.reopen(worker)
    # A surviving worker drains the rest (expired leases come back after the timeout).
    while not pb.all_done():
        c = pb.claim("last")
        if c.kind == "micro_step":
            assert pb.complete("last", 0, c.micro_step.index)
            accepted[c.micro_step.index] = "last"
        else:
            clock.advance(5.0)
    summary = pb.finish()
    assert summary.done_by == accepted
    assert summary.n_executions == 2 * n_groups
    # Token coverage: every trainable token of the batch is in exactly one done micro-step.
    want = sum(r.trainable_tokens() for g in groups for r in g.records)
    assert summary.n_trainable_tokens == want


def test_packing_respects_the_budget_and_finish_refuses_undone_work():
    clock = ManualClock()
    pb = PackingBuffer(PackingConfig(token_budget=20, claim_timeout_s=1.0), clock)
    pb.open_batch(3, version=0)
    pb.add_groups(_groups(3, [4, 9]))  # sequences of 7 and 12 tokens
    first = pb.claim("a")
    assert first.kind == "micro_step" and first.micro_step.n_tokens() <= 20
    assert pb.claim("b").kind in ("micro_step", "wait")
    pb.seal()
    with pytest.raises(InvariantViolation):
        pb.finish()
    clock.advance(1.0)  # both leases expire
    assert not pb.complete("zzz", 3, first.micro_step.index)
    while (c := pb.claim("c")).kind == "micro_step":
        assert c.micro_step.n_tokens() <= 20
        assert pb.complete("c", 3, c.micro_step.index)
    assert not pb.complete("a", 3, first.micro_step.index), "an expired claim stays refused"
    s = pb.finish()
    assert set(s.done_by.values()) == {"c"} and s.reclaimed >= 1
