"""Packing buffer: ready groups of one batch in, micro-steps out, claimed atomically by workers.

In: ``ReadyGroup`` objects for the open batch (``add_groups``), then ``seal`` when the batch has
all its groups or the stream closed. Out: ``MicroStep`` objects packed to a token budget,
emitted as soon as enough tokens are ready; workers ``claim`` them, ``complete`` them, and the
core ``finish``es the batch once every micro-step is done.

Invariant 5 (each micro-step of a batch is processed exactly once): a claim is a lease that
expires ``claim_timeout_s`` after it was granted (measured on the injected clock); an expired
lease goes back to the pending queue and a completion from its former holder is refused, so the
holder must discard that gradient. ``reopen`` returns everything a worker completed to the queue
when that worker's gradient never reached the core (it died before delivering). ``finish``
refuses a batch that has a micro-step not done exactly once.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tidal.clock import Clock
from tidal.errors import InvariantViolation, TidalError
from tidal.training.trajectory_buffer import ReadyGroup

log = logging.getLogger(__name__)


class PackingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    token_budget: int = Field(default=2048, ge=2)
    claim_timeout_s: float = Field(default=60.0, gt=0)


class PackingError(TidalError):
    """A packing-buffer call out of order (claim before open, add after seal, ...)."""


@dataclass
class PackedSequence:
    """One training sequence with everything the loss needs for it."""

    execution_id: str
    token_ids: list[int]
    trainable: list[bool]
    behaviour_logprobs: list[float]
    staleness: list[int]
    advantage: float
    # 1 / (trainable tokens of the whole execution): the per-execution mean, known globally.
    execution_weight: float

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass
class MicroStep:
    batch_id: int
    index: int
    version: int
    sequences: list[PackedSequence]

    @property
    def key(self) -> tuple[int, int]:
        return (self.batch_id, self.index)

    def n_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)

    def n_trainable(self) -> int:
        return sum(sum(s.trainable) for s in self.sequences)

    def execution_ids(self) -> set[str]:
        return {s.execution_id for s in self.sequences}


@dataclass
class _Lease:
    worker: str
    deadline_s: float


@dataclass
class Claim:
    kind: Literal["micro_step", "wait", "drained"]
    micro_step: MicroStep | None = None


@dataclass
class BatchSummary:
    batch_id: int
    version: int
    n_micro_steps: int
    n_executions: int
    n_trainable_tokens: int
    done_by: dict[int, str]
    reclaimed: int
    reopened: int
    max_staleness: int
    groups: list[ReadyGroup] = field(default_factory=list)


class PackingBuffer:
    """One batch at a time; every method is atomic under one lock."""

    def __init__(self, config: PackingConfig, clock: Clock) -> None:
        self.config = config
        self._clock = clock
        self._lock = threading.Lock()
        self._batch_id: int | None = None

    def open_batch(self, batch_id: int, version: int) -> None:
        with self._lock:
            if self._batch_id is not None:
                raise PackingError(f"batch {self._batch_id} still open")
            self._batch_id, self._version = batch_id, version
            self._pool: list[PackedSequence] = []
            self._pool_tokens = 0
            self._steps: list[MicroStep] = []
            self._pending: deque[int] = deque()
            self._leases: dict[int, _Lease] = {}
            self._done: dict[int, str] = {}
            self._groups: list[ReadyGroup] = []
            self._executions: set[str] = set()
            self._sealed = False
            self._reclaimed = self._reopened = 0

    def _require_open(self) -> None:
        if self._batch_id is None:
            raise PackingError("no batch open")

    def add_groups(self, groups: list[ReadyGroup]) -> None:
        with self._lock:
            self._require_open()
            if self._sealed:
                raise PackingError(f"batch {self._batch_id} is sealed")
            for g in groups:
                self._groups.append(g)
                for rec, adv, seqs, stale in zip(
                    g.records, g.advantages, g.sequences, g.staleness, strict=True
                ):
                    n_exec = sum(s.n_trainable() for s in seqs)
                    if n_exec == 0:
                        continue
                    self._executions.add(rec.execution_id)
                    for s, st in zip(seqs, stale, strict=True):
                        self._pool.append(
                            PackedSequence(
                                rec.execution_id,
                                s.token_ids,
                                s.trainable,
                                s.behaviour_logprobs,
                                st,
                                adv,
                                1.0 / n_exec,
                            )
                        )
                        self._pool_tokens += len(s)
            while self._pool_tokens >= self.config.token_budget:
                self._emit()

    def _emit(self) -> None:
        """First-fit in arrival order; a sequence longer than the budget travels alone."""
        budget, taken, rest, used = self.config.token_budget, [], [], 0
        for s in self._pool:
            if not taken or used + len(s) <= budget:
                taken.append(s)
                used += len(s)
            else:
                rest.append(s)
        self._pool, self._pool_tokens = rest, self._pool_tokens - used
        index = len(self._steps)
        self._steps.append(MicroStep(self._batch_id, index, self._version, taken))
        self._pending.append(index)

    def seal(self) -> None:
        """No more groups for this batch: flush what is left into micro-steps."""
        with self._lock:
            self._require_open()
            while self._pool:
                self._emit()
            self._sealed = True

    def _reap(self) -> None:
        now = self._clock.now()
        for index, lease in list(self._leases.items()):
            if now >= lease.deadline_s:
                del self._leases[index]
                self._pending.appendleft(index)
                self._reclaimed += 1
                log.info("claim on micro-step %d by %s expired; reclaimed", index, lease.worker)

    def claim(self, worker: str) -> Claim:
        with self._lock:
            if self._batch_id is None:
                return Claim("wait")
            self._reap()
            if self._pending:
                index = self._pending.popleft()
                deadline = self._clock.now() + self.config.claim_timeout_s
                self._leases[index] = _Lease(worker, deadline)
                return Claim("micro_step", self._steps[index])
            return Claim("drained" if self._sealed else "wait")

    def complete(self, worker: str, batch_id: int, index: int) -> bool:
        """True if ``worker`` still held the claim; False means: discard that gradient."""
        with self._lock:
            if batch_id != self._batch_id:
                return False
            lease = self._leases.get(index)
            if lease is None or lease.worker != worker:
                return False
            del self._leases[index]
            self._done[index] = worker
            return True

    def renew(self, worker: str) -> None:
        """Extend every lease ``worker`` holds (a heartbeat for long micro-steps)."""
        with self._lock:
            deadline = self._clock.now() + self.config.claim_timeout_s
            for lease in self._leases.values():
                if lease.worker == worker:
                    lease.deadline_s = deadline

    def reopen(self, worker: str) -> int:
        """Return ``worker``'s claimed and completed micro-steps to the queue."""
        with self._lock:
            if self._batch_id is None:
                return 0
            back = [i for i, w in self._done.items() if w == worker]
            back += [i for i, lease in self._leases.items() if lease.worker == worker]
            for i in back:
                self._done.pop(i, None)
                self._leases.pop(i, None)
            self._pending.extendleft(sorted(back, reverse=True))
            self._reopened += len(back)
            if back:
                log.info("reopened %d micro-steps of lost worker %s", len(back), worker)
            return len(back)

    def all_done(self) -> bool:
        with self._lock:
            self._reap()
            return self._sealed and len(self._done) == len(self._steps)

    def progress(self) -> dict[str, int]:
        with self._lock:
            if self._batch_id is None:
                return {}
            return {
                "emitted": len(self._steps),
                "pending": len(self._pending),
                "claimed": len(self._leases),
                "done": len(self._done),
                "groups": len(self._groups),
                "sealed": int(self._sealed),
            }

    def holdings(self) -> dict[str, Any]:
        """``claimed`` and ``done`` micro-steps of the open batch (index -> worker), and the
        batch id (-1 when none is open)."""
        with self._lock:
            if self._batch_id is None:
                return {"claimed": {}, "done": {}, "batch_id": -1}
            return {
                "claimed": {i: lease.worker for i, lease in self._leases.items()},
                "done": dict(self._done),
                "batch_id": self._batch_id,
            }

    def n_groups(self) -> int:
        with self._lock:
            return len(self._groups) if self._batch_id is not None else 0

    def finish(self) -> BatchSummary:
        """Close the batch; refuses unless every micro-step was done exactly once."""
        with self._lock:
            self._require_open()
            if not self._sealed or len(self._done) != len(self._steps) or self._leases:
                raise InvariantViolation(
                    f"batch {self._batch_id}: {len(self._done)}/{len(self._steps)} micro-steps "
                    f"done, {len(self._leases)} claimed, sealed={self._sealed}"
                )
            tokens = sum(m.n_trainable() for m in self._steps)
            stale = max(
                (max(s.staleness, default=0) for m in self._steps for s in m.sequences), default=0
            )
            summary = BatchSummary(
                self._batch_id,
                self._version,
                len(self._steps),
                len(self._executions),
                tokens,
                dict(self._done),
                self._reclaimed,
                self._reopened,
                stale,
                self._groups,
            )
            self._batch_id = None
            return summary
