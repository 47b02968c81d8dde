"""Execution records turned into training sequences.

In: ``contracts.ExecutionRecord`` objects - the model calls the OpenAI-compatible proxy
answered (prompt token ids, and per engine segment the output token ids, log-probs and the
weight version of each token) plus the reward and the close reason. Out: ``TrainSequence``
objects - one token stream per chain of calls whose prompts extend each other, with a trainable
mask that is true only for tokens the policy sampled (harness-injected tokens between calls are
context), and the behaviour log-prob and weight version of every trainable token.

Invariant 6: every trainable token carries the weight version that produced it; the record's
models refuse segments whose lengths or version labels disagree (``RecordError``), so such a
record never reaches here. Timed-out and cancelled executions are kept: they are scored on what
they produced.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import ValidationError

from tidal.contracts.calls import NO_VERSION, CallRecord, ExecutionRecord, Segment
from tidal.contracts.close import CLOSE_REASONS, CloseReason
from tidal.errors import RecordError
from tidal.types import CHAIN_WINDOW_CALLS, continues_chain


def record_from_proxy(
    execution_id: str,
    group_id: str,
    calls: list[dict],
    reward: float | None,
    reason: str = CloseReason.COMPLETED,
) -> ExecutionRecord:
    """The record of a closed execution from the proxy's wire JSON of its calls (the admin
    route's ``calls``: ``CallRecord`` dumps). ``reason``: its close reason. A value the models
    refuse is one ``RecordError`` naming the execution and the field."""
    if reason not in CLOSE_REASONS:
        raise RecordError(f"execution {execution_id!r}: unknown close reason {reason!r}")
    try:
        return ExecutionRecord(
            execution_id=execution_id,
            group_id=group_id,
            calls=[CallRecord.model_validate(c) for c in calls],
            reward=reward,
            reason=CloseReason(reason),
        )
    except ValidationError as exc:
        err = exc.errors()[0]
        field_ = ".".join(str(p) for p in err["loc"]) or "(call)"
        raise RecordError(f"execution {execution_id!r}: field {field_}: {err['msg']}") from None
    except RecordError as exc:
        raise RecordError(f"execution {execution_id!r}: {exc}") from None


@dataclass
class TrainSequence:
    """One token stream of an execution; position ``i`` is trainable iff the policy sampled it."""

    execution_id: str
    group_id: str
    token_ids: list[int] = field(default_factory=list)
    trainable: list[bool] = field(default_factory=list)
    behaviour_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    def n_trainable(self) -> int:
        return sum(self.trainable)

    def _append(self, tokens: list[int], logprobs: list[float] | None, versions: list[int] | None):
        self.token_ids.extend(tokens)
        if logprobs is None:
            self.trainable.extend([False] * len(tokens))
            self.behaviour_logprobs.extend([0.0] * len(tokens))
            self.versions.extend([NO_VERSION] * len(tokens))
        else:
            assert versions is not None
            self.trainable.extend([True] * len(tokens))
            self.behaviour_logprobs.extend(logprobs)
            self.versions.extend(versions)


def record_to_sequences(record: ExecutionRecord) -> list[TrainSequence]:
    """Chain calls whose prompt extends the previous stream; start a new stream otherwise.

    A prompt that does not start with the stream so far (context compaction, re-tokenisation by
    the harness) cannot share a forward pass with it, so it opens a new sequence.
    """
    sequences: list[TrainSequence] = []
    current: TrainSequence | None = None
    for call in record.calls:
        prompt = call.prompt_token_ids
        if current is not None and prompt[: len(current)] == current.token_ids:
            current._append(prompt[len(current) :], None, None)
        else:
            current = TrainSequence(record.execution_id, record.group_id)
            sequences.append(current)
            current._append(list(prompt), None, None)
        current._append(list(call.output_token_ids), list(call.output_logprobs), call.versions())
    return [s for s in sequences if s.n_trainable() > 0 and len(s) > 1]


def chain_breaks(record: ExecutionRecord) -> int:
    """Calls whose prompt extends no earlier call's prompt + output and repeats no earlier
    prompt (another choice of a turn): each starts a sequence of its own in
    ``record_to_sequences`` (the proxy counts the same as it records)."""
    calls = [(c.prompt_token_ids, c.output_token_ids) for c in record.calls]
    return sum(
        1
        for i, (prompt, _) in enumerate(calls)
        if i and not continues_chain(prompt, calls[max(0, i - CHAIN_WINDOW_CALLS) : i])
    )


def single_call_record(
    execution_id: str,
    group_id: str,
    prompt_token_ids: list[int],
    output_token_ids: list[int],
    output_logprobs: list[float],
    weight_version: int,
    reward: float,
) -> ExecutionRecord:
    """The record of a one-call execution sampled entirely with one weight version."""
    n = len(output_token_ids)
    segments = (
        [
            Segment(
                engine_id="",
                request_id="",
                token_ids=list(output_token_ids),
                logprobs=list(output_logprobs),
                versions=[f"v{weight_version}"] * n,
            )
        ]
        if n
        else []
    )
    call = CallRecord(prompt_token_ids=list(prompt_token_ids), max_tokens=n, segments=segments)
    return ExecutionRecord(
        execution_id=execution_id, group_id=group_id, calls=[call], reward=reward
    )
