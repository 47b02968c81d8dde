"""Token-in / token-out records of every model call, per execution: the training data.

In: segments reported by the proxy as a call moves between engines. Out: per execution, a list
of calls, each with the prompt token ids and segments of (engine, token ids, log-probs, weight
version per token, cached / re-prefilled tokens). Invariant: the concatenated segments of a call
are exactly the tokens the harness received.

Drift (invariant 8): a call whose prompt neither extends an earlier call's prompt + output nor
repeats an earlier prompt (another choice of the same turn) breaks its execution's chain; it is
marked (``chain_break``) and counted, and trains as a sequence of its own.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from tidal.serving.protocol import version_spans
from tidal.types import CHAIN_WINDOW_CALLS, continues_chain


@dataclass
class Segment:
    engine_id: str
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    cached_tokens: int = 0
    reprefill_tokens: int = 0
    ended_by: str = ""
    # on an abort: the tokens the engine held KV for (what it could hand over; 0: none, e.g.
    # aborted while it waited in the engine's queue); None where the engine does not say
    kv_tokens: int | None = None

    def to_json(self) -> dict:
        out = asdict(self)
        out["weight_versions"] = version_spans(self.versions)
        return out


@dataclass
class ModelCall:
    call_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    segments: list[Segment] = field(default_factory=list)
    finish_reason: str | None = None
    chain_break: bool = False
    # its prompt reused the ids the model sampled for its earlier turns where the harness's
    # re-rendered text tokenized differently (Proxy.bridge)
    bridged: bool = False

    @property
    def output_token_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]

    def to_json(self) -> dict:
        return {"call_id": self.call_id, "prompt_token_ids": self.prompt_token_ids,
                "max_tokens": self.max_tokens, "finish_reason": self.finish_reason,
                "chain_break": self.chain_break, "bridged": self.bridged,
                "output_token_ids": self.output_token_ids,
                "segments": [s.to_json() for s in self.segments]}


class RecordStore:
    """Bounded: the oldest executions are dropped first once ``max_executions`` is reached."""

    def __init__(self, max_executions: int = 100_000) -> None:
        self.max_executions = max_executions
        self._calls: dict[str, list[ModelCall]] = {}
        self.totals = {"recorded_calls": 0, "chain_breaks": 0, "bridged_calls": 0}

    def add(self, execution_id: str, call: ModelCall) -> None:
        if execution_id not in self._calls and len(self._calls) >= self.max_executions:
            self._calls.pop(next(iter(self._calls)))
        earlier = self._calls.setdefault(execution_id, [])
        call.chain_break = bool(earlier) and not extends(call.prompt_token_ids, earlier)
        self.totals["recorded_calls"] += 1
        self.totals["chain_breaks"] += call.chain_break
        self.totals["bridged_calls"] += call.bridged
        earlier.append(call)

    def stats(self) -> dict:
        n = self.totals["recorded_calls"]
        return {**self.totals, "chain_breaks_per_100_calls":
                round(100.0 * self.totals["chain_breaks"] / n, 2) if n else 0.0}

    def calls(self, execution_id: str) -> list[ModelCall]:
        return list(self._calls.get(execution_id, []))

    def pop(self, execution_id: str) -> list[ModelCall]:
        return self._calls.pop(execution_id, [])

    def __len__(self) -> int:
        return len(self._calls)


def extends(prompt: list[int], earlier: list[ModelCall]) -> bool:
    """Whether ``prompt`` continues the chain of ``earlier`` calls (``types.continues_chain``)."""
    return continues_chain(prompt, [(c.prompt_token_ids, c.output_token_ids)
                                    for c in earlier[-CHAIN_WINDOW_CALLS:]])
