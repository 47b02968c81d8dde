"""``tidal run configs/verifiers.yaml`` end to end, shortened (a tiny model made here, one burst
of two groups of four): every execution plays its task of the verifiers.v1 environment (a
reasoning-gym taskset built in-process) through verifiers' own ``TrainClient`` against the
proxy's token-in route, and is scored by the task's own reward. Checked: no failed request, no
lost execution, every execution trained, each reward is the environment's (the one its verifiers
trace carries), and the training record of each execution holds exactly the token ids, sampled
mask and log-probs of its verifiers trace (what verifiers received from the engine)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tidal.cli import main

if importlib.util.find_spec("verifiers") is None or importlib.util.find_spec("renderers") is None:
    pytest.skip("verifiers 0.4 is not installed (the 'verifiers' extra)", allow_module_level=True)
CONFIG = Path(__file__).resolve().parents[3] / "configs" / "verifiers.yaml"


def test_verifiers_environment_trains_and_records_what_verifiers_received(tmp_path, monkeypatch):
    import tidal.runtime.bridge as bridge
    from tidal.models import create_tiny

    records: dict = {}

    def keep(*args, **kwargs):
        rec = record_from_proxy(*args, **kwargs)
        records[rec.execution_id] = rec
        return rec

    record_from_proxy = bridge.record_from_proxy
    monkeypatch.setattr(bridge, "record_from_proxy", keep)
    model = create_tiny(tmp_path / "tiny", seed=3, max_seq_len=256)
    out = tmp_path / "run"
    sets = [
        f"runtime.model={model}",
        f"task.agent.args.tokenizer={model}",
        "control.bursts=1",
        "control.group_size=4",
        "control.batch_groups=2",
        "runtime.run_timeout_s=300",
        "runtime.execution_timeout_s=120",
    ]
    argv = ["run", str(CONFIG), "--out", str(out)]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed_requests"] == 0 and summary["lost_executions"] == 0
    assert summary["dispatched"] == summary["closed"] == summary["trained_executions"] == 8
    assert summary["record_errors"] == [] and summary["close_reasons"] == {"completed": 8}

    lines = [json.loads(x) for x in (out / "executions.jsonl").read_text().splitlines()]
    assert len(lines) == 8 == len(records)
    for line in lines:
        eid = line["execution"]
        trace = json.loads(
            (out / "workspaces" / eid / ".tidal" / "verifiers_trace.json").read_text()
        )
        assert line["reward"] == trace["reward"] == sum(trace["rewards"].values())
        assert 0.0 <= trace["reward"] <= 1.0 and list(trace["rewards"]) == ["correct"]
        [call] = records[eid].calls
        assert call.prompt_token_ids + call.output_token_ids == trace["token_ids"]
        assert trace["sampled_mask"] == (
            [False] * len(call.prompt_token_ids) + [True] * len(call.output_token_ids)
        )
        assert call.output_token_ids and records[eid].reward == trace["reward"]
        sampled = [lp for lp, m in zip(trace["logprobs"], trace["sampled_mask"], strict=True) if m]
        assert call.output_logprobs == pytest.approx(sampled)


MULTITURN = CONFIG.with_name("verifiers-multiturn.yaml")


@pytest.mark.slow  # a real run: 12 s here with the tiny model (2026-12-06)
def test_multiturn_environment_trains_every_turn_as_sampled(tmp_path, monkeypatch):
    """``configs/verifiers-multiturn.yaml`` shortened (a tiny model, one burst of two groups of
    four): every execution makes ``runtime.max_turns`` calls (the tiny model never answers
    right, so the feedback environment always asks again), each turn's prompt ids, sampled ids
    and log-probs in the proxy's record are the ones verifiers received, each turn's prompt
    extends the last turn's prompt and sampled ids (one chain: 0 chain breaks), and the record
    trains on exactly every turn's sampled ids."""
    import tidal.runtime.bridge as bridge
    from tidal.models import create_tiny
    from tidal.training.records import record_to_sequences

    records: dict = {}

    def keep(*args, **kwargs):
        rec = record_from_proxy(*args, **kwargs)
        records[rec.execution_id] = rec
        return rec

    record_from_proxy = bridge.record_from_proxy
    monkeypatch.setattr(bridge, "record_from_proxy", keep)
    model = create_tiny(tmp_path / "tiny", seed=3, max_seq_len=512)
    out = tmp_path / "run"
    sets = [
        f"runtime.model={model}",
        f"task.agent.args.tokenizer={model}",
        "control.group_size=4",
        "control.batch_groups=2",
        "runtime.run_timeout_s=300",
        "runtime.execution_timeout_s=120",
    ]
    argv = ["run", str(MULTITURN), "--bursts", "1", "--out", str(out)]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed_requests"] == 0 and summary["lost_executions"] == 0
    assert summary["dispatched"] == summary["closed"] == summary["trained_executions"] == 8
    assert summary["record_errors"] == [] and summary["close_reasons"] == {"completed": 8}

    lines = [json.loads(x) for x in (out / "executions.jsonl").read_text().splitlines()]
    assert len(lines) == 8 == len(records)
    for line in lines:
        eid = line["execution"]
        trace = json.loads(
            (out / "workspaces" / eid / ".tidal" / "verifiers_trace.json").read_text()
        )
        assert line["reward"] == trace["reward"] < 1.0
        turns = trace["turns"]
        assert len(turns) == len(records[eid].calls) == 3
        assert [t["feedback"] is not None for t in turns] == [True, True, False]
        for i, (call, turn) in enumerate(zip(records[eid].calls, turns, strict=True)):
            assert call.prompt_token_ids == turn["prompt_ids"]
            if i:  # one chain: each prompt extends the last prompt and its sampled ids
                last = turns[i - 1]["prompt_ids"] + turns[i - 1]["completion_ids"]
                assert turn["prompt_ids"][: len(last)] == last and turn["bridged"], (eid, i)
            assert call.output_token_ids == turn["completion_ids"] and turn["completion_ids"]
            assert call.output_logprobs == pytest.approx(turn["logprobs"])
        trained = [
            tok
            for seq in record_to_sequences(records[eid])
            for tok, m in zip(seq.token_ids, seq.trainable, strict=True)
            if m
        ]
        assert trained == [tok for t in turns for tok in t["completion_ids"]]
