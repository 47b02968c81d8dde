"""Execution records as the proxy writes them, and their conversion to training sequences.

In: one ``ExecutionRecord`` per closed execution - the model calls the OpenAI-compatible proxy
answered (prompt token ids, output token ids, output log-probs, and the weight version of each
output segment, as vLLM's ``weight_versions`` spans give them) plus the reward at close.
Out: ``TrainSequence`` objects - one token stream per chain of calls whose prompts extend each
other, with a trainable mask that is true only for tokens the policy sampled (harness-injected
tokens between calls are context), and the behaviour log-prob and weight version of every
trainable token.

Invariant 6: every trainable token carries the weight version that produced it. A record whose
segments do not tile its output tokens is rejected here (``RecordError``) and never trained.
Timed-out and cancelled executions are kept: they are scored on what they produced.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tidal.errors import TidalError
from tidal.types import CHAIN_WINDOW_CALLS, continues_chain

NO_VERSION = -1


class RecordError(TidalError):
    """An execution record that cannot be trained on (inconsistent lengths or versions)."""


class OutputSegment(BaseModel):
    """Output tokens ``[start, end)`` of one call were sampled with ``weight_version``.

    Engines label versions ``"v<n>"`` (vLLM, SGLang, the built-in engine); both forms are read.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    start: int = Field(ge=0)
    end: int = Field(ge=0)
    weight_version: int = Field(ge=0)

    @field_validator("weight_version", mode="before")
    @classmethod
    def _parse_label(cls, v: object) -> object:
        if isinstance(v, str) and v.startswith("v") and v[1:].isdigit():
            return int(v[1:])
        return v


class ModelCall(BaseModel):
    """One model request answered by the proxy (retries inside it are already folded in)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    output_logprobs: list[float]
    segments: list[OutputSegment]

    @model_validator(mode="after")
    def _check(self) -> ModelCall:
        n = len(self.output_token_ids)
        if len(self.output_logprobs) != n:
            raise RecordError(f"{n} output tokens but {len(self.output_logprobs)} log-probs")
        pos = 0
        for seg in self.segments:
            if seg.start != pos or seg.end <= seg.start:
                raise RecordError(f"segments must tile the output: gap or overlap at {pos}")
            pos = seg.end
        if pos != n:
            raise RecordError(f"segments cover {pos} of {n} output tokens")
        return self

    def versions(self) -> list[int]:
        out: list[int] = []
        for seg in self.segments:
            out.extend([seg.weight_version] * (seg.end - seg.start))
        return out


class ExecutionRecord(BaseModel):
    """A closed execution: its model calls in order and the reward it was scored with."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    execution_id: str
    group_id: str
    calls: list[ModelCall]
    reward: float
    status: Literal["completed", "failed", "timed_out", "cancelled"] = "completed"

    def min_version(self) -> int:
        versions = [s.weight_version for c in self.calls for s in c.segments]
        return min(versions) if versions else NO_VERSION

    def trainable_tokens(self) -> int:
        return sum(len(c.output_token_ids) for c in self.calls)


_STATUS = {"completed": "completed", "failed": "failed", "timeout": "timed_out",
           "timed_out": "timed_out", "cancelled": "cancelled"}


def record_from_proxy(execution_id: str, group_id: str, calls: list[dict], reward: float,
                      reason: str = "completed") -> ExecutionRecord:
    """Builds a training record from the proxy's per-execution call records (the JSON of
    ``tidal.serving.records.ModelCall.to_json``: prompt ids and the segments each engine
    produced, with a log-prob and a weight version per token). ``reason`` is the execution's
    close reason (``tidal.types.CloseReason`` values)."""
    if reason not in _STATUS:
        raise RecordError(f"execution {execution_id!r}: unknown close reason {reason!r}")
    out = []
    for call in calls:
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[str] = []
        for seg in call.get("segments", []):
            n = len(seg["token_ids"])
            if len(seg["logprobs"]) != n or len(seg["versions"]) != n:
                raise RecordError(f"execution {execution_id!r}: a segment of {n} tokens has "
                                  f"{len(seg['logprobs'])} log-probs, {len(seg['versions'])} "
                                  "versions")
            tokens += seg["token_ids"]
            logprobs += seg["logprobs"]
            versions += seg["versions"]
        spans: list[OutputSegment] = []
        start = 0
        for i in range(1, len(versions) + 1):
            if i == len(versions) or versions[i] != versions[start]:
                spans.append(OutputSegment(start=start, end=i, weight_version=versions[start]))
                start = i
        out.append(ModelCall(prompt_token_ids=list(call["prompt_token_ids"]),
                             output_token_ids=tokens, output_logprobs=logprobs, segments=spans))
    return ExecutionRecord(execution_id=execution_id, group_id=group_id, calls=out,
                           reward=reward, status=_STATUS[reason])


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
    return sum(1 for i, (prompt, _) in enumerate(calls)
               if i and not continues_chain(prompt, calls[max(0, i - CHAIN_WINDOW_CALLS):i]))


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
    segments = [OutputSegment(start=0, end=n, weight_version=weight_version)] if n else []
    call = ModelCall(
        prompt_token_ids=list(prompt_token_ids),
        output_token_ids=list(output_token_ids),
        output_logprobs=list(output_logprobs),
        segments=segments,
    )
    return ExecutionRecord(
        execution_id=execution_id, group_id=group_id, calls=[call], reward=reward
    )
