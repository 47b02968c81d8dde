"""The model call and the execution record: one model each, from the proxy to training.

In: the proxy builds a ``CallRecord`` per model request and appends a ``Segment`` per engine
attempt as tokens stream (a call that moves between engines has several). Out, on the wire
(the proxy's admin route ``/tidal/executions/<id>/records``): ``model_dump(mode="json")``,
which adds the derived ``output_token_ids`` and each segment's ``weight_versions`` spans for
readers that do not rebuild them. The driver validates that JSON back into ``CallRecord``s
(``model_validate`` drops the derived keys and checks the rest) and wraps them, with the reward
and the close reason, in an ``ExecutionRecord``: what the trajectory buffer holds, checkpoints
persist and ``tidal.training.records`` turns into token streams.

Invariant 6: every output token carries the weight version that produced it; a segment whose
token ids, log-probs and versions differ in length, or whose version label is not ``v<n>``, is
a ``RecordError`` when it is validated, never trained.
"""

from __future__ import annotations

from functools import cached_property

from pydantic import BaseModel, ConfigDict, Field, computed_field, model_validator

from tidal.contracts.close import CloseReason
from tidal.errors import RecordError

NO_VERSION = -1


def version_spans(versions: list[str]) -> list[list]:
    """``[[start, end, version], ...]`` covering ``versions`` (half-open, like vLLM's
    ``weight_versions``): how the OpenAI routes and the call records give versions out."""
    spans: list[list] = []
    for i, v in enumerate(versions):
        if spans and spans[-1][2] == v:
            spans[-1][1] = i + 1
        else:
            spans.append([i, i + 1, v])
    return spans


def version_number(label: str) -> int:
    """The number of a weight-version label: engines say ``"v<n>"`` (vLLM, SGLang, the built-in
    engine); a bare ``"<n>"`` is read too."""
    digits = label[1:] if label.startswith("v") else label
    if not digits.isdigit():
        raise RecordError(f"weight version {label!r} is not v<n>")
    return int(digits)


def _drop_derived(data: object, *keys: str) -> object:
    """Wire JSON carries values derived from the fields; validating it back ignores them."""
    if isinstance(data, dict) and any(k in data for k in keys):
        return {k: v for k, v in data.items() if k not in keys}
    return data


class Segment(BaseModel):
    """The tokens one engine attempt produced for a call, one log-prob and one weight version
    per token. Mutable: the proxy appends while the engine streams."""

    model_config = ConfigDict(extra="forbid")

    engine_id: str
    request_id: str
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    versions: list[str] = Field(default_factory=list)
    cached_tokens: int = 0
    reprefill_tokens: int = 0
    ended_by: str = ""
    # on an abort: the tokens the engine held KV for (what it could hand over; 0: none, e.g.
    # aborted while it waited in the engine's queue); None where the engine does not say
    kv_tokens: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _wire(cls, data: object) -> object:
        return _drop_derived(data, "weight_versions")

    @model_validator(mode="after")
    def _check(self) -> Segment:
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise RecordError(
                f"a segment of {n} tokens has {len(self.logprobs)} log-probs, "
                f"{len(self.versions)} versions"
            )
        # one string per distinct label: a record held for training keeps a version per token
        labels: dict[str, str] = {}
        self.versions = [labels.setdefault(v, v) for v in self.versions]
        for label in labels:
            version_number(label)
        return self

    @computed_field  # type: ignore[prop-decorator]
    @property
    def weight_versions(self) -> list[list]:
        return version_spans(self.versions)


class CallRecord(BaseModel):
    """One model request the proxy answered, retries and moves between engines folded in:
    the prompt ids and the segments that together are exactly the tokens the harness got."""

    model_config = ConfigDict(extra="forbid")

    call_id: str = ""
    prompt_token_ids: list[int]
    max_tokens: int = Field(default=0, ge=0)
    segments: list[Segment] = Field(default_factory=list)
    finish_reason: str | None = None
    # its prompt extended no earlier call of its execution (counted by the proxy's store)
    chain_break: bool = False
    # its prompt reused the ids the model sampled for its earlier turns where the harness's
    # re-rendered text tokenized differently (Proxy.bridge)
    bridged: bool = False

    @model_validator(mode="before")
    @classmethod
    def _wire(cls, data: object) -> object:
        return _drop_derived(data, "output_token_ids")

    @computed_field  # type: ignore[prop-decorator]
    @property
    def output_token_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]

    @property
    def output_logprobs(self) -> list[float]:
        return [lp for s in self.segments for lp in s.logprobs]

    def versions(self) -> list[int]:
        """The weight version of every output token, as numbers."""
        return [version_number(v) for s in self.segments for v in s.versions]


class ExecutionRecord(BaseModel):
    """A closed execution: its model calls in order, the reward it was scored with and why it
    closed. Timed-out and cancelled executions are kept: they are scored on what they made.
    A ``reward_error`` execution has no reward (None, never a stand-in 0.0); every other one a
    finite reward."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    execution_id: str
    group_id: str
    calls: list[CallRecord]
    reward: float | None = Field(allow_inf_nan=False)
    reason: CloseReason = CloseReason.COMPLETED

    @model_validator(mode="after")
    def _reward_iff_scored(self) -> ExecutionRecord:
        if (self.reward is None) != (self.reason is CloseReason.REWARD_ERROR):
            raise ValueError(
                "reward is None exactly when the reason is reward_error "
                f"(reason {self.reason.value}, reward {self.reward})"
            )
        return self

    def min_version(self) -> int:
        """The oldest weight version any of its tokens came from (``NO_VERSION``: none)."""
        return self._min_version

    @cached_property
    def _min_version(self) -> int:
        # once per record: the trajectory buffer asks on every take, for every ready group
        labels = {v for c in self.calls for s in c.segments for v in s.versions}
        return min(map(version_number, labels)) if labels else NO_VERSION

    def trainable_tokens(self) -> int:
        return sum(len(s.token_ids) for c in self.calls for s in c.segments)
