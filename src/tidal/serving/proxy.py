"""The proxy's core: runs each model call to completion across engine changes, and drains.

In: model calls (execution id, prompt ids, sampling params) from the HTTP front; engine joins,
leaves, drains. Out: one finished result per call, and a token record per execution.

Invariant 4 (DESIGN.md): every admitted call is answered exactly once. A call whose engine is
drained (its request aborted) or dies is retried at another engine with prompt + tokens so far
and the remaining budget, reusing the source's KV cache when both engines can hand it off.
Every wait is bounded; exhausting a bound raises a ``ServingError``, logged with the call's id.
A call that finds no engine with room waits in the ``AdmissionQueue`` (first come, first served)
until its own deadline; an engine that answers with a 5xx (or whose step failed) is retried a
few times with back-off (``max_error_retries``), an engine that is gone is dropped at once
(``health.HealthMonitor`` also finds the ones nobody calls, and re-admits those that return).

KV handoff: a drained attempt exports its pinned KV before it leaves the source's in-flight set
(so a drain returns only once the source holds nothing of ours, and the engine may sleep at
once); the call then holds the blob until an engine has adopted it. An attempt is in the
destination's in-flight set while the blob is imported; if that destination's drain begins
before the request is sent, the attempt releases the import and moves on with the same blob
(re-routed, never sent to a draining engine); once sent, the destination pins the adopted cache
on abort and the next hop exports it from there (a chained handoff).

Over 500 lines on purpose: one class whose methods share each call's state across attempts,
retries, drains and handoffs (invariant 4 is kept across all of them, so they read best
together); the admission queue, health monitor, KV handoff, OpenAI shapes and HTTP front are
modules of their own (``admission``, ``health``, ``kv_handoff``, ``openai_api``, ``proxy_app``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from tidal.clock import Clock, WallClock
from tidal.contracts.calls import CallRecord, Segment
from tidal.control.admission import AdmissionRule, concurrency_target, curve_from_points
from tidal.control.queued_waits import QueuedWaits
from tidal.errors import ConfigError, TimeoutExpired
from tidal.seeding import call_seed, continued_seed
from tidal.serving.adapters import make_adapter
from tidal.serving.admission import AdmissionQueue
from tidal.serving.drift import bridge
from tidal.serving.health import HealthMonitor, Lost
from tidal.serving.kv_handoff import Attempt, export_kv, import_kv, release_import
from tidal.serving.openai_api import Result
from tidal.serving.protocol import (
    BadRequest,
    EngineError,
    EngineUnavailable,
    GenerateRequest,
    NotFound,
    Overloaded,
    SamplingParams,
    ServingError,
    TokenChunk,
    cut_at_stop,
)
from tidal.serving.records import RecordStore
from tidal.serving.router import Kind, Member, Router

log = logging.getLogger(__name__)


@dataclass
class _CallState:
    """What one call carries from one engine's attempt to the next."""

    res: Result
    waited_s: float = 0.0  # upstream streaming + admission waits: not the proxy's own cost
    errors: int = 0  # 5xx answers and failed steps of live engines: retried a bounded number
    blob: bytes | None = None  # a drained attempt's KV, held until an engine adopts it
    prior_kv: int = 0  # tokens some earlier engine held KV for: what a re-prefill redoes


class ProxyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8200, ge=0, le=65535)
    admin_token: str | None = None
    # bearer token sent to every engine (None: the admin token, the run's one token)
    engine_token: str | None = None
    kv_handoff: bool = True
    max_attempts: int = Field(64, ge=1)
    # a call's whole life, queueing for a slot included (an execution may set its own)
    request_timeout_s: float = Field(600.0, gt=0)
    drain_timeout_s: float = Field(120.0, gt=0)
    max_prompt_tokens: int = Field(32768, ge=1)
    require_registration: bool = False
    # a registered execution with no call for this long past its call timeout is closed
    # (reason timeout) and dropped from the registry
    execution_idle_s: float = Field(1800.0, gt=0)
    health_probes: int = Field(3, ge=1)
    health_interval_s: float = Field(1.0, gt=0)
    # an engine silent (no /health answer, no answer to any call) for probes x interval is
    # down; one probe waits at most this long for its answer (a late answer still counts)
    health_timeout_s: float = Field(5.0, gt=0)
    max_error_retries: int = Field(3, ge=0)  # per call, on 5xx answers and failed steps
    error_backoff_s: float = Field(0.1, ge=0)
    # admission control (tidal.control.admission): 'off', 'saturation' or a per-token latency
    # target in seconds; with it on, each engine's cap is its concurrency target on the curve
    admission: str | float = "off"
    admission_order: str = "longest_waiting"
    engine_curve: list[tuple[int, float]] | None = None  # [[batch, tokens/s], ...]
    # the run's seed: a call of a named execution that brings no seed of its own samples
    # with tidal.seeding.call_seed(seed, execution id, call index); None: engines' own streams
    seed: int | None = None
    # how tool calls are read out of chat answers (tidal.serving.chat.TOOL_PARSERS), per model
    # family as vLLM's --tool-call-parser: hermes (<tool_call>{json}</tool_call>: Qwen, Hermes)
    tool_call_parser: str = "hermes"
    # calls of one X-Session-ID (else one execution) go to the engine that served the last one
    # while it has a slot (its prefix is cached there); off: least-loaded for every call
    affinity: bool = True


class Proxy:
    def __init__(self, config: ProxyConfig | None = None, clock: Clock | None = None) -> None:
        self.config = config or ProxyConfig()
        self.clock = clock or WallClock()
        self.router = Router()
        self.records = RecordStore()
        self._call_counts: dict[str, int] = {}  # execution id -> calls seen (seed derivation)
        self.admission = AdmissionRule.parse(self.config.admission, self.config.admission_order)
        self._curve = None
        if self.admission.on:
            if self.config.engine_curve is None:
                raise ConfigError(
                    "control.engine_curve",
                    "admission control needs the "
                    "engines' throughput curve [[batch, tokens/s], ...]",
                )
            self._curve = curve_from_points(self.config.engine_curve)
        self.queue = AdmissionQueue(self.admission.order)
        # seconds each execution's calls waited in the admission queue (over-subscription)
        self.queued_waits = QueuedWaits()
        self.health = HealthMonitor(
            self,
            self.config.health_interval_s,
            self.config.health_probes,
            self.config.health_timeout_s,
        )
        self._released = asyncio.Condition()  # an attempt left an engine's in-flight set
        self._joined = asyncio.Event()  # an engine joined (tokenizing calls wait for one)
        self.overhead_s: deque[float] = deque(maxlen=20_000)
        self.totals = {
            "calls": 0,
            "retries": 0,
            "drains": 0,
            "kv_handoffs": 0,
            "engine_failures": 0,
            "reprefill_tokens": 0,
            "saved_prefill_tokens": 0,
            "failed_calls": 0,
            "engine_errors": 0,
            "engine_step_failures": 0,
            "kv_handoff_failures": 0,
            "kv_mixed_moves": 0,
        }
        # The decode meter (``Observation.decode_meter``), over all engines and cumulative:
        # every token an engine sent back (of calls that later moved or failed too), and the
        # time integral of calls held at an engine (in one's in-flight set; not queued here).
        self.decoded_tokens = 0
        self._held, self._held_s, self._held_at = 0, 0.0, self.clock.now()

    @property
    def engine_token(self) -> str | None:
        return self.config.engine_token or self.config.admin_token

    # -- membership ------------------------------------------------------------------------
    async def join(
        self,
        engine_id: str,
        url: str,
        backend: str = "builtin",
        kind: Kind = "standalone",
        cell_index: int = 0,
        cap: int = 32,
        model: str | None = None,
        wait_healthy_s: float = 0.0,
    ) -> Member:
        if engine_id in self.router.members:
            raise BadRequest(f"engine {engine_id!r} is already a member")
        adapter = make_adapter(backend, url, api_key=self.engine_token)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_healthy_s
        while not await adapter.health() and loop.time() < deadline:
            await asyncio.sleep(0.25)
        if not await adapter.health():
            await adapter.close()
            raise BadRequest(f"engine {engine_id!r} at {url} is not healthy")
        max_len = None
        try:
            served, max_len = await adapter.served_model_card()
        except ServingError:
            served = ""
        model = served if model is None else model
        if self._curve is not None:  # admission control: the engine's concurrency target
            cap = concurrency_target(self._curve, cap, self.admission)
        member = Member(engine_id, adapter, kind, cell_index, cap, backend, model, max_len)
        self.router.join(member)
        self.health.forget(engine_id)  # a replacement under a lost engine's id
        self.queue.notify()
        self._joined.set()
        return member

    async def leave(self, engine_id: str, drain: bool = True) -> None:
        if engine_id not in self.router.members:
            if self.health.forget(engine_id):  # a lost engine: no longer waited for
                return
            raise NotFound(f"unknown engine {engine_id!r}")
        if drain:
            await self.drain(engine_id)
        member = self.router.leave(engine_id)
        if member is not None:
            await member.adapter.close()

    def undrain(self, engine_id: str) -> Member | Lost:
        lost = self._lost_owned(engine_id, admitting=True)
        if lost is not None:
            return lost
        member = self.router.set_admitting(engine_id, True)
        self.queue.notify()
        return member

    def _lost_owned(self, engine_id: str, admitting: bool) -> Lost | None:
        """An engine the health monitor took out of routing (missed probes) is still its
        owner's: a drain or undrain of it is kept on its record, so it comes back as its owner
        left it (its calls moved when it left). None: it is no lost engine."""
        lost = self.health.lost.get(engine_id)
        if engine_id in self.router.members or lost is None:
            return None
        lost.admitting = admitting
        log.info(
            "%s %s while it is out of routing (down): it comes back %s",
            "undrained" if admitting else "drained",
            engine_id,
            "admitting" if admitting else "drained",
        )
        return lost

    async def drain(self, engine_id: str, handoff: bool | None = None) -> dict:
        """Stop admission, reserve destinations, re-route, cancel at the source; return once
        the source holds no request of ours and no KV a call still has to export from it
        (REFERENCE.md §1, harness-preserving change). An engine down (out of routing) holds
        no call of ours: its drain is kept for its return and moves nothing."""
        t0 = self.clock.now()
        lost = self._lost_owned(engine_id, admitting=False)
        if lost is not None:
            return {
                "engine": engine_id,
                "moved": 0,
                "finished_at_source": 0,
                "kv_handoff": False,
                "kv_capable": False,
                "reprefill_tokens": 0,
                "duration_s": 0.0,
                "lost": True,
            }
        member = self.router.set_admitting(engine_id, False)
        use_kv = (
            self.config.kv_handoff if handoff is None else handoff
        ) and member.adapter.supports_kv_handoff
        attempts = [a for a in member.inflight.values() if isinstance(a, Attempt) and not a.ended]
        for a in attempts:
            if a.execution_id is not None:
                self.router.reserve(a.execution_id, engine_id)
            a.cancelled, a.keep_kv = True, use_kv
        # unsent attempts (importing a handed-off KV) see ``cancelled`` and go elsewhere; ids
        # the engine does not know yet are ignored there and aborted at their first chunk
        sent = [a.request_id for a in attempts if a.sent]
        if sent:
            try:
                await member.adapter.abort(sent, keep_kv=use_kv)
            except ServingError as exc:  # a dead engine: its calls retry on their own
                log.warning("drain %s: abort failed (%s)", engine_id, exc)
        await self._wait_empty(member)
        self.totals["drains"] += 1
        took = self.clock.now() - t0
        # a call the engine finished before the abort reached it stayed where it was: only
        # the others moved (``rerouted_requests`` counts the same calls from the other side)
        moved = [a for a in attempts if not a.finished]
        log.info(
            "drained %s: %d calls moved, %d finished there first, in %.3f s (kv handoff %s)",
            engine_id,
            len(moved),
            len(attempts) - len(moved),
            took,
            use_kv,
        )
        # the cost of each move without a handoff: its context is prefilled again elsewhere
        reprefill = 0 if use_kv else sum(a.context_tokens for a in moved)
        return {
            "engine": engine_id,
            "moved": len(moved),
            "finished_at_source": len(attempts) - len(moved),
            "kv_handoff": use_kv,
            "kv_capable": member.adapter.supports_kv_handoff,
            "reprefill_tokens": reprefill,
            "duration_s": took,
        }

    async def _wait_empty(self, member: Member) -> None:
        try:
            async with self._released:
                await asyncio.wait_for(
                    self._released.wait_for(lambda: not member.inflight),
                    self.config.drain_timeout_s,
                )
        except TimeoutError:
            raise TimeoutExpired(
                f"drain {member.engine_id}: {len(member.inflight)} requests "
                f"still running after {self.config.drain_timeout_s} s"
            ) from None

    def _hold(self, delta: int) -> None:
        """The number of calls held at engines changes by ``delta`` now (the meter's exposure)."""
        now = self.clock.now()
        self._held_s += self._held * (now - self._held_at)
        self._held, self._held_at = self._held + delta, now

    def decode_meter(self) -> dict[str, float]:
        """Tokens the engines decoded and sequence-seconds held at them, up to now."""
        return {
            "tokens": float(self.decoded_tokens),
            "inflight_s": self._held_s + self._held * (self.clock.now() - self._held_at),
        }

    async def _release_slot(self, member: Member, request_id: str) -> None:
        attempt = member.inflight.pop(request_id, None)
        if attempt is not None:
            self._hold(-1)
            member.streamed_tokens -= getattr(attempt, "streamed_tokens", 0)
        self.queue.notify()
        async with self._released:
            self._released.notify_all()

    # -- model calls -----------------------------------------------------------------------
    async def tokenize(
        self,
        prompt: str | None = None,
        messages: list[dict] | None = None,
        timeout_s: float | None = None,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """Prompt ids from the first engine that answers; with none (all lost, replacements
        starting) it waits for one to join, within the call's timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeout_s or self.config.request_timeout_s)
        while True:
            for member in list(self.router.members.values()):
                if member.alive:
                    try:
                        return await member.adapter.tokenize(
                            prompt=prompt, messages=messages, tools=tools
                        )
                    except EngineUnavailable:
                        continue
            left = deadline - loop.time()
            if left <= 0:
                raise Overloaded("no engine available to tokenize the prompt")
            self._joined.clear()
            with contextlib.suppress(TimeoutError):  # 1 s: only bounds a missed join
                await asyncio.wait_for(self._joined.wait(), min(left, 1.0))

    async def bridge(self, execution_id: str, prompt: list[int]) -> list[int] | None:
        """``prompt`` with the ids the model sampled for the execution's earlier turns in
        place of their re-tokenized text (``drift.bridge``); None: nothing to replace."""
        member = next((m for m in self.router.members.values() if m.alive), None)
        if member is None:
            return None
        return await bridge(member.adapter, self.records.calls(execution_id), prompt)

    async def complete(
        self,
        execution_id: str | None,
        prompt: list[int],
        params: SamplingParams,
        on_chunk: Callable[[TokenChunk], None] | None = None,
        record_overhead: bool = True,
        timeout_s: float | None = None,
        session: str | None = None,
        bridged: bool = False,
    ) -> Result:
        """Run one model call to its end across engine changes, within ``timeout_s`` (default
        ``request_timeout_s``). ``res.upstream_s`` is the time spent waiting on engines and
        admission; the rest is the proxy's own (recorded in ``overhead_s`` unless the caller
        measures a wider span itself). A call that fails is logged with its id and reason."""
        if len(prompt) > self.config.max_prompt_tokens:
            raise BadRequest(
                f"prompt of {len(prompt)} tokens exceeds the limit of "
                f"{self.config.max_prompt_tokens}"
            )
        call = CallRecord(
            call_id=uuid.uuid4().hex[:16],
            prompt_token_ids=list(prompt),
            max_tokens=params.max_tokens,
            bridged=bridged,
        )
        self.totals["calls"] += 1
        params = self._seeded(execution_id, params)
        try:
            return await self._complete(
                call, execution_id, prompt, params, on_chunk, record_overhead, timeout_s, session
            )
        except ServingError as exc:
            self.totals["failed_calls"] += 1
            log.warning(
                "call %s (execution %s) failed after %d segments: %s: %s",
                call.call_id,
                execution_id,
                len(call.segments),
                type(exc).__name__,
                exc,
            )
            raise

    def _seeded(self, execution_id: str | None, params: SamplingParams) -> SamplingParams:
        """``params`` with the call's derived seed when the run has a seed, the call names its
        execution and brings no seed of its own. The index counts the execution's calls in
        the order they reach the proxy (a harness makes them one after another)."""
        if execution_id is None or self.config.seed is None:
            return params
        index = self._call_counts.pop(execution_id, 0)
        if len(self._call_counts) >= self.records.max_executions:  # bounded: oldest first
            self._call_counts.pop(next(iter(self._call_counts)))
        self._call_counts[execution_id] = index + 1
        if params.seed is not None:
            return params
        return params.model_copy(update={"seed": call_seed(self.config.seed, execution_id, index)})

    async def _complete(
        self,
        call: CallRecord,
        execution_id: str | None,
        prompt: list[int],
        params: SamplingParams,
        on_chunk,
        record_overhead: bool,
        timeout_s: float | None,
        session: str | None = None,
    ) -> Result:
        t_start = time.perf_counter()
        st = _CallState(Result(list(prompt)))
        res = st.res
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeout_s or self.config.request_timeout_s)
        # affinity: a session's (else the execution's) calls go to the engine holding its prefix
        route_key = (session or execution_id) if self.config.affinity else None
        for attempt_no in range(1, self.config.max_attempts + 1):
            remaining = params.max_tokens - len(res.token_ids)
            if remaining <= 0:
                res.finish_reason = "length"
                break
            t_wait = time.perf_counter()
            member = await self._acquire(route_key, deadline, execution_id)
            st.waited_s += time.perf_counter() - t_wait
            # no await between the pick and this line: a drain that begins later sees it
            attempt = Attempt(route_key, f"{call.call_id}-{attempt_no}", member)
            member.inflight[attempt.request_id] = attempt
            self._hold(+1)
            reason, failure = await self._attempt(
                call, st, attempt, attempt_no, prompt, params, remaining, on_chunk
            )
            if reason in ("stop", "length"):
                res.finish_reason = reason
                break
            await self._after_attempt(call, st, attempt, reason, failure, prompt)
            self.totals["retries"] += 1
        else:
            raise EngineUnavailable(
                f"call {call.call_id}: no engine finished it in {self.config.max_attempts} attempts"
            )
        res.upstream_s = st.waited_s
        if params.stop:  # a stop string that spans two engines' segments of a moved call
            cut = cut_at_stop(res.text, params.stop)
            res.text = res.text if cut is None else res.text[:cut]
        if record_overhead:
            self.overhead_s.append(time.perf_counter() - t_start - st.waited_s)
        call.finish_reason = res.finish_reason
        if execution_id is not None:
            self.records.add(execution_id, call)
        return res

    async def _attempt(
        self,
        call: CallRecord,
        st: _CallState,
        attempt: Attempt,
        attempt_no: int,
        prompt: list[int],
        params: SamplingParams,
        remaining: int,
        on_chunk: Callable[[TokenChunk], None] | None,
    ) -> tuple[str | None, Exception | None]:
        """One engine's part of a call (its KV adopted if one was handed over): (the
        engine's finish reason or None, a failure to back off on or None). A refused first
        attempt raises ``BadRequest``; an engine gone or full is checked by health."""
        member = attempt.member
        seg = Segment(engine_id=member.engine_id, request_id=attempt.request_id)
        reason, failure = None, None
        try:
            handle = None
            if st.blob is not None:
                handle, st.blob = await import_kv(st.blob, attempt)
            if attempt.cancelled:  # its drain began before anything was sent: go on
                await release_import(attempt, handle)
            else:
                reason = await self._run_attempt(
                    attempt, seg, st.res, prompt, params, remaining, handle, st.prior_kv, on_chunk
                )
                if reason is None and attempt.keep_kv:
                    blob = await export_kv(attempt)
                    # drained again before its engine answered: the export it carried in
                    # (if that engine did not take it) is still the call's KV
                    if blob is not None or attempt.started or attempt.kv_result:
                        st.blob = blob
        except BadRequest:
            if attempt_no == 1 and not st.res.token_ids:
                raise
            seg.ended_by = "error"  # e.g. a refused request: retry plainly
            log.exception("call %s: retrying after a refused request", call.call_id)
        except EngineError as exc:  # alive, but failed this call: a bounded few retries
            seg.ended_by, failure = "error", exc
        except (EngineUnavailable, Overloaded) as exc:
            seg.ended_by = "error"
            if attempt.sent and isinstance(exc, EngineUnavailable):
                # it had the prompt (and the tokens so far): the next engine prefills again
                st.prior_kv = max(st.prior_kv, len(prompt) + len(st.res.token_ids) - 1)
            t_check = time.perf_counter()
            await self.health.check(member, exc)
            st.waited_s += time.perf_counter() - t_check
        finally:
            st.waited_s += attempt.upstream_s
            if attempt.kv_result == "lost":  # it re-prefills instead: counted, not an error
                self.totals["kv_handoff_failures"] += 1
            elif attempt.kv_result == "mixed":
                self.totals["kv_mixed_moves"] += 1
            await self._release_slot(member, attempt.request_id)
            if seg.token_ids or seg.ended_by:
                call.segments.append(seg)
        log.debug(
            "call %s attempt %d on %s: %s after %d tokens (kv %s, cancelled %s)",
            call.call_id,
            attempt_no,
            member.engine_id,
            reason or seg.ended_by,
            len(seg.token_ids),
            attempt.kv_tokens,
            attempt.cancelled,
        )
        return reason, failure

    async def _after_attempt(
        self,
        call: CallRecord,
        st: _CallState,
        attempt: Attempt,
        reason: str | None,
        failure: Exception | None,
        prompt: list[int],
    ) -> None:
        """Between an unfinished attempt and the next: back off after a failure (the slot
        given back), and carry what the engine held (the KV tokens a re-prefill redoes, the
        blob only while a drain kept it)."""
        member = attempt.member
        if reason == "error":  # the engine's step failed under this call
            self.totals["engine_step_failures"] += 1
            failure = EngineError(f"engine {member.engine_id}: a model step failed")
        if failure is not None:  # back off with the slot given back
            st.errors += 1
            t_back = time.perf_counter()
            await self._after_error(call, member, failure, st.errors)
            st.waited_s += time.perf_counter() - t_back
        if attempt.started:
            held = (
                attempt.kv_tokens
                if attempt.kv_tokens is not None
                else len(prompt) + len(st.res.token_ids) - 1
            )
            st.prior_kv = max(st.prior_kv, held)
            if not attempt.keep_kv:
                st.blob = None  # the engine adopted it (or newer tokens have no KV)

    async def _run_attempt(
        self,
        attempt: Attempt,
        seg: Segment,
        res: Result,
        prompt: list[int],
        params: SamplingParams,
        remaining: int,
        kv_handle: str | None,
        prior_kv: int,
        on_chunk: Callable[[TokenChunk], None] | None,
    ) -> str | None:
        member = attempt.member
        prompt_now = prompt + res.token_ids
        update: dict = {"max_tokens": remaining}
        if params.seed is not None and res.token_ids:  # go on where the stream stood
            update["seed"] = continued_seed(params.seed, len(res.token_ids))
        req = GenerateRequest(
            attempt.request_id,
            prompt_now,
            params.model_copy(update=update),
            kv_handle,
            stream=on_chunk is not None,
            output_context=len(res.token_ids),
        )
        reason = None
        attempt.sent = True
        attempt.context_tokens = len(prompt_now)
        stream = member.adapter.generate(req)
        while True:
            t_up = time.perf_counter()
            try:
                chunk = await anext(stream)
            except StopAsyncIteration:
                break
            finally:
                attempt.upstream_s += time.perf_counter() - t_up
            attempt.started = True
            member.progress_s = asyncio.get_running_loop().time()  # working: not hung
            if chunk.prompt_token_ids is not None:
                seg.cached_tokens = chunk.cached_tokens or 0
                member.prompt_tokens += len(prompt_now)
                member.cached_tokens += seg.cached_tokens
                # tokens an earlier engine had computed and this one computes again; an
                # attempt aborted before its engine computed anything (it waited in the
                # queue: the abort reports the KV it held) recomputed nothing, and the
                # next engine's segment counts the recomputation, once
                computed = len(prompt_now) - 1
                if (
                    chunk.finish_reason == "abort"
                    and not chunk.token_ids
                    and chunk.kv_tokens is not None
                ):
                    computed = min(computed, chunk.kv_tokens)
                seg.reprefill_tokens = max(0, min(prior_kv, computed) - seg.cached_tokens)
                self.totals["reprefill_tokens"] += seg.reprefill_tokens
                if kv_handle is not None:
                    self.totals["kv_handoffs"] += 1
                    self.totals["saved_prefill_tokens"] += seg.cached_tokens
                    if seg.reprefill_tokens:  # the engine loaded less than was handed over
                        attempt.kv_result = "lost"
            if attempt.cancelled and not attempt.abort_sent and not chunk.finish_reason:
                # drained before the engine knew the request
                attempt.abort_sent = True
                t_up = time.perf_counter()
                await member.adapter.abort([attempt.request_id], keep_kv=attempt.keep_kv)
                attempt.upstream_s += time.perf_counter() - t_up
            if chunk.token_ids:
                seg.token_ids += chunk.token_ids
                attempt.context_tokens += len(chunk.token_ids)
                attempt.streamed_tokens += len(chunk.token_ids)
                if attempt.request_id in member.inflight:  # its slot not yet released
                    member.streamed_tokens += len(chunk.token_ids)
                self.decoded_tokens += len(chunk.token_ids)
                seg.logprobs += chunk.logprobs
                seg.versions += chunk.versions
                res.add(TokenChunk(chunk.token_ids, chunk.logprobs, chunk.versions, chunk.text))
                if on_chunk is not None:
                    on_chunk(chunk)
            if chunk.finish_reason:
                reason = chunk.finish_reason
                attempt.kv_tokens = seg.kv_tokens = chunk.kv_tokens
        attempt.ended = True
        attempt.finished = reason in ("stop", "length")
        seg.ended_by = reason or "lost"
        return reason if reason != "abort" else None

    async def _acquire(
        self, route_key: str | None, deadline: float, execution_id: str | None = None
    ) -> Member:
        """An engine with room, in queue order; ``Overloaded`` at the call's deadline. A wait
        in the queue is charged to the call's execution (``queued_execution_*`` figures)."""

        def waited(s: float) -> None:
            self.queued_waits.add(execution_id or "(anonymous)", s)

        return await self.queue.acquire(
            lambda: self.router.pick(route_key), deadline, on_wait=waited
        )

    async def _after_error(
        self, call: CallRecord, member: Member, exc: Exception, errors: int
    ) -> None:
        """Count and log an engine's failure of this call; raise past ``max_error_retries``,
        else back off (doubling) before the retry."""
        self.totals["engine_errors"] += 1
        log.warning(
            "call %s: engine %s failed it (%s); %s",
            call.call_id,
            member.engine_id,
            exc,
            "giving up" if errors > self.config.max_error_retries else "retrying",
        )
        if errors > self.config.max_error_retries:
            raise EngineError(f"call {call.call_id}: engines failed it {errors} times; last: {exc}")
        await asyncio.sleep(self.config.error_backoff_s * 2 ** (errors - 1))

    def stats(self, reset_overhead: bool = False) -> dict:
        lat = sorted(self.overhead_s)
        if reset_overhead:
            self.overhead_s.clear()
        overhead = {"n": len(lat)}
        if lat:
            overhead.update(
                {
                    "p50_ms": 1e3 * lat[len(lat) // 2],
                    "p99_ms": 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
                }
            )
        return {
            "overhead": overhead,
            "engines": [m.describe() for m in self.router.members.values()],
            "lost_engines": sorted(self.health.lost),
            "readmitted_engines": self.health.readmitted,
            "capacity": self.router.capacity(),
            "inflight": sum(len(m.inflight) for m in self.router.members.values()),
            **self.queue.stats(),
            **self.queued_waits.figures(),
            "executions_recorded": len(self.records),
            **self.records.stats(),
            **self._cache_share(),
            "rerouted_executions": self.router.rerouted_executions,
            **self.totals,
            "decode_meter": self.decode_meter(),
        }

    def _cache_share(self) -> dict:
        """Prompt tokens the engines found cached (prefix cache, imported KV), per engine and
        in all: what affinity buys."""
        members = list(self.router.members.values())
        prompt = sum(m.prompt_tokens for m in members)
        cached = sum(m.cached_tokens for m in members)
        return {
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "cached_token_share": round(cached / prompt, 4) if prompt else 0.0,
            "cached_token_share_by_engine": {
                m.engine_id: round(m.cached_tokens / m.prompt_tokens, 4) if m.prompt_tokens else 0.0
                for m in members
            },
        }

    def serving(self) -> int:
        """Engines that take calls now (routable)."""
        return sum(m.routable() for m in self.router.members.values())

    async def close(self) -> None:
        await self.health.stop()
        for member in list(self.router.members.values()):
            await member.adapter.close()
