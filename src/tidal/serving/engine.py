"""The built-in engine: continuous batching over a ``CausalLM`` with per-request KV caches.

In: ``GenerateRequest`` (prompt token ids + sampling params, optionally an imported KV handle) and
control calls (pause/resume, abort, sleep/wake, load weights, KV export/import). Out: a stream of
``TokenChunk`` per request; every token carries its log-prob and the weight version that made it.

State lives on the asyncio loop; only the model forward runs in a worker thread, under
``_step_lock``, so weight loads and sleeps happen between steps, never inside one. A step owns
its inputs: the pending tokens and KV caches of its batch are taken on the loop before it runs,
so an abort during the step (which drops the request's cache) cannot pull them from under it.
A step that fails anyway is counted (``step_failures``) and ends its requests with ``error``.

Device: the model and every KV cache live on ``EngineConfig.device`` (CPU, or a CUDA device that
must be visible); each step's ``[B, V]`` logits come back to the CPU once, so sampling, log-probs
and the seeded CPU generators behave the same on every device. Sleep frees the weights and KV
memory on the device (CUDA's cached blocks too); weight files are always read on the CPU and
copied in (or, from CUDA IPC, mapped and copied device to device). The settings (``EngineConfig``)
and the spill file's place are in ``engine_config``. Over 500 lines: the request loop, control
calls and weight loads share one lock and one state, kept in one class.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import torch

from tidal.clock import Clock, WallClock
from tidal.errors import TidalError
from tidal.models import CausalLM, Tokenizer, open_weights
from tidal.models.device import HostStash, device_peak_mb, resolve_device
from tidal.serving.engine_config import EngineConfig, spill_path
from tidal.serving.engine_state import KVStore, RateMeter, Request, sample_batch
from tidal.serving.prefix_cache import PrefixCache
from tidal.serving.protocol import BadRequest, GenerateRequest, Overloaded, StopText, TokenChunk
from tidal.training.segment_maps import Mapped, SegmentMaps, adopt, adoptable

log = logging.getLogger(__name__)
PAUSE_MODES = ("abort", "wait", "keep")
MAX_EARLY_ABORTS = 4096


class Engine:
    def __init__(
        self,
        model: CausalLM,
        tokenizer: Tokenizer,
        model_dir: str | Path,
        config: EngineConfig | None = None,
        clock: Clock | None = None,
        weight_version: str = "v0",
    ) -> None:
        self.config = config or EngineConfig()
        self.device = resolve_device(self.config.device)  # a clear error if CUDA is missing
        self.model, self.tokenizer = model.to(self.device), tokenizer
        self.clock = clock or WallClock()
        self.weight_version = weight_version
        self.last_pause_s = 0.0  # how long the last weight load held the engine's steps
        # the last load's parts: ``prepare_s`` (opened and checked, off the step path) and
        # ``step_wait_s`` (waiting for the step in flight to end before the swap)
        self.last_load_parts: dict[str, float] = {}
        self._weights_source: Path | None = Path(model_dir)
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._requests: dict[str, Request] = {}
        self._aborted_early: dict[str, bool] = {}  # id -> keep_kv, oldest first
        self.kv = KVStore(model, self.clock, self.config.kv_lease_s)
        self.prefix = PrefixCache(int(self.config.prefix_cache_mb * 2**20))
        self._paused = False
        self._sleeping = False
        self._spill: Path | None = None
        self._held: dict[str, torch.Tensor] | None = None  # level 1 without a spill_dir
        # level 1's pinned host buffers (on CUDA; CPU tensors stay as they are), allocated at
        # the first sleep and reused by every later one: a copy at the host link's speed
        self._stash = HostStash()
        # the shared-memory segments this engine loaded, and the one it serves from (its
        # weights are then views of the segment's pages: ``tidal.training.segment_maps``)
        self._segments = SegmentMaps()
        self._premap: asyncio.Future | None = None
        self._wakeup = asyncio.Event()
        self._step_lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self._rng = torch.Generator().manual_seed(self.config.seed)
        self.meter = RateMeter(self.clock)
        self.totals = {
            "generated_tokens": 0,
            "prefill_tokens": 0,
            "cached_tokens": 0,
            "requests": 0,
            "aborted": 0,
            "step_failures": 0,
            "sampling_failures": 0,
        }

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=f"engine-{self.config.name}")

    async def stop(self) -> None:
        self.abort(None)
        self._stopped = True
        self._wakeup.set()
        if self._task:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), 5.0)
            except TimeoutError:
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
        if self._spill is not None:  # a sleeping engine that ends leaves no weights behind
            self._spill.unlink(missing_ok=True)
        if self._premap is not None:
            await asyncio.gather(self._premap, return_exceptions=True)
        self._segments.close()

    # -- requests --------------------------------------------------------------------------
    async def generate(
        self, req: GenerateRequest, min_interval_s: float = 0.0
    ) -> AsyncIterator[TokenChunk]:
        """Stream chunks for ``req``; the last chunk has a finish reason. With
        ``min_interval_s`` tokens are coalesced into at most one chunk per interval (an abort
        or finish is sent at once). Closing the iterator early aborts the request."""
        r = self._admit(req)
        stops = StopText(req.params.stop)
        try:
            sent = texted = 0  # tokens sent; tokens whose text is sent (it may lag)
            first = True
            while True:
                await r.changed.wait()
                if min_interval_s and not first and r.finish_reason is None:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(r.finished.wait(), min_interval_s)
                r.changed.clear()
                n = len(r.tokens)
                final = r.finish_reason is not None
                # the text of a stop token (eos, stop_token_ids) is not the answer's (vLLM)
                end = n - 1 if final and self._ended_by_stop_token(r) else n
                text, texted = self._text(r, texted, max(texted, end), final=final)
                if r.finish_reason == "abort":  # the call may go on elsewhere: a character
                    text = text.rstrip("\ufffd")  # cut in half is the next engine's to send
                chunk = TokenChunk(
                    r.tokens[sent:n],
                    r.logprobs[sent:n],
                    r.versions[sent:n],
                    text=stops.feed(text, final),
                )
                if first:
                    chunk.prompt_token_ids, chunk.cached_tokens = r.prompt, r.cached_tokens
                    first = False
                sent = n
                if r.finish_reason is not None and sent == len(r.tokens):
                    chunk.finish_reason = r.finish_reason
                    if r.finish_reason == "abort":
                        chunk.kv_tokens = r.kv_tokens
                    yield chunk
                    return
                if chunk.token_ids or chunk.prompt_token_ids is not None:
                    yield chunk
        finally:
            if r.finish_reason is None:
                self.abort([r.id])
            self._requests.pop(r.id, None)

    def _ended_by_stop_token(self, r: Request) -> bool:
        last = r.tokens[-1] if r.tokens else None
        return (
            r.finish_reason == "stop"
            and not r.params.ignore_eos
            and last is not None
            and (last == self.tokenizer.eos_id or last in r.params.stop_token_ids)
        )

    def _text(self, r: Request, start: int, end: int, final: bool) -> tuple[str, int]:
        """The text of tokens ``start:end`` and where the next chunk's text starts. Decoded
        with a few tokens of context and held back while it ends in a partial character, so
        the texts of a request's chunks add up to the same string however the tokens were
        cut into chunks (byte-level tokens split characters). A rerouted call's earlier
        output (the prompt's last ``output_context`` tokens) is the context of its first
        text, less a partial character at its end, which the engine before held back (an
        abort sends no trailing U+FFFD): this engine sends that character whole."""
        if end <= start:
            return "", start
        earlier = r.output_tail if start == 0 else []
        ctx = max(0, start - 6)
        head = earlier + r.tokens[ctx:start]
        prefix = self.tokenizer.decode(head)
        if earlier:
            prefix = prefix.rstrip("\ufffd")  # sent by no engine yet
        full = self.tokenizer.decode(head + r.tokens[start:end])
        if not final and (full.endswith("\ufffd") or not full.startswith(prefix)):
            return "", start
        return full[len(prefix) :], end

    def _admit(self, req: GenerateRequest) -> Request:
        if req.request_id in self._requests:
            raise BadRequest(f"request id {req.request_id!r} is already in flight")
        if not req.prompt_token_ids:
            raise BadRequest("prompt is empty")
        if len(req.prompt_token_ids) >= self.model.max_seq_len:
            raise BadRequest(
                f"prompt of {len(req.prompt_token_ids)} tokens does not fit the "
                f"context of {self.model.max_seq_len}"
            )
        bad = [t for t in req.prompt_token_ids if not 0 <= t < self.model.vocab_size]
        if bad:
            raise BadRequest(f"token id {bad[0]} outside vocabulary of {self.model.vocab_size}")
        if len(self._waiting) >= self.config.max_waiting:
            raise Overloaded(f"engine {self.config.name}: {len(self._waiting)} requests waiting")
        r = Request(req.request_id, list(req.prompt_token_ids), req.params, self.clock.now())
        if req.output_context:  # enough of the earlier output to finish a cut character
            r.output_tail = r.prompt[-min(req.output_context, 16) :]
        tombstone = self._aborted_early.pop(r.id, None)
        if req.kv_handle is not None:
            r.cache, adopted = self.kv.adopt(req.kv_handle, r.prompt)
            # what start() will reuse; reported as is if an abort comes first (nothing is
            # computed, the adopted cache is what an abort with keep_kv pins)
            r.cached_tokens = min(adopted, len(r.prompt) - 1)
        else:  # the conversation's previous call may have left its KV here
            r.cache, hit = self.prefix.take(r.prompt)
            r.cached_tokens = min(hit, len(r.prompt) - 1)
        if r.params.seed is not None:
            r.rng = torch.Generator().manual_seed(r.params.seed)
        self._requests[r.id] = r
        self.totals["requests"] += 1
        if tombstone is not None:  # aborted before it arrived: it ends at once
            self.abort([r.id], keep_kv=tombstone)
            return r
        self._waiting.append(r)
        self._wakeup.set()
        return r

    # -- control ---------------------------------------------------------------------------
    def abort(self, request_ids: list[str] | None, keep_kv: bool = False) -> int:
        """Finish the named requests (all when None) with ``abort``; they keep their partial
        tokens. With ``keep_kv`` their caches stay pinned for export (lease ``kv_lease_s``).
        A named id not seen yet is remembered (bounded): that request is aborted on arrival,
        so a caller's abort never loses a race with its own request on another connection."""
        if request_ids is not None:
            for rid in request_ids:
                if rid not in self._requests:
                    self._aborted_early[rid] = keep_kv
            while len(self._aborted_early) > MAX_EARLY_ABORTS:
                self._aborted_early.pop(next(iter(self._aborted_early)))
        targets = (
            list(self._requests.values())
            if request_ids is None
            else [self._requests[i] for i in request_ids if i in self._requests]
        )
        n = 0
        for r in targets:
            if r.finish_reason is None:
                if keep_kv and r.cache is not None:
                    self.kv.pin(r.id, r.prompt + r.tokens, r.cache)
                self._finish(r, "abort")
                self.totals["aborted"] += 1
                n += 1
        return n

    async def pause(self, mode: str = "abort") -> None:
        if mode not in PAUSE_MODES:
            raise BadRequest(f"pause mode must be one of {PAUSE_MODES}, not {mode!r}")
        if mode == "abort":
            self.abort(None)
        elif mode == "wait":
            self._paused_admission = True
            try:
                await asyncio.wait_for(self._drained(), self.config.wait_timeout_s)
            finally:
                self._paused_admission = False
        self._paused = True
        async with self._step_lock:  # a step in flight completes before pause returns
            pass
        log.info("engine %s paused (%s)", self.config.name, mode)

    async def _drained(self) -> None:
        while self._running:
            await asyncio.sleep(0.005)

    async def resume(self) -> None:
        self._paused = False
        self._wakeup.set()
        log.info("engine %s resumed", self.config.name)

    @property
    def is_paused(self) -> bool:
        return self._paused

    @property
    def is_sleeping(self) -> bool:
        return self._sleeping

    async def sleep(self, level: int = 1) -> None:
        """Abort everything, drop every KV cache and free the weights. Level 1 keeps the current
        weights first: in pinned host buffers kept across sleeps (no ``spill_dir``), or spilled
        to disk; level 2 reloads from the last weight source on wake."""
        if level not in (1, 2):
            raise BadRequest("sleep level must be 1 or 2")
        async with self._step_lock:
            self.abort(None)
            self.kv.clear()
            self.prefix.clear()
            if level == 1 and not self._sleeping:
                from safetensors.torch import save_file

                # parameters, not state_dict(): a tied head must not appear twice
                if self.config.spill_dir is None:  # pinned host buffers, kept across sleeps
                    self._held = {
                        k: self._stash.to_host(k, v.detach())
                        for k, v in self.model.named_parameters()
                    }
                    self._stash.settle()
                else:
                    sd = {
                        k: v.detach().contiguous().cpu() for k, v in self.model.named_parameters()
                    }
                    self._spill = spill_path(self.config.spill_dir, self.config.name)
                    self._spill.parent.mkdir(parents=True, exist_ok=True)
                    # off the loop: /health and control routes keep answering while it writes
                    await asyncio.to_thread(save_file, sd, str(self._spill))
                    del sd
            if self._held is None:  # level 1 in memory keeps the served segment's views
                self._segments.serve(None)
            self.model.free_weights()
            self._sleeping = True
        log.info("engine %s asleep (level %d)", self.config.name, level)

    async def wake_up(self) -> None:
        async with self._step_lock:
            if not self._sleeping:
                return
            seg = None
            if self._held is None and self._spill is None and self._weights_source is not None:
                seg = await asyncio.to_thread(
                    self._open_checked, self._weights_source, self.weight_version
                )
            if seg is not None:  # the segment it served before (still that version): adopted
                self._serve_segment(seg)
                self._wakeup.set()
                log.info("engine %s awake", self.config.name)
                return
            if self._held is not None:
                sd = self._held
            elif self._spill is None and self._weights_source is None:
                raise TidalError(
                    "no weights to wake from (the last version came in memory): "
                    "load a version instead"
                )
            else:
                sd = await asyncio.to_thread(open_weights, self._spill or self._weights_source)
            self.model.materialize(self.device)
            self.model.load_weights(sd)  # strict: materialised memory is garbage until loaded
            self._segments.serve(None)  # a level-1 sleep's views of a segment: copied now
            self._drop_spill()
            self._sleeping = False
            self._wakeup.set()
        log.info("engine %s awake", self.config.name)

    def _drop_spill(self) -> None:
        """The weights a level-1 sleep put aside are no longer needed (woken or replaced)."""
        if self._spill is not None:
            self._spill.unlink(missing_ok=True)
        self._spill, self._held = None, None

    async def update_weights(self, path: str | Path, version: str) -> None:
        """Load weights of ``version`` from ``path`` between two steps; later tokens carry it.
        The file is read and checked whole first (names, shapes, finite values): a version
        that does not fit raises a ``TidalError`` and the loaded one keeps serving. A sleeping
        engine serves nothing a bad version could spoil: it reads the file once, straight into
        its weights, checks them there and stays asleep if they do not fit."""
        t_start = self.clock.now()
        self.last_load_parts = {}
        # a segment opened and checked in one trip off the loop (each trip waits for the loop)
        seg = await asyncio.to_thread(self._open_checked, path, version)
        if seg is not None:
            await self._load_segment(seg, version, t_start)
            if self._premap is None or self._premap.done():  # the ring's other files, ahead
                self._premap = asyncio.ensure_future(
                    asyncio.to_thread(self._segments.premap, seg.path)
                )
            return
        # read tensor by tensor, twice (checked whole, then copied in): never a second copy
        sd = await asyncio.to_thread(open_weights, path)
        if self._sleeping:  # nothing serves that a bad version could spoil: one pass
            async with self._step_lock:
                if self._sleeping:
                    t0 = self.clock.now()
                    await asyncio.to_thread(self._load_asleep, sd)
                    self._after_load(path, version)
                    self.last_pause_s = self.clock.now() - t0
                    return
        await asyncio.to_thread(self.model.check_weights, sd)
        t_ready = self.clock.now()
        async with self._step_lock:
            t0 = self.clock.now()
            self._own_weights()
            self.model.load_weights(sd)
            self._after_load(path, version)
            self.last_pause_s = self.clock.now() - t0  # no step ran meanwhile
        self._load_parts(t_start, t_ready, t0)

    def _load_parts(self, t_start: float, t_ready: float, t_locked: float) -> None:
        self.last_load_parts = {
            "prepare_s": round(t_ready - t_start, 6),
            "step_wait_s": round(t_locked - t_ready, 6),
        }

    async def _load_segment(self, seg: Mapped, version: str, t_start: float) -> None:
        """A version in a shared-memory segment (mapped, locked, its label checked): names and
        shapes checked whole (values too unless its writer checked them as it wrote:
        ``_open_checked``), then, between two steps, served straight from its pages (a CPU
        engine of its dtype: no copy) or copied in, one ``copy_`` per tensor. A sleeping engine
        wakes into it."""
        t_ready = self.clock.now()
        async with self._step_lock:
            t0 = self.clock.now()
            self._serve_segment(seg)
            self._after_load(seg.path, version)
            self.last_pause_s = self.clock.now() - t0
        self._load_parts(t_start, t_ready, t0)

    def _open_checked(self, path: str | Path, version: str) -> Mapped | None:
        """``path`` as a mapped segment (None: not a segment) with names and shapes checked
        whole, values too unless its writer did (its lock goes if it does not fit)."""
        seg = self._segments.open(path, version)
        if seg is not None:
            try:
                self.model.check_weights(seg, True, not seg.checked)
            except BaseException:
                seg.close()
                raise
        return seg

    def _serve_segment(self, seg: Mapped) -> None:
        """``seg`` (checked) becomes the weights, under the step lock: adopted, or copied in
        (its lock then goes)."""
        try:
            if adoptable(self.model, seg, self.device):
                adopt(self.model, seg)
                self._segments.serve(seg)
            else:
                self._own_weights()
                self.model.load_weights(seg)
        finally:
            if self._segments.serving is not seg:
                seg.close()
        self._sleeping = False
        self._drop_spill()

    def _own_weights(self) -> None:
        """Memory of the engine's own for its weights, before a copy into them: a sleeping
        engine's (freed), or one serving from a segment's read-only pages."""
        if self._sleeping or self._segments.serving is not None:
            self.model.materialize(self.device)
            self._segments.serve(None)
            self._sleeping = False
            self._drop_spill()

    async def update_weights_from(self, named: Mapping[str, torch.Tensor], version: str) -> None:
        """A version handed over in memory (CUDA IPC: the trainer's device tensors mapped into
        this process), checked whole, then copied in between two steps (device to device).
        The engine then has no file to wake from: a level-2 sleep needs a load after it."""
        await asyncio.to_thread(self.model.check_weights, named)
        async with self._step_lock:
            t0 = self.clock.now()
            self._own_weights()
            self.model.load_weights(named)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the sender may free its tensors next
            self.prefix.clear()
            self._weights_source, self.weight_version = None, version
            self.last_pause_s = self.clock.now() - t0

    def _load_asleep(self, sd: Mapping[str, torch.Tensor]) -> None:
        """A sleeping engine's load (its wake into a version): the weights are materialised and
        each tensor read once, straight into them, then checked; a version with a NaN or an
        infinite value is freed again, so the engine stays asleep with nothing served."""
        self.model.materialize(self.device)
        try:
            self.model.load_weights(sd)  # names and shapes checked whole before any copy
        except BaseException:
            self.model.free_weights()
            raise
        bad = self.model.nonfinite_weight()
        if bad is not None:
            self.model.free_weights()
            raise TidalError(f"weight {bad}: holds NaN or infinite values")
        self._sleeping = False
        self._segments.serve(None)  # a level-1 sleep's views of a segment are not needed
        self._drop_spill()

    def _after_load(self, path: str | Path, version: str) -> None:
        self.prefix.clear()  # KV computed by the old weights
        self._weights_source = Path(path)
        self.weight_version = version
        log.info("engine %s loaded weights %s from %s", self.config.name, version, path)

    async def weight_hashes(self) -> dict[str, str]:
        """sha256 (16 hex digits) of each parameter's bytes as served, between two steps: what
        a carrier delivered, checked bit for bit against the trainer's tensors."""
        import hashlib

        def digest() -> dict[str, str]:
            return {
                n: hashlib.sha256(
                    p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
                ).hexdigest()[:16]
                for n, p in self.model.named_parameters()
            }

        async with self._step_lock:
            if self._sleeping:
                return {}
            return await asyncio.to_thread(digest)

    async def export_kv(self, request_id: str) -> bytes:
        async with self._step_lock:  # the cache may still be written by a running step
            return self.kv.export(request_id)

    async def import_kv(self, blob: bytes) -> tuple[str, int]:
        return await asyncio.to_thread(self.kv.import_, blob)

    def release_kv(self, key: str) -> bool:
        return self.kv.release(key)

    def stats(self) -> dict:
        return {
            "name": self.config.name,
            "running": len(self._running),
            "waiting": len(self._waiting),
            "capacity": self.config.max_batch,
            "paused": self._paused,
            "sleeping": self._sleeping,
            "weight_version": self.weight_version,
            "tokens_per_s": round(self.meter.rate(), 2),
            "kv_bytes": sum(r.cache.nbytes() for r in self._running if r.cache)
            + self.kv.nbytes()
            + self.prefix.nbytes(),
            "weights_bytes": self.model.weights_nbytes(),
            "pinned_kv": len(self.kv),
            "device_peak_mb": device_peak_mb(self.device),
            "prefix_cache": {
                "entries": len(self.prefix),
                "hits": self.prefix.hits,
                "misses": self.prefix.misses,
            },
            **self.totals,
        }

    # -- the loop --------------------------------------------------------------------------
    _paused_admission = False
    _stopped = False

    async def _loop(self) -> None:
        while not self._stopped:
            if self._paused or self._sleeping or not (self._running or self._waiting):
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), 1.0)
                except TimeoutError:
                    self.kv.expire()
                continue
            try:
                await self._step()
            except Exception:  # a failing step must not kill the loop silently
                self.totals["step_failures"] += 1
                log.exception(
                    "engine %s: step failed; ending its requests with 'error'", self.config.name
                )
                for r in list(self._running):
                    self._finish(r, "error")
            await asyncio.sleep(0)

    async def _step(self) -> None:
        self._running = [r for r in self._running if r.finish_reason is None]
        while (
            self._waiting
            and len(self._running) < self.config.max_batch
            and not self._paused_admission
        ):
            r = self._waiting.popleft()
            if r.finish_reason is None:
                r.start(self.model)
                self.totals["prefill_tokens"] += len(r.pending)
                self.totals["cached_tokens"] += r.cached_tokens
                self._running.append(r)
        batch = [r for r in self._running if r.finish_reason is None]
        if not batch:
            return
        async with self._step_lock:
            if self._sleeping or self._paused:
                return
            # prefills and one-token decodes run as separate ragged calls: no padding of
            # decodes up to prompt length
            prefill = [r for r in batch if len(r.pending) > 1]
            decode = [r for r in batch if len(r.pending) == 1]
            groups = [g for g in (prefill, decode) if g]
            work = [([list(r.pending) for r in g], [r.cache for r in g]) for g in groups]
            forward = self._forward_alone if self.config.deterministic else self._forward_groups
            if self.config.step_in_thread:
                outs = await asyncio.to_thread(forward, work)
            else:
                outs = forward(work)
            for group, logits in zip(groups, outs, strict=True):
                self._apply(group, logits, self.weight_version)

    def _forward_groups(self, work: list[tuple[list[list[int]], list]]) -> list[torch.Tensor]:
        """One forward per group of (pending tokens, caches), both taken on the loop."""
        return [self.model.forward_cached(pending, caches) for pending, caches in work]

    def _forward_alone(self, work: list[tuple[list[list[int]], list]]) -> list[torch.Tensor]:
        """``_forward_groups`` with every row computed alone, one token per forward: position
        ``j`` of a sequence is always ``forward([token_j], cache[:j])``, the same float ops
        whether it was a prompt token, a decode, a re-prefill after a move or what else the
        step held (deterministic engines; a prompt of n tokens costs n forwards)."""
        outs = []
        for pending, caches in work:
            rows = []
            for tokens, cache in zip(pending, caches, strict=True):
                for t in tokens:
                    last = self.model.forward_cached([[t]], [cache])
                rows.append(last)
            outs.append(torch.cat(rows))
        return outs

    def _apply(self, batch: list[Request], logits: torch.Tensor, version: str) -> None:
        if logits.device.type != "cpu":  # one copy per step; sampling stays on the CPU
            logits = logits.float().cpu()
        if self.config.deterministic:  # row by row: no kernel sees the batch's shape
            logp = torch.cat([torch.log_softmax(row[None].float(), dim=-1) for row in logits])
        else:
            logp = torch.log_softmax(logits.float(), dim=-1)
        tokens = sample_batch(batch, logits, logp, self._rng)
        safe = [0 if t is None else t for t in tokens]
        chosen = logp.gather(1, torch.tensor(safe)[:, None])[:, 0].tolist()
        for i, r in enumerate(batch):
            r.pending = []
            if r.finish_reason is not None:  # aborted while the step ran
                continue
            token = tokens[i]
            if token is None:  # its own sampling failed: it ends alone, the batch goes on
                self.totals["sampling_failures"] += 1
                self._finish(r, "error")
                continue
            r.tokens.append(token)
            r.logprobs.append(chosen[i])
            r.versions.append(version)
            r.pending = [token]
            self.totals["generated_tokens"] += 1
            reason = r.stop_reason(self.tokenizer.eos_id, self.model.max_seq_len)
            if reason != "stop" and r.stop_string_hit(self.tokenizer.decode):
                reason = "stop"
            if reason:
                self._finish(r, reason)
            else:
                r.changed.set()
        self.meter.add(len(batch))

    def _finish(self, r: Request, reason: str) -> None:
        r.finish_reason = reason
        r.finished.set()
        r.kv_tokens = r.cache.length if r.cache is not None else 0
        if reason in ("stop", "length") and r.cache is not None:
            self.prefix.put(r.prompt + r.tokens, r.cache)
        r.cache = None
        if r in self._running:
            self._running.remove(r)
        elif r in self._waiting:
            self._waiting.remove(r)
        r.changed.set()
