"""Rollout engines: a prefill queue, then processor sharing of decode throughput, advanced
analytically.

In: sequences (one model request each) added with the tokens they still have to decode and
the context tokens they must prefill first (what the engine's KV cache lacks), removed when
rerouted or aborted; pauses (weight sync, sleep). Out: the time of the engine's next event
(a prefill done or a sequence finished) and the sequences finished by a given time.

Prefill is compute-bound work: a sequence's prefill takes ``prefill_s(tokens)`` of the whole
engine (the cost model's ``EngineModel.prefill_s`` over the replicas; without one,
``prefill_equiv`` decode-token equivalents per token at the engine's throughput), served first
come first served while every decode on the engine waits (a prefill step holds the GPUs).
Prefill is charged once per request start; it is never turned into decode work.

Every active sequence gets the same speed ``min(seq_cap, throughput / n_active)``, so one
cumulative per-sequence service counter ``v`` describes them all: a sequence added with work
``w`` at counter ``v0`` finishes when ``v`` reaches ``v0 + w``. Thresholds sit in a heap;
removal is lazy. Between events nothing is computed (no per-token events).
On a shared host (CPU runs: every engine on the same cores) the world caps an engine's
throughput at its share of the host's (``limit``).
An engine holds ``slots`` executions (sticky sessions, in tool waits too); only executions
with a request in flight share the throughput.
With a cost model (``perf.EngineModel``) the engine is ``replicas`` tensor-parallel replicas
with the load spread evenly, and the shared speed is the model's ``seq_rate`` of the active
sequences and their context (each counted at its turn's mean: start + half its work); it is
recomputed whenever the active set changes (``_rate``), so it is constant between events.
With admission control (``admit``: a ``tidal.control.admission`` target and ``FairQueue``) at
most ``target`` sequences decode at once; the others wait in the queue (bound to the engine,
holding their slot) and the queue's head starts whenever a sequence leaves.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tidal.control.admission import FairQueue
    from tidal.sim.perf import EngineModel

EPS_TOKENS = 1e-6


class Engine:
    __slots__ = (
        "_ctx",
        "_heap",
        "_pf",
        "_r",
        "_thr",
        "admitting",
        "busy_work",
        "cell",
        "ctx_sum",
        "epoch",
        "gpus",
        "limit",
        "members",
        "model",
        "name",
        "paused",
        "prefill_equiv",
        "prefill_s_total",
        "queue",
        "replicas",
        "seq_cap",
        "seq_s",
        "slots",
        "t",
        "target",
        "throughput",
        "timer",
        "timer_t",
        "v",
    )

    def __init__(
        self,
        name: str,
        gpus: int,
        slots: int,
        throughput_tok_s: float,
        seq_cap_tok_s: float,
        cell: int | None = None,
        model: EngineModel | None = None,
        prefill_equiv: float = 0.0,
    ) -> None:
        self.name = name
        self.gpus = gpus
        self.slots = slots
        self.throughput = throughput_tok_s
        self.limit = float("inf")  # the engine's share of a shared host (``World``), if any
        self.seq_cap = seq_cap_tok_s
        self.cell = cell
        self.admitting = cell is None
        self.paused = False
        self.members: set = set()  # executions bound here (they hold a slot)
        self.v = 0.0
        self.t = 0.0
        self.busy_work = 0.0  # decode-token equivalents processed (utilization)
        self.seq_s = 0.0  # sequence-seconds in the engine, not paused (the meter's exposure)
        self.epoch = 0
        self.timer = 0  # token of the world's pending completion timer for this engine
        self.timer_t: float | None = None
        self._heap: list[tuple[float, int]] = []
        self._thr: dict[int, float] = {}
        self.model = model
        self.replicas = max(1, gpus // model.tp) if model is not None else 1
        self._ctx: dict[int, float] = {}
        self.ctx_sum = 0.0
        self._r = 0.0  # the speed every active sequence gets now (tokens/s)
        self.target = slots  # sequences decoding at once at most (admission control)
        self.queue: FairQueue | None = None
        self.prefill_equiv = prefill_equiv
        # Prefills waiting or running, first come first served: [seq, seconds left, decode
        # work, context tokens at decode start].
        self._pf: deque[list] = deque()
        self.prefill_s_total = 0.0  # engine seconds spent prefilling

    def admit(self, target: int, queue: FairQueue) -> None:
        """Turns admission control on: ``target`` sequences at once, the rest in ``queue``."""
        self.target = max(1, target)
        self.queue = queue

    # ---------------------------------------------------------------- queries
    @property
    def active(self) -> int:
        return len(self._thr)

    @property
    def prefilling(self) -> int:
        """Sequences waiting for or in their prefill."""
        return len(self._pf)

    def prefills(self) -> list[tuple[int, float, float]]:
        """(sequence, engine seconds of prefill left, its context tokens) in queue order."""
        return [(p[0], p[1], p[3]) for p in self._pf]

    def in_prefill(self, seq: int) -> bool:
        return any(p[0] == seq for p in self._pf)

    def prefill_s(self, tokens: float, cached_tokens: float = 0.0) -> float:
        """Engine seconds to prefill ``tokens`` after ``cached_tokens`` already cached."""
        if tokens <= 0:
            return 0.0
        m = self.model
        if m is None:
            return tokens * self.prefill_equiv / self.throughput
        return m.prefill_s(tokens, cached_tokens) / self.replicas

    @property
    def free_slots(self) -> int:
        return self.slots - len(self.members)

    def rate(self) -> float:
        return self._r

    def _rate(self) -> None:
        n = len(self._thr)
        if n == 0 or self.paused or self._pf:
            self._r = 0.0
            return
        m = self.model
        if m is None:
            r = min(self.throughput, self.limit) / n
            self._r = r if r < self.seq_cap else self.seq_cap
        else:
            k = self.replicas
            # Spread evenly over the replicas; fewer sequences than replicas run alone.
            self._r = (
                m.seq_rate(n / k, self.ctx_sum / k) if n >= k else m.seq_rate(1, self.ctx_sum / n)
            )

    def set_limit(self, limit: float, now: float) -> None:
        self.advance(now)
        self.limit = limit
        self._rate()

    @property
    def waiting(self) -> int:
        return len(self.queue) if self.queue is not None else 0

    def has(self, seq: int) -> bool:
        return (
            seq in self._thr
            or (self.queue is not None and seq in self.queue)
            or self.in_prefill(seq)
        )

    def remaining(self, seq: int) -> float:
        """Decode tokens ``seq`` has left."""
        if seq not in self._thr and self.queue is not None and seq in self.queue:
            return self.queue.payload(seq)[0]
        for p in self._pf:
            if p[0] == seq:
                return p[2]
        return max(0.0, self._thr[seq] - self.v)

    def next_finish(self) -> float | None:
        """When the next prefill is done or the next sequence finishes (None: never)."""
        if self._pf:
            return None if self.paused else self.t + self._pf[0][1]
        r = self._r
        if r <= 0.0:
            return None
        heap, thr = self._heap, self._thr
        while heap and thr.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
        if not heap:
            return None
        return self.t + max(0.0, heap[0][0] - self.v) / r

    # --------------------------------------------------------------- updates
    def advance(self, now: float) -> None:
        dt = now - self.t
        pf = self._pf
        if dt <= 0.0:
            # A prefill with a rounding hair left is due now (``next_finish`` is ``now``):
            # finish it, or its timer would fire at ``now`` for ever.
            if not pf or self.paused or pf[0][1] > 1e-9 * (1.0 + now):
                return
            dt = 0.0
        self.t = now
        if not self.paused:
            # Prefills only move sequences into ``_thr``: the count holds over ``dt``.
            self.seq_s += dt * (len(self._thr) + len(pf))
        while pf and not self.paused:
            head = pf[0]
            # A prefill due within rounding of ``now`` is done (its timer fired now).
            if head[1] > dt + 1e-9 * (1.0 + now):
                head[1] -= dt
                self._prefill_busy(dt)
                return
            self._prefill_busy(head[1])
            dt = max(0.0, dt - head[1])
            pf.popleft()
            self._start(head[0], head[2], head[3])
            self._rate()
        r = self._r
        if r > 0.0 and dt > 0.0:
            self.v += r * dt
            self.busy_work += r * dt * len(self._thr)

    @property
    def decoded(self) -> float:
        """Decode tokens only (the decode meter's count): the work less the prefills'."""
        return self.busy_work - self.prefill_s_total * self.throughput

    def meter_at(self, now: float) -> tuple[float, float]:
        """(decoded tokens, sequence-seconds) as of ``now`` without advancing the engine."""
        dt = now - self.t
        if dt <= 0.0 or self.paused:
            return self.decoded, self.seq_s
        n = len(self._thr)
        tokens = 0.0 if self._pf else self._r * dt * n
        return self.decoded + tokens, self.seq_s + dt * (n + len(self._pf))

    def _prefill_busy(self, dt: float) -> None:
        self.prefill_s_total += dt
        self.busy_work += dt * self.throughput  # the whole engine computes

    def add(
        self,
        seq: int,
        work: float,
        now: float,
        ctx_tokens: float = 0.0,
        group: object = None,
        prefill_tokens: float = 0.0,
    ) -> None:
        """Starts a sequence: ``prefill_tokens`` of its ``ctx_tokens`` context to prefill
        (the rest is cached here), then ``work`` tokens to decode; or queues it (admission
        control: the engine runs ``target`` at once)."""
        if now > self.t:
            self.advance(now)
        w = work if work > 0.0 else 0.0
        pre = prefill_tokens if prefill_tokens > 0.0 else 0.0
        q = self.queue
        if q is not None and (self._running() >= self.target or len(q)):
            q.push(seq, seq if group is None else group, now, w, (w, ctx_tokens, pre))
            self._admit()
            return
        self._begin(seq, w, ctx_tokens, pre)
        self._rate()

    def _running(self) -> int:
        return len(self._thr) + len(self._pf)

    def _begin(self, seq: int, w: float, ctx_tokens: float, pre: float) -> None:
        secs = self.prefill_s(pre, ctx_tokens - pre)
        if secs > 0.0:
            self._pf.append([seq, secs, w, ctx_tokens])
            self.epoch += 1
        else:
            self._start(seq, w, ctx_tokens)

    def _start(self, seq: int, w: float, ctx_tokens: float) -> None:
        thr = self.v + w
        self._thr[seq] = thr
        heapq.heappush(self._heap, (thr, seq))
        if self.model is not None:
            c = ctx_tokens + 0.5 * w
            self._ctx[seq] = c
            self.ctx_sum += c
        self.epoch += 1

    def _admit(self) -> None:
        """Starts the queue's head while fewer than ``target`` sequences decode."""
        q = self.queue
        if q is None:
            return
        started = False
        while len(q) and self._running() < self.target:
            seq, (w, ctx, pre) = q.pop()
            self._begin(seq, w, ctx, pre)
            started = True
        if started:
            self._rate()

    def _drop_ctx(self, seq: int) -> None:
        c = self._ctx.pop(seq, None)
        if c is not None:
            self.ctx_sum = self.ctx_sum - c if self._ctx else 0.0

    def remove(self, seq: int, now: float) -> float:
        """Takes a sequence out (prefilling, decoding or queued); returns the decode tokens
        it had left (a prefill in progress is lost with the engine's cache)."""
        self.advance(now)
        if seq not in self._thr and self.queue is not None and seq in self.queue:
            return self.queue.discard(seq)[0]
        for i, p in enumerate(self._pf):
            if p[0] == seq:
                del self._pf[i]
                self.epoch += 1
                self._admit()
                self._rate()
                return p[2]
        thr = self._thr.pop(seq)
        self._drop_ctx(seq)
        self.epoch += 1
        self._admit()
        self._rate()
        return max(0.0, thr - self.v)

    def pop_finished(self, now: float) -> list[int]:
        self.advance(now)
        out = []
        heap, thr = self._heap, self._thr
        lim = self.v + EPS_TOKENS + 1e-9 * abs(self.v)
        while heap and heap[0][0] <= lim:
            t_, seq = heapq.heappop(heap)
            if thr.get(seq) == t_:
                del thr[seq]
                self._drop_ctx(seq)
                out.append(seq)
        if out:
            self.epoch += 1
            self._admit()
            self._rate()
        return out

    def set_paused(self, paused: bool, now: float) -> None:
        if paused != self.paused:
            self.advance(now)
            self.paused = paused
            self.epoch += 1
            self._rate()

    def sequences(self) -> list[int]:
        return list(self._thr)
