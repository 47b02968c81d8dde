"""The proxy's call records (serving) become training records (training) without loss."""

import pytest

from tidal.serving.records import ModelCall, Segment
from tidal.training.records import RecordError, record_from_proxy, record_to_sequences


def _rerouted_call():
    # 3 tokens from engine A at v1, drained; 2 more at engine B, the last one after B loaded v2
    a = Segment("A", "r1", [5, 6, 7], [-0.1, -0.2, -0.3], ["v1", "v1", "v1"], ended_by="drain")
    b = Segment("B", "r2", [8, 9], [-0.4, -0.5], ["v1", "v2"], cached_tokens=12)
    return ModelCall("c0", [1, 2, 3], 5, [a, b], "length")


def test_rerouted_call_keeps_every_token_logprob_and_version():
    rec = record_from_proxy("ex1", "g1", [_rerouted_call().to_json()], reward=1.0,
                            reason="timeout")
    call = rec.calls[0]
    assert call.output_token_ids == [5, 6, 7, 8, 9]
    assert call.output_logprobs == [-0.1, -0.2, -0.3, -0.4, -0.5]
    assert [(s.start, s.end, s.weight_version) for s in call.segments] == [(0, 4, 1), (4, 5, 2)]
    assert rec.status == "timed_out" and rec.min_version() == 1
    (seq,) = record_to_sequences(rec)
    assert seq.n_trainable() == 5 and seq.versions[-2:] == [1, 2]


def test_inconsistent_segment_is_rejected():
    bad = _rerouted_call().to_json()
    bad["segments"][0]["logprobs"] = [-0.1]
    with pytest.raises(RecordError, match="log-probs"):
        record_from_proxy("ex1", "g1", [bad], reward=0.0)
    with pytest.raises(RecordError, match="close reason"):
        record_from_proxy("ex1", "g1", [], reward=0.0, reason="exploded")
