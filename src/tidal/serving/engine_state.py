"""Per-request state of the built-in engine, its store of pinned / imported KV caches, and a
token-rate meter.

In: requests admitted by ``Engine``; KV caches pinned at abort time or imported from another
engine (safetensors bytes whose metadata names the covered token ids). Out: caches adopted by new
requests whose prompt starts with the covered tokens. Pinned and imported entries expire after a
lease so nothing is held forever.
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
import uuid
from collections import deque

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from tidal.clock import Clock
from tidal.models import CausalLM, KVCache
from tidal.seeding import token_seed
from tidal.serving.protocol import BadRequest, NotFound, SamplingParams

log = logging.getLogger(__name__)


class Request:
    def __init__(
        self, request_id: str, prompt: list[int], params: SamplingParams, created_s: float
    ) -> None:
        self.id, self.prompt, self.params, self.created_s = request_id, prompt, params, created_s
        self.tokens: list[int] = []
        self.output_tail: list[int] = []  # a rerouted call's earlier output, as text context
        self.logprobs: list[float] = []
        self.versions: list[str] = []
        self.cache: KVCache | None = None
        self.pending: list[int] = []
        self.cached_tokens = 0
        self.kv_tokens = 0
        self.finish_reason: str | None = None
        self.changed = asyncio.Event()
        self.finished = asyncio.Event()
        self.rng: torch.Generator | None = None

    def start(self, model: CausalLM) -> None:
        """Decide what to feed first: the prompt minus what an imported cache already covers
        (at least one token, so the step yields logits for the next one)."""
        if self.cache is None:
            self.cache = model.new_cache()
        self.cache.length = min(self.cache.length, len(self.prompt) - 1)
        self.cached_tokens = self.cache.length
        self.pending = self.prompt[self.cache.length :]

    def sample(self, logits: torch.Tensor, default_rng: torch.Generator) -> int:
        """One token from this request's distribution (temperature, top-k, top-p); raises
        ``SamplingFailed`` if it has no valid distribution (NaN or infinite logits)."""
        p = self.params
        if p.temperature == 0.0:
            return int(torch.argmax(logits))
        scaled = logits.float() / p.temperature
        if p.top_k:
            kth = torch.topk(scaled, min(p.top_k, scaled.numel())).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if p.top_p < 1.0:
            probs = nucleus(probs, p.top_p)
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
            raise SamplingFailed(f"request {self.id}: no valid distribution to sample from")
        rng = default_rng
        if self.rng is not None and p.seed is not None:
            # keyed by position, not by draws so far: a call continued elsewhere after n tokens
            # (seed + n, see tidal.seeding) draws exactly what it would have drawn here
            rng = self.rng.manual_seed(token_seed(p.seed, len(self.tokens)))
        return int(torch.multinomial(probs, 1, generator=rng))

    def stop_string_hit(self, decode) -> bool:
        """Whether the last token completed one of the stop strings (``decode``: ids -> text).
        Only the tail is decoded: a stop string of c characters lies within its last 4c + 4
        tokens (a character is at most 4 byte-level tokens)."""
        stops = self.params.stop
        if not stops:
            return False
        window = 4 * max(len(s) for s in stops) + 4
        return any(s in decode(self.tokens[-window:]) for s in stops)

    def stop_reason(self, eos_id: int, max_seq_len: int) -> str | None:
        last = self.tokens[-1]
        if not self.params.ignore_eos and (last == eos_id or last in self.params.stop_token_ids):
            return "stop"
        if len(self.tokens) >= self.params.max_tokens:
            return "length"
        if len(self.prompt) + len(self.tokens) >= max_seq_len:
            return "length"
        return None


class SamplingFailed(Exception):
    """One request's logits gave no distribution; that request ends with ``error`` alone."""


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` restricted to the smallest set of most likely tokens whose mass reaches
    ``top_p`` (the most likely token always stays), renormalised."""
    sorted_p, order = torch.sort(probs, descending=True)
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of the tokens ranked above
    sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return kept / kept.sum()


def sample_batch(
    batch: list[Request], logits: torch.Tensor, logp: torch.Tensor, rng: torch.Generator
) -> list[int | None]:
    """One token per request (None: that request's sampling failed; the others are kept):
    greedy rows by argmax; plain temperature-1 rows (no top-k, top-p or seed) in one batched
    draw, one by one if a row of it is invalid; the rest one by one."""
    greedy = logits.argmax(dim=-1).tolist()
    plain = [
        i
        for i, r in enumerate(batch)
        if r.params.temperature == 1.0
        and not r.params.top_k
        and r.params.top_p == 1.0
        and r.rng is None
    ]
    out: list[int | None] = list(greedy)
    single = [i for i, r in enumerate(batch) if r.params.temperature != 0.0 and i not in plain]
    if plain:
        probs = logp[plain].exp()
        if bool(torch.isfinite(probs).all()):
            draws = torch.multinomial(probs, 1, generator=rng)[:, 0].tolist()
            for i, t in zip(plain, draws, strict=True):
                out[i] = t
        else:
            single = sorted(single + plain)
    for i in single:
        try:
            out[i] = batch[i].sample(logits[i], rng)
        except (SamplingFailed, RuntimeError) as exc:
            log.warning("sampling failed for request %s alone: %s", batch[i].id, exc)
            out[i] = None
    return out


class KVStore:
    """Pinned caches (keyed by request id) and imported ones (keyed by handle), each with the
    token ids it covers and a lease deadline."""

    def __init__(self, model: CausalLM, clock: Clock, lease_s: float) -> None:
        self.model, self.clock, self.lease_s = model, clock, lease_s
        self._entries: dict[str, tuple[list[int], KVCache, float]] = {}

    def fingerprint(self) -> str:
        m = self.model
        return f"{m.model_type}:{m.n_layers}:{m.n_kv_heads}:{m.head_dim}:{m.vocab_size}"

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def nbytes(self) -> int:
        return sum(c.nbytes() for _, c, _ in self._entries.values())

    def pin(self, request_id: str, all_tokens: list[int], cache: KVCache) -> None:
        self._entries[request_id] = (
            all_tokens[: cache.length],
            cache,
            self.clock.now() + self.lease_s,
        )

    def release(self, key: str) -> bool:
        return self._entries.pop(key, None) is not None

    def clear(self) -> None:
        self._entries.clear()

    def expire(self) -> None:
        now = self.clock.now()
        for key in [k for k, (_, _, t) in self._entries.items() if t < now]:
            log.info("KV lease of %s expired", key)
            del self._entries[key]

    def export(self, request_id: str) -> bytes:
        if request_id not in self._entries:
            raise NotFound(f"no pinned KV cache for request {request_id!r}")
        tokens, cache, _ = self._entries[request_id]
        meta = {"tokens": json.dumps(tokens), "fingerprint": self.fingerprint()}
        # the positions the pinned tokens cover: a step that ran while the request was
        # aborted may have appended one more to the same cache after the pin
        return st_save(cache.export_tensors(len(tokens)), metadata=meta)

    def import_(self, blob: bytes) -> tuple[str, int]:
        """Hold an exported cache under a new handle; a body that is not one of this model's
        (``BadRequest`` naming ``body``) leaves the store as it was."""
        tokens, tensors = self._parse(blob)
        cache = self.model.cache_from_tensors(tensors)
        handle = f"kv-{uuid.uuid4().hex[:16]}"
        self._entries[handle] = (tokens, cache, self.clock.now() + self.lease_s)
        return handle, len(tokens)

    def adopt(self, handle: str, prompt: list[int]) -> tuple[KVCache | None, int]:
        """Take an imported cache for ``prompt``; it covers the common prefix. An unknown or
        expired handle falls back to a full prefill (``None``), never to an error."""
        entry = self._entries.pop(handle, None)
        if entry is None:
            log.warning("KV handle %s unknown or expired: full prefill", handle)
            return None, 0
        tokens, cache, _ = entry
        common = 0
        for a, b in zip(tokens, prompt, strict=False):
            if a != b:
                break
            common += 1
        cache.length = min(cache.length, common)
        return cache, cache.length

    def _parse(self, blob: bytes) -> tuple[list[int], dict[str, torch.Tensor]]:
        """(covered token ids, tensors) of a KV blob that fits this model: its fingerprint,
        ``k.i``/``v.i`` for every layer, each [tokens, kv heads, head dim] and finite."""
        meta = _metadata(blob)
        if meta.get("fingerprint") != self.fingerprint():
            raise BadRequest(
                f"body: KV cache of model {meta.get('fingerprint')!r} does not "
                f"fit {self.fingerprint()!r}"
            )
        try:
            tokens = json.loads(meta["tokens"])
        except (KeyError, TypeError, ValueError):
            raise BadRequest("body: KV metadata 'tokens' is not a JSON list") from None
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise BadRequest("body: KV metadata 'tokens' is not a list of token ids")
        try:
            tensors = st_load(blob)
        except Exception as exc:  # safetensors' own error type: a body that does not parse
            raise BadRequest(f"body: not a safetensors KV blob ({str(exc)[:200]})") from None
        m = self.model
        want = {f"{kv}.{i}" for kv in "kv" for i in range(m.n_layers)}
        if set(tensors) != want:
            raise BadRequest(
                f"body: KV tensors {sorted(tensors)[:4]} are not k.i/v.i for {m.n_layers} layers"
            )
        shape = (len(tokens), m.n_kv_heads, m.head_dim)
        for name, t in tensors.items():
            if tuple(t.shape) != shape or not t.is_floating_point():
                raise BadRequest(
                    f"body: KV tensor {name} of shape {tuple(t.shape)} "
                    f"{t.dtype}, not {shape} floats"
                )
            if not bool(torch.isfinite(t).all()):
                raise BadRequest(f"body: KV tensor {name} holds NaN or infinite values")
        return tokens, tensors


def _metadata(blob: bytes) -> dict[str, str]:
    """The safetensors header's ``__metadata__`` (``BadRequest`` naming the body if none)."""
    try:
        (n,) = struct.unpack("<Q", blob[:8])
        if n > len(blob) - 8:
            raise ValueError(f"header of {n} bytes in a body of {len(blob)}")
        header = json.loads(blob[8 : 8 + n])
    except (struct.error, ValueError) as exc:
        raise BadRequest(f"body: not a safetensors KV blob ({exc})") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        raise BadRequest("body: not a safetensors KV blob (no __metadata__ object)")
    return meta


class RateMeter:
    """Tokens per second over a sliding window."""

    def __init__(self, clock: Clock, window_s: float = 5.0) -> None:
        self.clock, self.window_s = clock, window_s
        self._events: deque[tuple[float, int]] = deque()

    def add(self, n: int) -> None:
        now = self.clock.now()
        self._events.append((now, n))
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()

    def rate(self) -> float:
        now = self.clock.now()
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()
        if not self._events:
            return 0.0
        span = max(now - self._events[0][0], 1e-3)
        return sum(n for _, n in self._events) / span
