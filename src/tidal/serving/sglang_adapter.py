"""Adapter for an SGLang server, written against SGLang 0.5.23's documented HTTP API
(ENGINES.md §1.2). SGLang needs CUDA, so it has never run against a real SGLang server here.

In: ``GenerateRequest`` / control calls. Out: ``TokenChunk`` streams from the native
``/generate`` route (``input_ids``, ``rid``, ``return_logprob``; ``meta_info.output_token_logprobs``
is cumulative while streaming). Mode mapping: vLLM ``keep`` = SGLang ``in_place``; ``wait`` has no
SGLang twin, so it polls the running count after the router stopped admission; sleep = release
memory occupation (weights + KV), wake = resume it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from tidal.errors import TimeoutExpired
from tidal.serving.adapters import EngineStats, HTTPEngineBase, NoKVHandoff
from tidal.serving.protocol import BadRequest, GenerateRequest, TokenChunk

_MODES = {"abort": "abort", "keep": "in_place"}


class SGLangAdapter(NoKVHandoff, HTTPEngineBase):
    supports_kv_handoff = False
    backend_name = "SGLang"

    def __init__(self, url: str, capacity: int = 32, wait_timeout_s: float = 60.0, **kw) -> None:
        super().__init__(url, **kw)
        self.capacity, self.wait_timeout_s = capacity, wait_timeout_s
        self._version = "v0"

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenChunk]:
        p = req.params
        sampling = {
            "max_new_tokens": p.max_tokens,
            "temperature": p.temperature,
            "ignore_eos": p.ignore_eos,
        }
        if p.top_k:
            sampling["top_k"] = p.top_k
        if p.stop_token_ids:
            sampling["stop_token_ids"] = p.stop_token_ids
        if p.top_p < 1.0:
            sampling["top_p"] = p.top_p
        if p.seed is not None:  # SGLang's per-request seed (needs its deterministic sampler)
            sampling["sampling_seed"] = p.seed
        if p.stop:
            sampling["stop"] = p.stop
        body = {
            "input_ids": req.prompt_token_ids,
            "sampling_params": sampling,
            "return_logprob": True,
            "logprob_start_len": -1,
            "rid": req.request_id,
            "stream": True,
        }
        seen = 0
        text_seen = 0
        first = True
        async for event in self._sse("/generate", body):
            meta = event.get("meta_info") or {}
            pairs = meta.get("output_token_logprobs") or []
            new = pairs[seen:]
            seen = len(pairs)
            text = event.get("text") or ""
            version = meta.get("weight_version") or self._version
            finish = meta.get("finish_reason")
            reason = finish.get("type") if isinstance(finish, dict) else finish
            chunk = TokenChunk(
                [int(x[1]) for x in new],
                [float(x[0]) for x in new],
                [str(version)] * len(new),
                text=text[text_seen:],
                finish_reason=reason,
            )
            text_seen = len(text)
            if first:
                chunk.prompt_token_ids = req.prompt_token_ids
                chunk.cached_tokens = int(meta.get("cached_tokens") or 0)
                first = False
            yield chunk

    async def pause(self, mode: str) -> None:
        if mode == "wait":
            await self._wait_idle()
            mode = "abort"  # nothing is left to abort; freezes admission like vLLM's wait
        if mode not in _MODES:
            raise BadRequest(f"pause mode must be abort, wait or keep, not {mode!r}")
        await self._call("POST", "/pause_generation", json={"mode": _MODES[mode]})

    async def _wait_idle(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_timeout_s
        while (await self.stats()).running > 0:
            if loop.time() > deadline:
                raise TimeoutExpired(
                    f"{self.url}: requests still running after {self.wait_timeout_s} s"
                )
            await asyncio.sleep(0.05)

    async def resume(self) -> None:
        await self._call("POST", "/continue_generation", json={})

    async def abort(self, request_ids: list[str] | None, keep_kv: bool = False) -> int:
        if request_ids is None:
            await self._call("POST", "/abort_request", json={"rid": "", "abort_all": True})
            return -1  # SGLang does not report a count
        for rid in request_ids:
            await self._call("POST", "/abort_request", json={"rid": rid, "abort_all": False})
        return len(request_ids)

    async def sleep(self, level: int) -> None:
        await self.pause("abort")
        await self._call("POST", "/release_memory_occupation", json={})

    async def wake_up(self) -> None:
        await self._call("POST", "/resume_memory_occupation", json={})
        await self.resume()

    async def load_weights(self, path: str, version: str) -> None:
        await self._call(
            "POST",
            "/update_weights_from_disk",
            json={
                "model_path": path,
                "weight_version": version,
                "abort_all_requests": False,
                "flush_cache": True,
            },
        )
        self._version = version

    async def weight_version(self) -> str:
        return self._version

    async def stats(self) -> EngineStats:
        metrics = await self._prometheus("sglang:")
        return EngineStats(
            int(metrics.get("sglang:num_running_reqs", 0)),
            int(metrics.get("sglang:num_queue_reqs", 0)),
            self.capacity,
            float(metrics.get("sglang:gen_throughput", 0.0)),
            self._version,
        )
