"""The emulated engine: the built-in engine's interface, tokens at the cost model's rates, no model.

In: ``GenerateRequest`` (prompt token ids + sampling params, optionally an imported KV handle)
and control calls (pause/resume, abort, sleep/wake, load weights, KV export/import), exactly as
``serving.engine.Engine`` takes them, so ``engine_server.build_engine_app`` serves it with every
route of the built-in engine. Out: a stream of ``TokenChunk`` per request whose token ids are
seeded (a request's seed, else the engine's seed and the request id) and whose timing is the
simulator's (``emulated_timing.EmulatedTiming``: prefill, then processor sharing of the cost
model's decode speed for the batch; sleep, wake and weight loads take the scenario's times), all
divided by the time scale ``k``. A test double at scale, named as such in every answer
(``/stats``: ``"emulated": true`` and ``k``): nothing here runs a model.

A request decodes ``max_tokens`` (less when the context is full): without ``ignore_eos`` its
last token is the end-of-sequence id and it finishes ``stop``, else ``length``. The KV cache of
a request is its tokens: export and import move them (JSON), and a finished request's tokens
stay as a prefix cache for its conversation's next call, so a KV handoff or a sticky call
prefills only what is new, as the simulator charges it. Streams report progress at most once
per ``stream_tick_s`` of real time (a large run's token chunks cost CPU; the last chunk comes
when the request finishes).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import random
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tidal.clock import Clock, WallClock
from tidal.serving.emulated_timing import EmulatedTiming
from tidal.serving.protocol import (
    BadRequest,
    GenerateRequest,
    Overloaded,
    TokenChunk,
    common_prefix_len,
)

log = logging.getLogger(__name__)
PAUSE_MODES = ("abort", "wait", "keep")
PREFIX_KEY = 16  # tokens that key the prefix cache (distinct conversations differ in them)
MIN_SHARED_TOKENS = 4
POOL = 1 << 16  # seeded generated ids: a request reads them from a seeded offset (cheap at scale)


class EmulatedTokenizer:
    """Bytes are ids 0..255 (prompts encode as UTF-8); generated ids are 257.. and decode to
    one lowercase letter each; 256 is the end-of-sequence id."""

    eos_id = 256
    first_generated = 257

    def __init__(self, vocab_size: int = 32000) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        out, raw = [], bytearray()
        for t in ids:
            if t < 256:
                raw.append(t)
                continue
            if raw:
                out.append(raw.decode("utf-8", errors="replace"))
                raw = bytearray()
            if t > 256:
                out.append(chr(97 + t % 26))
        if raw:
            out.append(raw.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(
        self, messages: list[dict], tools: list[dict] | None = None
    ) -> list[int]:
        parts = [f"<|tools|>\n{json.dumps(tools)}\n"] if tools else []
        for m in messages:
            content = m.get("content")
            text = content if isinstance(content, str) else json.dumps(content)
            parts.append(f"<|{m.get('role', 'user')}|>\n{text}\n")
        parts.append("<|assistant|>\n")
        return self.encode("".join(parts))


@dataclass
class EmulatedModel:
    """What the engine's routes read of a model: its context and vocabulary."""

    max_seq_len: int = 131072
    vocab_size: int = 32000


@dataclass
class _Request:
    id: str
    prompt: list[int]
    work: int  # tokens it decodes
    stop_at_eos: bool
    offset: int  # where its ids start in the engine's pool (seeded)
    cached_tokens: int
    tokens: list[int] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)


class EmulatedEngine:
    """Duck-types ``serving.engine.Engine`` for ``build_engine_app``."""

    def __init__(
        self,
        timing: EmulatedTiming,
        name: str = "emulated",
        seed: int = 0,
        clock: Clock | None = None,
        weight_version: str = "v0",
        max_waiting: int = 4096,
        stream_tick_s: float = 1.0,
        kv_lease_s: float = 30.0,
        wait_timeout_s: float = 60.0,
    ) -> None:
        self.timing, self.name, self.seed = timing, name, seed
        self.clock = clock or WallClock()
        self.weight_version = weight_version
        self.tokenizer = EmulatedTokenizer()
        self._pool = _pool(self.tokenizer.first_generated, self.tokenizer.vocab_size)
        self.model = EmulatedModel(vocab_size=self.tokenizer.vocab_size)
        self.capacity = timing.slot.slots
        self.max_waiting = max_waiting
        self.stream_tick_s, self.kv_lease_s = stream_tick_s, kv_lease_s
        self.wait_timeout_s = wait_timeout_s
        self.last_pause_s = 0.0
        self.last_load_parts: dict[str, float] = {}  # an emulated load has no parts to time
        self._requests: dict[str, _Request] = {}
        self._aborted_early: OrderedDict[str, bool] = OrderedDict()
        self._pinned: dict[str, tuple[list[int], float]] = {}  # key -> (tokens, expiry)
        self._prefix: OrderedDict[tuple[int, ...], list[int]] = OrderedDict()
        self._paused = self._sleeping = self._stopped = False
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._emitted = 0  # tokens produced (the rate meter's count)
        self._meter: deque[tuple[float, int]] = deque()
        self.totals = {"requests": 0, "finished": 0, "aborted": 0, "tokens": 0}

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=f"emulated-{self.name}")

    async def stop(self) -> None:
        self.abort(None)
        self._stopped = True
        self._wakeup.set()
        if self._task is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._task, 5.0)

    async def _loop(self) -> None:
        """Finish requests when the timing says so; sleep until its next event (or a change)."""
        while not self._stopped:
            dt = self._loop_once()
            self._wakeup.clear()
            # a change (a new request, an abort, a pause) wakes the loop at once
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), 1.0 if dt is None else min(dt, 1.0))

    def _loop_once(self) -> float | None:
        """Finish the requests done by now; real seconds to the next event (None: none)."""
        for rid in self.timing.pop_finished():
            r = self._requests.get(rid)
            if r is not None:
                self._finish(r, "stop" if r.stop_at_eos else "length")
        return self.timing.next_event_real_s()

    # -- requests --------------------------------------------------------------------------
    async def generate(
        self, req: GenerateRequest, min_interval_s: float = 0.0
    ) -> AsyncIterator[TokenChunk]:
        """Chunks of ``req``: the first once it has a token (or ends), then progress at most
        once per ``max(min_interval_s, stream_tick_s)``, the last with its finish reason.
        Closing the iterator early aborts the request."""
        r = self._admit(req)
        tick = max(min_interval_s, self.stream_tick_s)
        sent, first = 0, True
        try:
            while True:
                if r.finish_reason is None:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(r.done.wait(), tick)
                if r.finish_reason is None:
                    self._produce(r, self.timing.decoded(r.id))
                n = len(r.tokens)
                if r.finish_reason is None and n == sent and not first:
                    continue
                if r.finish_reason is None and n == 0:
                    continue  # the first chunk waits for the first token (prefill)
                chunk = TokenChunk(
                    r.tokens[sent:n],
                    [-1.0] * (n - sent),
                    r.versions[sent:n],
                    text=self.tokenizer.decode(r.tokens[sent:n]),
                )
                if first:
                    chunk.prompt_token_ids, chunk.cached_tokens = r.prompt, r.cached_tokens
                    first = False
                sent = n
                if r.finish_reason is not None:
                    chunk.finish_reason = r.finish_reason
                    if r.finish_reason == "abort":
                        chunk.kv_tokens = len(r.prompt) + n
                    yield chunk
                    return
                yield chunk
        finally:
            if r.finish_reason is None:
                self.abort([r.id])
            self._requests.pop(r.id, None)

    def _admit(self, req: GenerateRequest) -> _Request:
        if req.request_id in self._requests:
            raise BadRequest(f"request id {req.request_id!r} is already in flight")
        prompt = list(req.prompt_token_ids)
        if not prompt:
            raise BadRequest("prompt is empty")
        ctx = self.model.max_seq_len
        if len(prompt) >= ctx:
            raise BadRequest(f"prompt of {len(prompt)} tokens does not fit the context of {ctx}")
        bad = [t for t in prompt if not 0 <= t < self.model.vocab_size]
        if bad:
            raise BadRequest(f"token id {bad[0]} outside vocabulary of {self.model.vocab_size}")
        if len(self._requests) >= self.capacity + self.max_waiting:
            raise Overloaded(f"engine {self.name}: {len(self._requests)} requests in flight")
        if self._sleeping:
            raise Overloaded(f"engine {self.name} is asleep")
        p = req.params
        work = min(p.max_tokens, ctx - len(prompt))
        seed = p.seed if p.seed is not None else f"{self.seed}:{req.request_id}"
        cached = 0
        if req.kv_handle is not None:
            tokens, _ = self._pinned.pop(req.kv_handle, ([], 0.0))
            cached = common_prefix_len(tokens, prompt)
        else:
            cached = self._take_prefix(prompt)
        cached = min(cached, len(prompt) - 1)
        r = _Request(
            req.request_id,
            prompt,
            work,
            stop_at_eos=not p.ignore_eos and work == p.max_tokens,
            offset=random.Random(str(seed)).randrange(POOL),
            cached_tokens=cached,
        )
        self._requests[r.id] = r
        self.totals["requests"] += 1
        tombstone = self._aborted_early.pop(r.id, None)
        if tombstone is not None:  # aborted before it arrived: it ends at once
            self._finish(r, "abort")
            return r
        self.timing.add(r.id, work, len(prompt), cached)
        self._wakeup.set()
        return r

    def _produce(self, r: _Request, upto: int) -> None:
        """Seeded token ids for ``r`` up to ``upto`` tokens, labelled with the served version."""
        n = upto - len(r.tokens)
        if n <= 0:
            return
        last = r.stop_at_eos and upto == r.work
        k = n - 1 if last else n
        start = (r.offset + len(r.tokens)) % POOL
        while k > 0:  # the request's seeded place in the engine's seeded pool of ids
            take = min(k, POOL - start)
            r.tokens.extend(self._pool[start : start + take])
            k, start = k - take, 0
        if last:
            r.tokens.append(self.tokenizer.eos_id)
        r.versions.extend([self.weight_version] * n)
        self._count(n)

    def _count(self, n: int) -> None:
        now = self.clock.now()
        self.totals["tokens"] += n
        self._meter.append((now, n))
        while self._meter and self._meter[0][0] < now - 5.0:
            self._meter.popleft()

    def _finish(self, r: _Request, reason: str) -> None:
        if r.finish_reason is not None:
            return
        if r.id in self.timing:
            upto = self.timing.remove(r.id) if reason == "abort" else r.work
        else:
            upto = r.work if reason != "abort" else len(r.tokens)
        self._produce(r, upto)
        r.finish_reason = reason
        r.done.set()
        if reason != "abort":
            self.totals["finished"] += 1
            self._put_prefix(r.prompt + r.tokens)

    # -- prefix cache and KV ---------------------------------------------------------------
    def _put_prefix(self, tokens: list[int]) -> None:
        if len(tokens) < max(PREFIX_KEY, MIN_SHARED_TOKENS):
            return
        key = tuple(tokens[:PREFIX_KEY])
        self._prefix[key] = tokens
        self._prefix.move_to_end(key)
        while len(self._prefix) > self.capacity:
            self._prefix.popitem(last=False)

    def _take_prefix(self, prompt: list[int]) -> int:
        tokens = self._prefix.pop(tuple(prompt[:PREFIX_KEY]), None)
        if tokens is None:
            return 0
        n = common_prefix_len(tokens, prompt)
        return n if n >= MIN_SHARED_TOKENS else 0

    async def export_kv(self, request_id: str) -> bytes:
        self._expire()
        if request_id not in self._pinned:
            raise BadRequest(f"no KV cache pinned for request {request_id!r}")
        tokens, _ = self._pinned.pop(request_id)
        return json.dumps({"emulated": self.name, "tokens": tokens}).encode()

    async def import_kv(self, blob: bytes) -> tuple[str, int]:
        try:
            tokens = json.loads(blob)["tokens"]
            if not all(isinstance(t, int) for t in tokens):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            raise BadRequest("body: not an emulated engine's KV export") from None
        handle = f"kv-{self.name}-{self.totals['requests']}-{len(self._pinned)}"
        self._pinned[handle] = (tokens, self.clock.now() + self.kv_lease_s)
        return handle, len(tokens)

    def release_kv(self, key: str) -> bool:
        return self._pinned.pop(key, None) is not None

    def _expire(self) -> None:
        now = self.clock.now()
        for key in [k for k, (_, t) in self._pinned.items() if t < now]:
            del self._pinned[key]

    # -- control ---------------------------------------------------------------------------
    def abort(self, request_ids: list[str] | None, keep_kv: bool = False) -> int:
        """Finish the named requests (all when None) with ``abort``; with ``keep_kv`` their
        tokens stay pinned for export. A named id not seen yet is aborted on arrival."""
        if request_ids is not None:
            for rid in request_ids:
                if rid not in self._requests:
                    self._aborted_early[rid] = keep_kv
            while len(self._aborted_early) > 4096:
                self._aborted_early.popitem(last=False)
        targets = (
            list(self._requests.values())
            if request_ids is None
            else [self._requests[i] for i in request_ids if i in self._requests]
        )
        n = 0
        for r in targets:
            if r.finish_reason is None:
                self._finish(r, "abort")
                if keep_kv:
                    self._pinned[r.id] = (r.prompt + r.tokens, self.clock.now() + self.kv_lease_s)
                self.totals["aborted"] += 1
                n += 1
        if n:
            self._wakeup.set()
        return n

    async def pause(self, mode: str = "abort") -> None:
        if mode not in PAUSE_MODES:
            raise BadRequest(f"pause mode must be one of {PAUSE_MODES}, not {mode!r}")
        if mode == "abort":
            self.abort(None)
        elif mode == "wait":
            deadline = self.clock.now() + self.wait_timeout_s
            while self._running() and self.clock.now() < deadline:
                await self.clock.asleep(0.01)
        if not self._paused:
            self.timing.set_paused(True)
        self._paused = True

    def _running(self) -> int:
        return sum(1 for r in self._requests.values() if r.finish_reason is None)

    async def resume(self) -> None:
        if self._paused:
            self.timing.set_paused(False)
        self._paused = False
        self._wakeup.set()

    @property
    def is_paused(self) -> bool:
        return self._paused

    @property
    def is_sleeping(self) -> bool:
        return self._sleeping

    async def sleep(self, level: int = 1) -> None:
        """Abort everything, drop every cache; takes the scenario's sleep time over ``k``."""
        if level not in (1, 2):
            raise BadRequest("sleep level must be 1 or 2")
        self.abort(None)
        self._pinned.clear()
        self._prefix.clear()
        if not self._sleeping:
            await self.clock.asleep(self.timing.sleep_real_s)
        self._sleeping = True

    async def wake_up(self) -> None:
        if self._sleeping:
            await self.clock.asleep(self.timing.wake_real_s)
        self._sleeping = False
        self._wakeup.set()

    async def update_weights(self, path: object, version: str) -> None:
        """A version's load: the scenario's load time over ``k``; later tokens carry it (the
        file is not read: an emulated version has no weights)."""
        t0 = self.clock.now()
        await self.clock.asleep(self.timing.load_real_s)
        self._prefix.clear()
        self._sleeping = False
        self.weight_version = version
        self.last_pause_s = self.clock.now() - t0

    async def update_weights_from(self, named: object, version: str) -> None:
        await self.update_weights(None, version)

    async def weight_hashes(self) -> dict[str, str]:
        return {}

    def stats(self) -> dict:
        now = self.clock.now()
        recent = sum(n for t, n in self._meter if t >= now - 5.0)
        running = self._running()
        return {
            "name": self.name,
            "emulated": True,
            "k": self.timing.k,
            "running": min(running, self.capacity),
            "waiting": max(0, running - self.capacity),
            "capacity": self.capacity,
            "paused": self._paused,
            "sleeping": self._sleeping,
            "weight_version": self.weight_version,
            "tokens_per_s": round(recent / 5.0, 2),
            "emulated_tokens_per_s": round(self.timing.tokens_per_s(), 2),
            "kv_bytes": 0,
            "weights_bytes": 0,
            "pinned_kv": len(self._pinned),
            "device_peak_mb": None,
            **self.totals,
        }


@functools.cache
def _pool(lo: int, hi: int) -> list[int]:
    """One seeded pool of generated ids for every engine: a seed gives the same ids anywhere."""
    rng = random.Random(0)
    return [rng.randrange(lo, hi) for _ in range(POOL)]
