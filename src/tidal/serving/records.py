"""Token-in / token-out records of every model call, per execution: the training data.

In: ``contracts.CallRecord``s the proxy builds, with segments added as a call moves between
engines. Out: per execution, a list of calls, each with the prompt token ids and segments of
(engine, token ids, log-probs, weight version per token, cached / re-prefilled tokens).
Invariant: the concatenated segments of a call are exactly the tokens the harness received.

Drift (invariant 8): a call whose prompt neither extends an earlier call's prompt + output nor
repeats an earlier prompt (another choice of the same turn) breaks its execution's chain; it is
marked (``chain_break``) and counted, and trains as a sequence of its own.
"""

from __future__ import annotations

from tidal.contracts.calls import CallRecord
from tidal.types import CHAIN_WINDOW_CALLS, continues_chain


class RecordStore:
    """Bounded: the oldest executions are dropped first once ``max_executions`` is reached."""

    def __init__(self, max_executions: int = 100_000) -> None:
        self.max_executions = max_executions
        self._calls: dict[str, list[CallRecord]] = {}
        self.totals = {"recorded_calls": 0, "chain_breaks": 0, "bridged_calls": 0}

    def add(self, execution_id: str, call: CallRecord) -> None:
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
        return {
            **self.totals,
            "chain_breaks_per_100_calls": round(100.0 * self.totals["chain_breaks"] / n, 2)
            if n
            else 0.0,
        }

    def calls(self, execution_id: str) -> list[CallRecord]:
        return list(self._calls.get(execution_id, []))

    def pop(self, execution_id: str) -> list[CallRecord]:
        return self._calls.pop(execution_id, [])

    def __len__(self) -> int:
        return len(self._calls)


def extends(prompt: list[int], earlier: list[CallRecord]) -> bool:
    """Whether ``prompt`` continues the chain of ``earlier`` calls (``types.continues_chain``)."""
    return continues_chain(
        prompt, [(c.prompt_token_ids, c.output_token_ids) for c in earlier[-CHAIN_WINDOW_CALLS:]]
    )
