"""The proxy's call records (serving) become training records (training) without loss: one
``CallRecord`` on both sides, through its wire JSON."""

import pytest

from tidal.contracts import CallRecord, CloseReason, Segment
from tidal.training.records import RecordError, record_from_proxy, record_to_sequences


def _rerouted_call() -> CallRecord:
    # 3 tokens from engine A at v1, drained; 2 more at engine B, the last one after B loaded v2
    a = Segment(
        engine_id="A",
        request_id="r1",
        token_ids=[5, 6, 7],
        logprobs=[-0.1, -0.2, -0.3],
        versions=["v1", "v1", "v1"],
        ended_by="drain",
    )
    b = Segment(
        engine_id="B",
        request_id="r2",
        token_ids=[8, 9],
        logprobs=[-0.4, -0.5],
        versions=["v1", "v2"],
        cached_tokens=12,
    )
    return CallRecord(
        call_id="c0",
        prompt_token_ids=[1, 2, 3],
        max_tokens=5,
        segments=[a, b],
        finish_reason="length",
    )


def test_rerouted_call_keeps_every_token_logprob_and_version():
    sent = _rerouted_call()
    wire = sent.model_dump(mode="json")
    assert wire["output_token_ids"] == [5, 6, 7, 8, 9]
    assert wire["segments"][1]["weight_versions"] == [[0, 1, "v1"], [1, 2, "v2"]]
    rec = record_from_proxy("ex1", "g1", [wire], reward=1.0, reason="timeout")
    call = rec.calls[0]
    assert call == sent
    assert call.output_logprobs == [-0.1, -0.2, -0.3, -0.4, -0.5]
    assert call.versions() == [1, 1, 1, 1, 2]
    assert rec.reason is CloseReason.TIMEOUT and rec.min_version() == 1
    (seq,) = record_to_sequences(rec)
    assert seq.n_trainable() == 5 and seq.versions[-2:] == [1, 2]


def test_inconsistent_segment_is_rejected():
    bad = _rerouted_call().model_dump(mode="json")
    bad["segments"][0]["logprobs"] = [-0.1]
    with pytest.raises(RecordError, match="log-probs"):
        record_from_proxy("ex1", "g1", [bad], reward=0.0)
    bad = _rerouted_call().model_dump(mode="json")
    bad["segments"][0]["versions"] = ["v1", "base", "v1"]
    with pytest.raises(RecordError, match="'base' is not v<n>"):
        record_from_proxy("ex1", "g1", [bad], reward=0.0)
    with pytest.raises(RecordError, match="close reason"):
        record_from_proxy("ex1", "g1", [], reward=0.0, reason="exploded")
