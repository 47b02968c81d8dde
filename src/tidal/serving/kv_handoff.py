"""One call attempt at one engine (``Attempt``) and its KV handoff steps (the proxy's side):
export the KV a drained attempt left pinned at its engine, import it at the next engine, release
an import that was not used.

In: an ``Attempt`` (its engine's adapter, request id, KV token count). Out: the KV blob, or a
handle at the destination; every failure degrades to a full prefill (``None``), never to a
failed call, and is marked on the attempt (``kv_result``: "lost", counted by the proxy as
``kv_handoff_failures``; "mixed" for a move between engine kinds whose KV layouts differ, the
built-in engine and vLLM: a re-prefill by design, counted as ``kv_mixed_moves``). For vLLM the
blob is a reference to an export pinned in the node's shared memory (``serving.vllm_kv``).
Time spent here is the engines' (``attempt.upstream_s``), not the proxy's own.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

from tidal.serving.protocol import BadRequest, ServingError
from tidal.serving.router import Member
from tidal.serving.vllm_kv import MAGIC as VLLM_MAGIC
from tidal.serving.vllm_kv import VLLMKVHandoff

log = logging.getLogger("tidal.serving.proxy")


@dataclass
class Attempt:
    execution_id: str | None
    request_id: str
    member: Member
    cancelled: bool = False
    sent: bool = False  # the generate request may have reached the engine
    started: bool = False  # a chunk came back: the engine admitted it
    ended: bool = False  # the engine's stream ended; a KV export may still run
    finished: bool = False  # the engine finished the call (stop/length): a drain did not move it
    kv_tokens: int | None = None
    upstream_s: float = 0.0
    abort_sent: bool = False
    keep_kv: bool = False
    context_tokens: int = 0  # prompt + tokens so far at this engine: a move re-prefills them
    streamed_tokens: int = 0  # tokens this attempt got back from its engine so far
    kv_result: str | None = None  # "lost" / "mixed": a handoff that did not land (module doc)


async def export_kv(attempt: Attempt) -> bytes | None:
    """The KV a drained attempt left pinned at its engine, which then releases it."""
    src = attempt.member
    # an adapter whose engine reports every marked abort (vLLM's connector: 0 tokens for one it
    # never scheduled) is asked even before its first chunk; others only once it answered
    asks_unstarted = attempt.sent and getattr(src.adapter, "kv_exports_unstarted", False)
    if (
        not src.adapter.supports_kv_handoff
        or attempt.kv_tokens == 0
        or (not attempt.started and attempt.kv_tokens is None and not asks_unstarted)
    ):  # the engine never had it
        return None
    t_up = time.perf_counter()
    try:
        blob = await src.adapter.export_kv(attempt.request_id)
        if not blob:  # it computed nothing there: the call keeps what it carried in
            return None
        with contextlib.suppress(ServingError):
            await src.adapter.release_kv(attempt.request_id)
    except ServingError as exc:
        log.warning("KV export from %s failed (%s): the next engine prefills", src.engine_id, exc)
        attempt.kv_result = "lost"
        return None
    finally:
        attempt.upstream_s += time.perf_counter() - t_up
    return blob


async def import_kv(blob: bytes, attempt: Attempt) -> tuple[str | None, bytes | None]:
    """(handle at the attempt's engine or None, the blob if still worth holding). A dead
    destination raises (the call retries elsewhere with the blob); a refusal drops it."""
    dest = attempt.member
    if not dest.adapter.supports_kv_handoff:
        return None, blob
    if blob.startswith(VLLM_MAGIC) != isinstance(dest.adapter, VLLMKVHandoff):
        log.info("KV of another engine kind's layout cannot go to %s: it prefills", dest.engine_id)
        attempt.kv_result = "mixed"
        return None, None
    t_up = time.perf_counter()
    try:
        handle, _ = await dest.adapter.import_kv(blob)
    except BadRequest as exc:
        log.warning("KV import at %s refused (%s): full prefill", dest.engine_id, exc)
        attempt.kv_result = "lost"
        return None, None
    finally:
        attempt.upstream_s += time.perf_counter() - t_up
    return handle, blob


async def release_import(attempt: Attempt, handle: str | None) -> None:
    """Give back an import the attempt will not use (its destination began draining)."""
    if handle is not None:
        t_up = time.perf_counter()
        with contextlib.suppress(ServingError):
            await attempt.member.adapter.release_kv(handle)
        attempt.upstream_s += time.perf_counter() - t_up
    log.debug(
        "call attempt %s re-routed before it was sent to %s (draining)",
        attempt.request_id,
        attempt.member.engine_id,
    )
