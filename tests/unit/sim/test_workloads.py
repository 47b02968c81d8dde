"""Workload draws are seeded, capped and group-correlated; traces replay."""

import json

import pytest

from tidal.errors import ConfigError
from tidal.sim.scenario import Dist, ExecutionClass
from tidal.sim.workloads import ClassWorkload, TraceWorkload, load_trace, write_trace


def test_same_seed_same_groups_and_caps_hold():
    cls = ExecutionClass(decode_tokens=Dist(median=9000, sigma=0.75, cap=20000))
    a = [ClassWorkload([cls], 3).group(8) for _ in range(50)]
    b = [ClassWorkload([cls], 3).group(8) for _ in range(50)]
    assert a == b
    assert all(1 <= s.decode_tokens <= 20000 for g in a for s in g)


def test_group_share_correlates_lengths_within_a_group():
    import statistics

    def spread(share):
        wl = ClassWorkload([ExecutionClass(group_share=share)], 1)
        groups = [[s.decode_tokens for s in wl.group(8)] for _ in range(300)]
        return statistics.mean(statistics.pstdev(g) / statistics.mean(g) for g in groups)

    assert spread(0.9) < spread(0.0)


def test_multi_turn_executions_have_tools_between_turns_only():
    cls = ExecutionClass(
        turns=Dist(median=5, sigma=0.0),
        tool_s=Dist(median=2.0),
        tool_output_tokens=Dist(median=100),
    )
    spec = ClassWorkload([cls], 0).group(1)[0]
    assert len(spec.turns) == 5
    assert spec.turns[-1][1] == 0.0 and spec.turns[-1][2] == 0
    assert spec.min_duration_s(100.0) == pytest.approx(spec.decode_tokens / 100 + 8.0)


def test_trace_round_trip_and_cycling(tmp_path):
    groups = [ClassWorkload([ExecutionClass()], 2).group(3) for _ in range(2)]
    path = tmp_path / "t.jsonl"
    write_trace(path, groups)
    assert [[s.turns for s in g] for g in load_trace(path)] == [
        [s.turns for s in g] for g in groups
    ]
    wl = TraceWorkload(path)
    assert [wl.group(3) for _ in range(3)][2][0].turns == groups[0][0].turns


def test_bad_trace_line_names_the_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"group": "g", "turns": []}) + "\n")
    with pytest.raises(ConfigError, match=r"t\.jsonl:1"):
        load_trace(path)
