"""vLLM's token-in route, ``POST /inference/v1/generate``, as the proxy speaks it (verifiers and
prime-rl train through it).

In: ``{model, token_ids, sampling_params}`` (vLLM's ``SamplingParams`` field names; a field tidal
does not implement is a 400 naming it, a neutral value is accepted). Out: vLLM's answer shape:
``request_id``, ``prompt_token_ids``, ``choices[0].token_ids``, ``choices[0].logprobs.content``
(``{"token": "token_id:N", "logprob"}`` per sampled token), ``finish_reason``, plus tidal's
``weight_versions`` spans and ``usage`` (with ``cached_tokens``).
"""

from __future__ import annotations

import json
import math
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tidal.contracts.calls import version_spans
from tidal.serving.openai_api import (
    INT64,
    MAX_PROMPT_IDS,
    Result,
    _only,
    _usage,
    check_stops,
)
from tidal.serving.protocol import (
    SamplingParams,
    check_temperature,
)

# strict: a token id is a JSON integer; "4", 4.0 and true are refused, never coerced
TokenId = Annotated[int, Field(strict=True, ge=0, le=2**31 - 1)]
DEFAULT_MAX_TOKENS = 16  # vLLM's default for a request that names none


class TokenSampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_tokens: int | None = Field(None, ge=1, le=1_000_000)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    seed: int | None = Field(None, **INT64)
    stop: list[str] | str | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=64)
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=1, description="one sequence per request on this route")
    logprobs: int | None = Field(
        None,
        ge=0,
        le=1,
        description="the sampled token's log-prob is always returned; no alternatives beyond it",
    )
    min_tokens: int = Field(0, ge=0, le=0)
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # decoding of text: this route returns token ids only, so these change nothing
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    include_stop_str_in_output: bool = False
    # where a MoE's routed-expert ids start in the answer (verifiers sends it with a bridged
    # multi-turn prompt); this route returns no routed experts, so it changes nothing
    routed_experts_prompt_start: int | None = Field(None, ge=0, le=MAX_PROMPT_IDS)

    @field_validator("temperature")
    @classmethod
    def _computable(cls, v):
        return check_temperature(v)

    @field_validator("repetition_penalty")
    @classmethod
    def _no_repetition(cls, v):
        return _only(v, 1.0, "only 1 (no penalty)")

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v):
        return _only(v, 0.0, "only 0 (no penalty)")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        return check_stops(v)


class TokenInRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    token_ids: list[TokenId] = Field(..., min_length=1, max_length=MAX_PROMPT_IDS)
    sampling_params: TokenSampling = Field(default_factory=TokenSampling)
    request_id: str | None = Field(None, max_length=256)
    # a salt isolating prefix-cache sharing; tidal's engines share no cache between calls
    cache_salt: str | None = Field(None, max_length=256)
    priority: int = Field(0, ge=0, le=0, description="no priority scheduling")
    stream: bool = Field(False, description="false only: the answer comes in one piece")
    user: str | None = Field(None, max_length=256)

    def sampling(self) -> SamplingParams:
        sp = self.sampling_params
        stops = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
        return SamplingParams(
            max_tokens=sp.max_tokens or DEFAULT_MAX_TOKENS,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=max(0, sp.top_k),
            seed=sp.seed,
            ignore_eos=sp.ignore_eos,
            stop_token_ids=list(sp.stop_token_ids or []),
            stop=stops,
        )

    @field_validator("stream")
    @classmethod
    def _one_piece(cls, v):
        return _only(v, False, "this route answers in one piece")


def _logprob_json(lp: float) -> str:
    # a finite float: its repr is what ``json.dumps`` writes; NaN / infinities as it writes them
    return repr(lp) if math.isfinite(lp) else json.dumps(lp)


def token_in_json(rid: str, model: str, res: Result) -> bytes:
    """``token_in_response`` serialised, the same JSON (keys in another order): the per-token
    log-prob entries written as text, not built as dicts and encoded (2.2x faster for 2,000
    tokens; the token-in answer was half of the proxy's CPU in the 256-GPU stress,
    docs/scale.md)."""
    content = ",".join(
        [
            f'{{"token":"token_id:{int(t)}","logprob":{_logprob_json(lp)}}}'
            for t, lp in zip(res.token_ids, res.logprobs, strict=True)
        ]
    )
    choice = {
        "index": 0,
        "token_ids": res.token_ids,
        "finish_reason": res.finish_reason,
        "weight_versions": version_spans(res.versions),
    }
    body = {
        "request_id": rid,
        "model": model,
        "prompt_token_ids": res.prompt_token_ids,
        "usage": _usage([res]),
    }
    choice_json = f'{_dumps(choice)[:-1]},"logprobs":{{"content":[{content}]}}}}'
    return f'{_dumps(body)[:-1]},"choices":[{choice_json}]}}'.encode()


def _dumps(obj: dict) -> str:
    return json.dumps(obj, separators=(",", ":"))


def token_in_response(rid: str, model: str, res: Result) -> dict:
    content = [
        {"token": f"token_id:{t}", "logprob": lp}
        for t, lp in zip(res.token_ids, res.logprobs, strict=True)
    ]
    return {
        "request_id": rid,
        "model": model,
        "prompt_token_ids": res.prompt_token_ids,
        "choices": [
            {
                "index": 0,
                "token_ids": res.token_ids,
                "logprobs": {"content": content},
                "finish_reason": res.finish_reason,
                "weight_versions": version_spans(res.versions),
            }
        ],
        "usage": _usage([res]),
    }
