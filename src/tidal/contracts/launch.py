"""How ``tidal proxy`` and ``tidal engine`` are started: their settings, each defined once.

In: whoever starts one (``serving.launch``: the driver, the tests and benchmarks) builds a
``ProxySettings`` or ``EngineSettings`` and passes it to the child process as JSON (``--settings
JSON``, as ``SatelliteConfig`` is passed to a satellite); a person at the command line gives the
same settings as options, generated from these fields (``commands._settings``: one option per
field, its help the field's description, its default the field's). Out: the validated settings
the command serves with. Secrets (the admin and engine tokens) are never settings: they travel
in the environment, never on a command line.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ProxySettings(BaseModel):
    """``tidal proxy``: the OpenAI-compatible front door in front of engine URLs."""

    model_config = ConfigDict(extra="forbid")

    port: int = Field(8200, ge=1, le=65535, description="TCP port to listen on.")
    host: str = Field("127.0.0.1", description="Address to listen on.")
    engines: list[str] = Field(
        default_factory=list,
        json_schema_extra={"flag": "--engine"},
        description="Standalone engine URL (repeatable).",
    )
    cells: list[str] = Field(
        default_factory=list,
        json_schema_extra={"flag": "--cell"},
        description="Rollout-cell engine URL, in cell order (repeatable).",
    )
    backend: str = Field(
        "builtin",
        description="What serves behind the engine URLs: builtin, "
        "vllm, sglang or a backend a --backend-module registers.",
    )
    backend_modules: list[str] = Field(
        default_factory=list,
        json_schema_extra={"flag": "--backend-module"},
        description="A module that registers engine backends (a .py path or a dotted name; "
        "repeatable), as runtime.backend_modules.",
    )
    cap: int = Field(32, ge=1, description="Admission cap per engine.")
    max_open_executions: int = Field(
        10_000,
        ge=1,
        description="Registered executions open at once at most (a registration beyond is "
        "refused, 409); tidal run sets it to the run's slots (docs/scale.md).",
    )
    kv_handoff: bool = Field(
        True, description="Move a rerouted request's KV cache to its new engine (else it prefills)."
    )
    wait_s: float = Field(
        120.0, gt=0, description="How long to wait for the engines to become healthy at start."
    )
    require_registration: bool = Field(
        False,
        description="Refuse requests of executions not registered via POST /tidal/executions.",
    )
    request_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Limit of one model call, "
        "waiting for a free engine slot included (an execution "
        "may register its own timeout_s).",
    )
    read_timeout_s: float = Field(
        30.0, gt=0, description="A request must arrive whole (head and body) within this time."
    )
    max_prompt_tokens: int = Field(
        32768,
        ge=1,
        description="Longest prompt of one model call, in tokens (a longer one gets a 400); "
        "Claude Code's own first call is ~50K tokens of a small tokenizer.",
    )
    seed: int | None = Field(
        None,
        ge=-(2**63),
        le=2**63 - 1,
        description="Run seed: a call "
        "of a named execution without its own seed samples with one "
        "derived from (seed, execution id, call index), the same on any "
        "engine (default: none, engines' own streams).",
    )
    admission: str = Field(
        "off",
        description="Admission control: 'off', 'saturation' or a "
        "per-token latency target in seconds; caps each engine at its "
        "concurrency target on --engine-curve.",
    )
    admission_order: Literal["longest_waiting", "shortest_remaining"] = Field(
        "longest_waiting", description="Order of the calls waiting for a slot."
    )
    engine_curve: list[tuple[int, float]] | None = Field(
        None,
        json_schema_extra={"metavar": "B:TOK_S,..."},
        description="The engines' throughput curve, e.g. 1:200,32:3200,128:8800 "
        "(batch:tokens/s; needed with --admission).",
    )
    tool_call_parser: Literal["hermes"] = Field(
        "hermes",
        description="How tool calls are read out of chat answers, per model family "
        "(hermes: <tool_call>{json}</tool_call>, Qwen2.5/Qwen3/Hermes).",
    )
    affinity: bool = Field(
        True,
        description="Keep the calls of one X-Session-ID (else one "
        "execution) on the engine that holds their prefix while it has a "
        "slot.",
    )


class EngineSettings(BaseModel):
    """``tidal engine``: the built-in engine serving a model directory over HTTP."""

    model_config = ConfigDict(extra="forbid")

    model_dir: str = Field(
        json_schema_extra={"flag": "--model"},
        description="Model directory (tiny GPT or HF Llama, e.g. from `tidal model`).",
    )
    port: int = Field(8100, ge=1, le=65535, description="TCP port to listen on.")
    host: str = Field("127.0.0.1", description="Address to listen on.")
    name: str | None = Field(None, description="Served model name (default: directory name).")
    max_batch: int = Field(
        32, ge=1, description="Sequences decoded together at most (continuous batching)."
    )
    max_waiting: int = Field(
        1024,
        ge=1,
        description="Requests queued beyond the batch at most (more are refused with 503).",
    )
    threads: int = Field(1, ge=1, description="torch threads.")
    weight_version: str = Field(
        "v0", description="Label of the loaded weights (each generated token carries it)."
    )
    seed: int = Field(
        0,
        description="Sampling seed of requests without their own; give each "
        "engine of a cluster its own, or engines serving one GRPO group draw the "
        "same samples.",
    )
    step_in_thread: bool = Field(
        False,
        json_schema_extra={"off": "--step-on-loop"},
        description="Run model steps in a worker thread so the HTTP "
        "loop keeps answering (control calls, tokenize) during long "
        "prefills.",
    )
    device: str = Field(
        "cpu", description="Where the model and KV caches live: cpu, cuda or cuda:N."
    )
    spill_dir: str | None = Field(
        None, description="Where a level-1 sleep writes the weights (default: held in CPU memory)."
    )
    read_timeout_s: float = Field(
        30.0, gt=0, description="A request must arrive whole (head and body) within this time."
    )
    tool_call_parser: Literal["hermes"] = Field(
        "hermes", description="How tool calls are read out of chat answers (see `tidal proxy -h`)."
    )
    prefix_cache_mb: float = Field(
        0.0,
        ge=0,
        description="Keep finished requests' KV (up to "
        "this many MiB) for the next call of their conversation "
        "(what session affinity routes to); 0: off.",
    )
    deterministic: bool = Field(
        False,
        description="Compute each request alone and token by "
        "token, so its tokens and log-probs do not depend on what else "
        "is batched with it or where it was moved from (slower; "
        "runtime.deterministic).",
    )
