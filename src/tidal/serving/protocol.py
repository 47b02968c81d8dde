"""Types that cross the serving plane: sampling parameters, generation requests and the token
chunks every engine (built-in, vLLM, SGLang) streams back, the serving error tree, and the
common prefix of two token lists (the prefix caches of the built-in and emulated engines).

Invariant: every generated token travels with its log-prob and the weight version that produced it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tidal.errors import TidalError
from tidal.types import MIN_TEMPERATURE

FINISH_REASONS = ("stop", "length", "abort", "error")  # error: the engine's step failed
# the smallest positive temperature sampled with: below it logits / T overflow float32 (inf,
# then NaN probabilities) for ordinary logit ranges; refused, never clamped (the caller asked
# for a distribution we would not sample from). 0 means greedy.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(16, ge=1, le=1_000_000)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    # stop strings: generation ends at the token that completes one; that token and the ones
    # before it are kept (records, token ids), the text is cut before the stop string
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)

    @field_validator("temperature")
    @classmethod
    def _computable(cls, t: float) -> float:
        return check_temperature(t)

    @field_validator("stop")
    @classmethod
    def _stops(cls, stops: list[str]) -> list[str]:
        for s in stops:
            if not 0 < len(s) <= MAX_STOP_CHARS:
                raise ValueError(f"each stop string has 1 to {MAX_STOP_CHARS} characters")
        return stops


def check_temperature(t: float) -> float:
    """``t`` if the engine can sample with it: 0 (greedy) or at least ``MIN_TEMPERATURE``."""
    if 0.0 < t < MIN_TEMPERATURE:
        raise ValueError(
            f"{t!r} is below the smallest temperature sampled with "
            f"({MIN_TEMPERATURE}); use 0 for greedy decoding"
        )
    return t


@dataclass
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kv_handle: str | None = None
    # False: the caller needs no chunk before the last (which carries every token, also on an
    # abort); an engine may then answer in one piece
    stream: bool = True
    # the last N prompt tokens are this call's own output from earlier engines (a rerouted
    # call): the engine decodes its text after theirs, so a character whose bytes were split
    # between two engines is sent whole, once
    output_context: int = 0


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
        out: dict = {
            "token_ids": self.token_ids,
            "logprobs": self.logprobs,
            "versions": self.versions,
            "text": self.text,
            "finish_reason": self.finish_reason,
        }
        if self.kv_tokens is not None:
            out["kv_tokens"] = self.kv_tokens
        if self.prompt_token_ids is not None:
            out["prompt_token_ids"] = self.prompt_token_ids
            out["cached_tokens"] = self.cached_tokens
        return out

    @classmethod
    def from_json(cls, data: dict) -> TokenChunk:
        return cls(
            token_ids=list(data.get("token_ids", [])),
            logprobs=list(data.get("logprobs", [])),
            versions=list(data.get("versions", [])),
            text=data.get("text", ""),
            finish_reason=data.get("finish_reason"),
            prompt_token_ids=data.get("prompt_token_ids"),
            cached_tokens=data.get("cached_tokens"),
            kv_tokens=data.get("kv_tokens"),
        )


class StopText:
    """The text a caller sees of a stream that ends at stop strings: text up to the first stop
    string, never the stop string itself. While the stream runs, the last characters that
    could begin a stop string are held back (as vLLM does); ``final`` releases the rest."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""  # all text fed
        self.sent = 0  # characters given out
        self.done = False

    def feed(self, piece: str, final: bool = False) -> str:
        if not self.stops:
            return piece
        if self.done:
            return ""
        self.text += piece
        cut = cut_at_stop(self.text, self.stops)
        if cut is not None:
            end, self.done = cut, True
        else:
            end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out


def cut_at_stop(text: str, stops: list[str]) -> int | None:
    """Where ``text`` must end: the start of its earliest stop string (None: none in it)."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


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


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
