"""One protocol for every engine the router drives, and its built-in-engine implementation.

In: ``GenerateRequest`` and control calls. Out: ``TokenChunk`` streams and control results, over
HTTP. Foreign failures (connection refused, reset, timeouts) become ``EngineUnavailable``, a 5xx
answer its subclass ``EngineError`` (alive; the proxy retries it only a few times);
a 4xx from the engine becomes ``BadRequest`` so the proxy can tell "retry elsewhere" from "the
caller's fault". vLLM and SGLang implementations live in ``vllm_adapter`` / ``sglang_adapter``.
"""

from __future__ import annotations

import json as _json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol, cast, runtime_checkable

from tidal.backends import backend_names, engine_backend, load
from tidal.serving.http11 import HTTPFailure, HTTPPool, Response
from tidal.serving.protocol import (
    BadRequest,
    EngineError,
    EngineUnavailable,
    GenerateRequest,
    NotFound,
    Overloaded,
    ServingError,
    TokenChunk,
)


@dataclass
class EngineStats:
    running: int
    waiting: int
    capacity: int
    tokens_per_s: float
    weight_version: str | None = None


@runtime_checkable
class EngineAdapter(Protocol):
    url: str
    supports_kv_handoff: bool

    def generate(self, req: GenerateRequest) -> AsyncIterator[TokenChunk]: ...
    async def tokenize(
        self,
        prompt: str | None = None,
        messages: list[dict] | None = None,
        tools: list[dict] | None = None,
        add_special_tokens: bool | None = None,
    ) -> list[int]: ...
    async def detokenize(self, token_ids: list[int]) -> str: ...
    async def pause(self, mode: str) -> None: ...
    async def resume(self) -> None: ...
    async def abort(self, request_ids: list[str] | None, keep_kv: bool = False) -> int: ...
    async def sleep(self, level: int) -> None: ...
    async def wake_up(self) -> None: ...
    async def load_weights(self, path: str, version: str) -> None: ...
    async def weight_version(self) -> str: ...
    async def export_kv(self, request_id: str) -> bytes: ...
    async def import_kv(self, blob: bytes) -> tuple[str, int]: ...
    async def release_kv(self, key: str) -> None: ...
    async def stats(self) -> EngineStats: ...
    async def served_model(self) -> str: ...
    async def health(self, timeout_s: float = 5.0) -> bool: ...
    async def close(self) -> None: ...


class HTTPEngineBase:
    """Shared HTTP plumbing: one keep-alive connection pool, error translation, SSE parsing."""

    supports_kv_handoff = False

    # A dead engine on loopback refuses at once; a connect or probe timeout mostly means this
    # process is saturated (a thousand calls opening connections together), which must not
    # get a live engine declared down: the bounds are generous.
    def __init__(
        self,
        url: str,
        control_timeout_s: float = 30.0,
        connect_timeout_s: float = 10.0,
        api_key: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._pool = HTTPPool(
            self.url, headers, connect_timeout_s=connect_timeout_s, timeout_s=control_timeout_s
        )
        # generation streams can run for minutes; reads between chunks are bounded instead
        self.stream_read_timeout_s = 300.0

    async def close(self) -> None:
        await self._pool.close()

    async def _prometheus(self, prefix: str) -> dict[str, float]:
        """``GET /metrics`` as {name: value summed over labels} for names under ``prefix``."""
        text = (await self._call("GET", "/metrics")).text
        pattern = re.compile(
            rf"^({re.escape(prefix)}[a-z_]+)(?:\{{[^}}]*\}})?\s+([0-9.eE+-]+)$", re.M
        )
        metrics: dict[str, float] = {}
        for name, value in pattern.findall(text):
            metrics[name] = metrics.get(name, 0.0) + float(value)
        return metrics

    async def _call(
        self,
        method: str,
        path: str,
        *,
        params: dict | None = None,
        json=None,
        content: bytes | None = None,
        timeout_s: float | None = None,
    ) -> Response:
        try:
            resp = await self._pool.request(
                method, path, body=content, json_body=json, params=params, timeout_s=timeout_s
            )
        except HTTPFailure as exc:
            raise EngineUnavailable(f"{self.url}{path}: {exc}") from exc
        raise_for(resp, path)
        return resp

    async def _sse(self, path: str, body: dict, headers: dict | None = None) -> AsyncIterator[dict]:
        try:
            async with self._pool.stream(
                "POST",
                path,
                json_body=body,
                headers=headers,
                read_timeout_s=self.stream_read_timeout_s,
            ) as resp:
                if resp.status_code >= 400:
                    raise_for(Response(resp.status_code, resp.headers, await resp.read()), path)
                async for line in resp.lines():
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        await resp.read()  # the body's end: the connection goes back idle
                        return
                    yield _json.loads(data)
        except HTTPFailure as exc:
            raise EngineUnavailable(f"{self.url}{path}: {exc}") from exc

    async def tokenize(
        self,
        prompt: str | None = None,
        messages: list[dict] | None = None,
        tools: list[dict] | None = None,
        add_special_tokens: bool | None = None,
    ) -> list[int]:
        """Prompt ids via the engine's ``/tokenize`` (same shape on vLLM and the built-in):
        messages (with ``tools``, rendered by the model's chat template) or a text prompt."""
        body: dict = (
            {"messages": messages, "add_generation_prompt": True}
            if messages
            else {"prompt": prompt}
        )
        if tools:
            body["tools"] = tools
        if add_special_tokens is not None:
            body["add_special_tokens"] = add_special_tokens
        model = getattr(self, "model", None)
        if model:
            body["model"] = model
        return list((await self._call("POST", "/tokenize", json=body)).json()["tokens"])

    async def detokenize(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``, special tokens included (vLLM's ``/detokenize``)."""
        body: dict = {"tokens": token_ids}
        model = getattr(self, "model", None)
        if model:
            body["model"] = model
        return str((await self._call("POST", "/detokenize", json=body)).json()["prompt"])

    async def served_model(self) -> str:
        return (await self.served_model_card())[0]

    async def served_model_card(self) -> tuple[str, int | None]:
        """The served model's name and context length (vLLM's ``max_model_len``; None where
        the engine does not say)."""
        card = (await self._call("GET", "/v1/models")).json()["data"][0]
        max_len = card.get("max_model_len")
        return str(card["id"]), int(max_len) if isinstance(max_len, int) else None

    async def health(self, timeout_s: float = 5.0) -> bool:
        try:
            resp = await self._pool.request("GET", "/health", timeout_s=timeout_s)
        except HTTPFailure:
            # also on a pool closed by a concurrent leave: a probe must answer "unhealthy",
            # never raise into a harness's request
            return False
        return resp.status_code == 200


def raise_for(resp: Response, path: str) -> None:
    if resp.status_code < 400:
        return
    try:
        msg = resp.json().get("error", {}).get("message") or resp.text
    except (ValueError, AttributeError):
        msg = resp.text
    detail = str(msg)[:480]
    if resp.status_code == 404:
        cls: type[ServingError] = NotFound
    elif resp.status_code == 503:
        cls = Overloaded
    elif resp.status_code < 500:
        cls = BadRequest
    else:
        cls = EngineError  # it answered: alive, but failing this call
    err = cls(f"{path}: {detail}")
    err.detail = detail  # what the engine said, without its route (the proxy names its own)
    raise err


class NoKVHandoff:
    """For servers whose HTTP API cannot move one request's KV cache (vLLM, SGLang)."""

    backend_name = "this engine"

    async def export_kv(self, request_id: str) -> bytes:
        raise BadRequest(f"{self.backend_name} adapter: KV export is not supported")

    async def import_kv(self, blob: bytes) -> tuple[str, int]:
        raise BadRequest(f"{self.backend_name} adapter: KV import is not supported")

    async def release_kv(self, key: str) -> None:
        return None


class BuiltinAdapter(HTTPEngineBase):
    """The built-in engine (``tidal engine``): every control and KV handoff."""

    supports_kv_handoff = True
    stream_interval_ms = 20.0  # a streaming caller needs tokens so far, not every token

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenChunk]:
        p = req.params
        body = {
            "prompt": req.prompt_token_ids,
            "stream": req.stream,
            "request_id": req.request_id,
            "kv_handle": req.kv_handle,
            "output_context": req.output_context,
            "stream_interval_ms": self.stream_interval_ms,
            "logprobs": 0,
            "max_tokens": p.max_tokens,
            "temperature": p.temperature,
            "top_k": p.top_k,
            "top_p": p.top_p,
            "seed": p.seed,
            "ignore_eos": p.ignore_eos,
            "stop_token_ids": p.stop_token_ids,
            "stop": p.stop,
        }
        if req.stream:
            async for event in self._sse("/v1/completions", body):
                yield TokenChunk.from_json(event["tidal"])
            return
        # one piece: the engine's answer to a plain completion (an abort of an id it does not
        # know yet is remembered there, so a drain needs no first chunk to cancel it)
        data = (
            await self._call(
                "POST", "/v1/completions", json=body, timeout_s=self.stream_read_timeout_s
            )
        ).json()
        choice = data["choices"][0]
        versions: list[str] = []
        for start, end, version in choice["weight_versions"]:
            versions += [version] * (end - start)
        yield TokenChunk(
            choice["token_ids"],
            choice["logprobs"]["token_logprobs"],
            versions,
            choice["text"],
            choice["finish_reason"],
            choice["prompt_token_ids"],
            data["usage"]["prompt_tokens_details"]["cached_tokens"],
            choice.get("kv_tokens"),
        )

    async def pause(self, mode: str) -> None:
        await self._call("POST", "/pause", params={"mode": mode})

    async def resume(self) -> None:
        await self._call("POST", "/resume")

    async def abort(self, request_ids: list[str] | None, keep_kv: bool = False) -> int:
        resp = await self._call(
            "POST", "/abort_requests", json={"request_ids": request_ids, "keep_kv": keep_kv}
        )
        return int(resp.json()["aborted"])

    async def sleep(self, level: int) -> None:
        await self._call("POST", "/sleep", params={"level": level})

    async def wake_up(self) -> None:
        await self._call("POST", "/wake_up")

    async def load_weights(self, path: str, version: str) -> None:
        await self._call("POST", "/update_weights", json={"path": path, "weight_version": version})

    async def weight_version(self) -> str:
        return (await self._call("GET", "/weight_info")).json()["weight_version"]

    async def export_kv(self, request_id: str) -> bytes:
        return (await self._call("GET", f"/tidal/kv/{request_id}")).content

    async def import_kv(self, blob: bytes) -> tuple[str, int]:
        data = (await self._call("POST", "/tidal/kv", content=blob)).json()
        return data["handle"], int(data["tokens"])

    async def release_kv(self, key: str) -> None:
        await self._call("DELETE", f"/tidal/kv/{key}")

    async def stats(self) -> EngineStats:
        s = (await self._call("GET", "/stats")).json()
        return EngineStats(
            s["running"], s["waiting"], s["capacity"], s["tokens_per_s"], s["weight_version"]
        )


def make_adapter(backend: str, url: str, **kw) -> EngineAdapter:
    """The adapter of ``backend``'s registry entry (``tidal.backends``) for the engine at
    ``url``; an unknown backend is the caller's error."""
    if backend not in backend_names():
        raise BadRequest(f"unknown engine backend {backend!r} ({', '.join(backend_names())})")
    return cast(EngineAdapter, load(engine_backend(backend).adapter)(url, **kw))
