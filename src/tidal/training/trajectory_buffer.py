"""Trajectory buffer: closed execution records in, ready GRPO groups out.

In: ``ExecutionRecord`` objects (any thread; the proxy's record stream). Records are grouped by
``group_id``; a group is ready once ``group_size`` records are in. Out: ``ReadyGroup`` objects
with group-normalised advantages and per-token staleness, handed to the trainer by ``take``.

A ``reward_error`` record (reward None) is kept with its group but not trained: the group's
advantages are over its scored members only, and a group with fewer than ``min(2, group_size)``
scored members is dropped and counted (``groups_dropped_reward``), the ledger's rule
(``tidal.control.ledger``). Advantages are computed scale-free (``group_advantages``): any finite
reward, 1e308 included, gives finite advantages.

Invariant 6: the staleness bound is enforced when data is consumed. ``take(..., version=v)``
never returns a group holding a token older than ``v - max_policy_lag``; such groups are
discarded and counted (their ids are kept so a dispatcher can run them again). ``on_stale``
decides what the consumer does about the shortfall: ``drop`` streams whatever fresh groups there
are, ``wait`` hands out nothing until the full request can be met with fresh groups (the batch
stays complete at the cost of streaming; the core's step timeout bounds the wait).
The buffer is bounded (``capacity_groups``); a full buffer makes ``add`` wait, then fail.
Ordered (``ordered``, a deterministic run): a group's records are kept in execution-id order
(its advantages and sequences do not depend on which execution closed first), and ``take``
hands out groups only in the order given to ``expect`` (the dispatch order), all requested
groups at once: every step trains the same groups, packed the same way, whatever the arrival
order. ``takeable`` says how many of the next expected groups are ready.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tidal.clock import Clock
from tidal.contracts.calls import ExecutionRecord
from tidal.errors import TidalError, TimeoutExpired
from tidal.training.records import TrainSequence, record_to_sequences

log = logging.getLogger(__name__)

_POLL_S = 0.05


class TrajectoryBufferConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    group_size: int = Field(default=4, ge=1)
    max_policy_lag: int = Field(default=1, ge=0)
    on_stale: Literal["drop", "wait"] = "drop"
    capacity_groups: int = Field(default=1024, ge=1)
    advantage_eps: float = Field(default=1e-6, gt=0)
    # Groups whose rewards are all equal carry no GRPO signal; dropping them saves compute.
    drop_uniform_groups: bool = False
    # runtime.deterministic: records sorted per group, groups taken in ``expect`` order only
    ordered: bool = False


class BufferClosed(TidalError):
    """The trajectory stream was closed; nothing more will arrive."""


def member_key(execution_id: str) -> tuple:
    """Natural order of execution ids (``b0-g1-e2`` before ``b0-g1-e10``)."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", execution_id))


def group_advantages(rewards: list[float], eps: float = 1e-6) -> list[float]:
    """GRPO advantage: reward minus the group mean, over the group's (population) std plus
    ``eps``. Computed on the rewards divided by their largest magnitude ``s`` (the same value:
    ``(r - m) / (sd + eps) = (x - m/s) / (sd/s + eps/s)``), so no sum or square overflows for
    any finite reward; a group of equal rewards gets zeros."""
    n = len(rewards)
    if not rewards or max(rewards) == min(rewards):
        return [0.0] * n
    scale = max(abs(r) for r in rewards)
    xs = [r / scale for r in rewards]
    mean = mean_of(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / n)
    return [(x - mean) / (std + eps / scale) for x in xs]


def mean_of(values: list[float]) -> float:
    """The mean of finite values without overflow (each divided by the count first)."""
    n = len(values)
    return sum(v / n for v in values) if n else 0.0


@dataclass
class ReadyGroup:
    """A complete GRPO group: records, their advantages and token sequences."""

    group_id: str
    records: list[ExecutionRecord]  # the scored members (what trains)
    advantages: list[float]
    sequences: list[list[TrainSequence]]  # per record
    staleness: list[list[list[int]]] = field(default_factory=list)  # per record, seq, token
    consumed_version: int | None = None
    unscored: list[ExecutionRecord] = field(default_factory=list)  # reward_error members

    def min_version(self) -> int:
        return min(r.min_version() for r in self.records)

    def mean_reward(self) -> float:
        return mean_of([r.reward for r in self.records if r.reward is not None])


@dataclass
class BufferStats:
    records_in: int = 0
    groups_ready: int = 0
    groups_taken: int = 0
    groups_dropped_stale: int = 0
    groups_dropped_uniform: int = 0
    groups_dropped_reward: int = 0  # fewer than min(2, group_size) scored members
    records_unscored: int = 0  # reward_error records (kept out of training)
    tokens_dropped_stale: int = 0
    max_staleness_taken: int = 0
    dropped_group_ids: list[str] = field(default_factory=list)


class TrajectoryBuffer:
    """Thread-safe; one owner (the core trainer) calls ``take``, any thread calls ``add``."""

    def __init__(self, config: TrajectoryBufferConfig, clock: Clock) -> None:
        self.config = config
        self._clock = clock
        self._cv = threading.Condition()
        self._partial: dict[str, list[ExecutionRecord]] = {}
        self._ready: list[ReadyGroup] = []
        self._closed = False
        self._expected: deque[str] = deque()  # ordered: group ids in training order
        self.stats = BufferStats()

    def __len__(self) -> int:
        with self._cv:
            return len(self._ready)

    def expect(self, group_ids: list[str]) -> None:
        """Ordered mode: these groups are trained next, in this order (after any expected
        before)."""
        with self._cv:
            self._expected.extend(group_ids)
            self._cv.notify_all()

    def takeable(self) -> int:
        """Groups a ``take`` could hand out now: ready ones; ordered, only the ready prefix of
        the expected order."""
        with self._cv:
            return (
                len(self._in_order(len(self._ready))) if self.config.ordered else len(self._ready)
            )

    def _in_order(self, limit: int) -> list[ReadyGroup]:
        """Ordered: the ready groups that are next in the expected order, at most ``limit``."""
        by_id = {g.group_id: g for g in self._ready}
        out = []
        for gid in self._expected:
            if gid not in by_id or len(out) >= limit:
                break
            out.append(by_id[gid])
        return out

    def _held_groups(self) -> int:
        return len(self._ready) + len(self._partial)

    def add(self, record: ExecutionRecord, timeout_s: float = 30.0) -> None:
        deadline = self._clock.now() + timeout_s
        with self._cv:
            if self._closed:
                raise BufferClosed(f"trajectory buffer closed; record {record.execution_id} lost")
            while record.group_id not in self._partial and self._held_groups() >= (
                self.config.capacity_groups
            ):
                if self._clock.now() >= deadline:
                    raise TimeoutExpired(
                        f"trajectory buffer full ({self.config.capacity_groups} groups) for "
                        f"{timeout_s}s; the trainer is not consuming"
                    )
                self._cv.wait(_POLL_S)
            members = self._partial.setdefault(record.group_id, [])
            if any(m.execution_id == record.execution_id for m in members):
                log.warning("duplicate record %s ignored", record.execution_id)
                return
            members.append(record)
            self.stats.records_in += 1
            if len(members) == self.config.group_size:
                del self._partial[record.group_id]
                self._make_ready(record.group_id, members)
            self._cv.notify_all()

    def _make_ready(self, group_id: str, records: list[ExecutionRecord]) -> None:
        if self.config.ordered:
            records = sorted(records, key=lambda r: member_key(r.execution_id))
        scored = [r for r in records if r.reward is not None]
        unscored = [r for r in records if r.reward is None]
        self.stats.records_unscored += len(unscored)
        if len(scored) < min(2, self.config.group_size):
            self.stats.groups_dropped_reward += 1
            self._forget(group_id)
            log.warning(
                "dropped group %s: %d of %d members scored (reward_error), fewer than 2",
                group_id,
                len(scored),
                len(records),
            )
            return
        rewards = [r.reward for r in scored]
        if self.config.drop_uniform_groups and max(rewards) == min(rewards):
            self.stats.groups_dropped_uniform += 1
            self._forget(group_id)
            return
        advantages = group_advantages(rewards, self.config.advantage_eps)
        sequences = [record_to_sequences(r) for r in scored]
        self._ready.append(ReadyGroup(group_id, scored, advantages, sequences, unscored=unscored))
        self.stats.groups_ready += 1

    def _forget(self, group_id: str) -> None:
        """A dropped group never becomes ready: the ordered take goes on without it."""
        if group_id in self._expected:
            self._expected.remove(group_id)

    def held_records(self) -> list[ExecutionRecord]:
        """Every record in the buffer not yet taken (ready and incomplete groups), for a
        checkpoint; ``add`` them back to restore."""
        with self._cv:
            out = [r for g in self._ready for r in (*g.records, *g.unscored)]
            out += [r for members in self._partial.values() for r in members]
            return out

    def close(self) -> None:
        """End of stream: partial groups can never complete and are discarded."""
        with self._cv:
            self._closed = True
            if self._partial:
                log.info("closing with %d incomplete groups", len(self._partial))
            self._partial.clear()
            self._cv.notify_all()

    @property
    def closed(self) -> bool:
        with self._cv:
            return self._closed

    def exhausted(self) -> bool:
        """Closed and nothing ready: no ``take`` can return data again."""
        with self._cv:
            return self._closed and not self._ready

    def _evict_stale(self, version: int) -> None:
        oldest_ok = version - self.config.max_policy_lag
        fresh = []
        for g in self._ready:
            if g.min_version() >= oldest_ok:
                fresh.append(g)
                continue
            self.stats.groups_dropped_stale += 1
            self.stats.tokens_dropped_stale += sum(r.trainable_tokens() for r in g.records)
            self.stats.dropped_group_ids.append(g.group_id)
            if g.group_id in self._expected:  # never comes back: the order goes on without
                self._expected.remove(g.group_id)
            log.info(
                "dropped stale group %s (min version %d < %d)",
                g.group_id,
                g.min_version(),
                oldest_ok,
            )
        self._ready = fresh

    def take(self, max_groups: int, version: int, timeout_s: float = 0.0) -> list[ReadyGroup]:
        """Up to ``max_groups`` fresh groups for training at ``version``, oldest first.

        Waits up to ``timeout_s``: under ``drop`` for at least one fresh group, under ``wait``
        for all ``max_groups`` (fewer only once the stream is closed; none on timeout).
        """
        ordered = self.config.ordered
        need = max_groups if self.config.on_stale == "wait" or ordered else 1
        deadline = self._clock.now() + timeout_s
        with self._cv:
            while True:
                self._evict_stale(version)
                have = len(self._in_order(max_groups)) if ordered else len(self._ready)
                if have >= need or self._closed:
                    break
                if self._clock.now() >= deadline:
                    if self.config.on_stale == "wait" or ordered:
                        return []
                    break
                self._cv.wait(_POLL_S)
            if ordered:
                out = self._in_order(max_groups)
                taken = {id(g) for g in out}
                self._ready = [g for g in self._ready if id(g) not in taken]
                for _ in out:
                    self._expected.popleft()
            else:
                out, self._ready = self._ready[:max_groups], self._ready[max_groups:]
            for g in out:
                g.consumed_version = version
                g.staleness = [
                    [
                        [
                            version - v if t else 0
                            for v, t in zip(s.versions, s.trainable, strict=True)
                        ]
                        for s in seqs
                    ]
                    for seqs in g.sequences
                ]
                lag = version - g.min_version()
                self.stats.max_staleness_taken = max(self.stats.max_staleness_taken, lag)
            self.stats.groups_taken += len(out)
            self._cv.notify_all()
            return out
