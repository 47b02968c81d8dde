"""Types that cross the serving plane: sampling parameters, generation requests and the token
chunks every engine (built-in, vLLM, SGLang) streams back, plus the serving error tree.

Invariant: every generated token travels with its log-prob and the weight version that produced it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from tidal.errors import TidalError

FINISH_REASONS = ("stop", "length", "abort", "error")  # error: the engine's step failed


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(16, ge=1, le=1_000_000)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)


@dataclass
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kv_handle: str | None = None
    # False: the caller needs no chunk before the last (which carries every token, also on an
    # abort); an engine may then answer in one piece
    stream: bool = True


@dataclass
class TokenChunk:
    """New tokens since the previous chunk. The first chunk of a request also carries the prompt
    ids and how many prompt tokens came from an imported KV cache; the last one a finish reason."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None
    cached_tokens: int | None = None
    kv_tokens: int | None = None  # on an abort: tokens the engine held KV for (0: none)

    def to_json(self) -> dict:
        out: dict = {"token_ids": self.token_ids, "logprobs": self.logprobs,
                     "versions": self.versions, "text": self.text,
                     "finish_reason": self.finish_reason}
        if self.kv_tokens is not None:
            out["kv_tokens"] = self.kv_tokens
        if self.prompt_token_ids is not None:
            out["prompt_token_ids"] = self.prompt_token_ids
            out["cached_tokens"] = self.cached_tokens
        return out

    @classmethod
    def from_json(cls, data: dict) -> TokenChunk:
        return cls(token_ids=list(data.get("token_ids", [])),
                   logprobs=list(data.get("logprobs", [])),
                   versions=list(data.get("versions", [])), text=data.get("text", ""),
                   finish_reason=data.get("finish_reason"),
                   prompt_token_ids=data.get("prompt_token_ids"),
                   cached_tokens=data.get("cached_tokens"),
                   kv_tokens=data.get("kv_tokens"))


def version_spans(versions: list[str]) -> list[list]:
    """``[[start, end, version], ...]`` covering ``versions`` (half-open, like vLLM's)."""
    spans: list[list] = []
    for i, v in enumerate(versions):
        if spans and spans[-1][2] == v:
            spans[-1][1] = i + 1
        else:
            spans.append([i, i + 1, v])
    return spans


class ServingError(TidalError):
    """Base of serving errors; ``status`` is the HTTP status the boundary answers with."""

    status = 500


class BadRequest(ServingError):
    status = 400


class NotFound(ServingError):
    status = 404


class Overloaded(ServingError):
    """The engine's bounded queue is full; the caller should go elsewhere or retry later."""

    status = 503


class EngineUnavailable(ServingError):
    """The engine cannot be reached (crashed, stopped, network)."""

    status = 502


class EngineError(EngineUnavailable):
    """The engine answered, with a 5xx: it is alive, and the same call may fail there again."""
