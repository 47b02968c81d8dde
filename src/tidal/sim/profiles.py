"""Hardware and model profiles for the cost model (``tidal.sim.perf``).

In: a GPU name (``data/hardware.yaml``: public spec-sheet figures) and a model given as a
shipped name (``data/models/NAME.json``) or the path of a Hugging Face ``config.json``.
Out: frozen ``GpuProfile`` / ``ModelProfile`` records: FLOPs, HBM bandwidth and size, links;
parameters (total, active, dense vs routed experts), layers, KV bytes per token and the
per-sequence state of linear-attention layers. A missing or malformed field is a
``ConfigError`` naming it; nothing is defaulted silently except what the HF format itself
defaults (``head_dim = hidden / heads``, untied embeddings, bf16).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from tidal.errors import ConfigError

DATA = Path(__file__).parent / "data"
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class GpuProfile:
    name: str
    bf16_tflops: float
    hbm_tb_s: float
    hbm_gb: float
    nvlink_gb_s: float
    host_gb_s: float
    network_gb_s: float
    allreduce_latency_s: float

    @property
    def flops(self) -> float:
        return self.bf16_tflops * 1e12

    @property
    def hbm_bytes_s(self) -> float:
        return self.hbm_tb_s * 1e12


@dataclass(frozen=True)
class ModelProfile:
    name: str
    layers: int
    hidden: int
    full_attention_layers: int
    kv_bytes_per_token: float  # K and V of every full-attention layer, all KV heads
    state_bytes_per_seq: float  # recurrent state of linear-attention layers (0 without)
    dense_params: float  # everything but the routed experts (embeddings included)
    expert_params: float  # all routed experts of all layers
    experts: int  # routed experts per layer (0: dense)
    experts_per_tok: int
    bytes_per_param: int
    attn_dim: int = 0  # query heads x head dim (attention scores and values per context token)
    input_embed_params: float = 0.0  # an untied input embedding: a lookup, no FLOPs
    kv_heads: int = 0  # KV heads of a full-attention layer (0: unknown, never replicated)

    def kv_bytes_per_token_tp(self, tp: int) -> float:
        """KV-cache bytes one context token takes on a replica of ``tp`` GPUs, every copy
        counted: each rank keeps ``max(1, kv_heads // tp)`` heads, so with fewer KV heads than
        ranks the heads are replicated (vLLM and SGLang ``ModelConfig.get_num_kv_heads``:
        ``max(1, total_num_kv_heads // tensor_parallel_size)``) and every rank reads its copy
        at each decode step: ``tp / kv_heads`` times the logical bytes."""
        if self.kv_heads <= 0 or tp <= self.kv_heads:
            return self.kv_bytes_per_token
        return self.kv_bytes_per_token * tp * max(1, self.kv_heads // tp) / self.kv_heads

    @property
    def matmul_params(self) -> float:
        """Active parameters a token multiplies through (2 FLOPs each per forward pass): the
        active ones less an untied input embedding, which is a table lookup (a tied one is
        the output head's matrix, a matmul)."""
        return self.active_params - self.input_embed_params

    @property
    def attn_flops_per_pair(self) -> float:
        """Forward FLOPs of one (token, earlier token) pair: scores and values (2 + 2 FLOPs
        per attention dimension) in every full-attention layer."""
        return 4.0 * self.full_attention_layers * self.attn_dim

    @property
    def total_params(self) -> float:
        return self.dense_params + self.expert_params

    @property
    def active_params(self) -> float:
        if self.experts == 0:
            return self.dense_params
        return self.dense_params + self.expert_params * self.experts_per_tok / self.experts

    @property
    def weight_bytes(self) -> float:
        return self.total_params * self.bytes_per_param

    def expert_fraction_touched(self, tokens: float) -> float:
        """Share of the routed experts a decode step of ``tokens`` sequences reads (uniform
        routing: ``1 - (1 - k/E)**n``)."""
        if self.experts == 0 or tokens <= 0:
            return 0.0
        return 1.0 - (1.0 - self.experts_per_tok / self.experts) ** tokens


@cache
def gpu_names() -> tuple[str, ...]:
    return tuple(_hardware())


@cache
def _hardware() -> dict[str, dict[str, Any]]:
    import yaml

    return yaml.safe_load((DATA / "hardware.yaml").read_text())


GPU_FIELDS = (
    "bf16_tflops",
    "hbm_tb_s",
    "hbm_gb",
    "nvlink_gb_s",
    "host_gb_s",
    "network_gb_s",
    "allreduce_latency_s",
)


def load_gpu(name: str | dict[str, Any]) -> GpuProfile:
    """A GPU of ``hardware.yaml`` by name, or an accelerator defined inline with the same
    fields (plus an optional ``name``): every field is required and positive."""
    if isinstance(name, dict):
        return gpu_from_fields(dict(name))
    table = _hardware()
    if name not in table:
        raise ConfigError(
            "costmodel.gpu",
            f"unknown GPU {name!r} (known: {', '.join(table)}; "
            f"or define it inline with {', '.join(GPU_FIELDS)})",
        )
    return GpuProfile(name=name, **table[name])


def gpu_from_fields(spec: dict[str, Any]) -> GpuProfile:
    label = str(spec.pop("name", "inline"))
    extra = sorted(set(spec) - set(GPU_FIELDS))
    if extra:
        raise ConfigError(
            f"costmodel.gpu.{extra[0]}", f"unknown field (known: name, {', '.join(GPU_FIELDS)})"
        )
    vals: dict[str, float] = {}
    for key in GPU_FIELDS:
        v = spec.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise ConfigError(f"costmodel.gpu.{key}", f"needs a positive number (got {v!r})")
        vals[key] = float(v)
    return GpuProfile(name=label, **vals)


def model_names() -> list[str]:
    return sorted(p.stem for p in (DATA / "models").glob("*.json"))


@cache
def load_model(name_or_path: str) -> ModelProfile:
    """A shipped model name or the path of an HF ``config.json``."""
    p = Path(name_or_path)
    if not p.is_file():
        p = DATA / "models" / f"{name_or_path}.json"
    if not p.is_file():
        raise ConfigError(
            "costmodel.model",
            f"{name_or_path!r}: neither a config.json nor a "
            f"shipped model ({', '.join(model_names())})",
        )
    try:
        cfg = json.loads(p.read_text())
    except ValueError as exc:
        raise ConfigError("costmodel.model", f"{p}: not JSON ({exc})") from None
    cfg = cfg.get("text_config", cfg)
    return model_from_config(cfg, p.stem if p.name != "config.json" else p.parent.name)


def _int(cfg: dict[str, Any], key: str) -> int:
    v = cfg.get(key)
    if not isinstance(v, int) or v <= 0:
        raise ConfigError(
            f"costmodel.model.{key}", f"config.json needs a positive integer {key!r} (got {v!r})"
        )
    return v


def _full_attention_layers(cfg: dict[str, Any], layers: int) -> int:
    types = cfg.get("layer_types")
    if types:
        return sum(t == "full_attention" for t in types)
    interval = cfg.get("full_attention_interval")
    return layers // interval if interval else layers


def model_from_config(cfg: dict[str, Any], name: str) -> ModelProfile:
    """Parameter counts and cache sizes from the fields of an HF config (see module doc)."""
    layers, hidden = _int(cfg, "num_hidden_layers"), _int(cfg, "hidden_size")
    heads, vocab = _int(cfg, "num_attention_heads"), _int(cfg, "vocab_size")
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    nbytes = DTYPE_BYTES.get(str(cfg.get("torch_dtype", "bfloat16")), 2)
    full = _full_attention_layers(cfg, layers)
    linear = layers - full
    gated = str(cfg.get("model_type", "")).startswith(("qwen3_next", "qwen3_5"))
    attn = (
        hidden * heads * head_dim * (2 if gated else 1)
        + 2 * hidden * kv_heads * head_dim
        + heads * head_dim * hidden
    )
    lin = 0.0
    state = 0.0
    if linear:
        kh, vh = _int(cfg, "linear_num_key_heads"), _int(cfg, "linear_num_value_heads")
        kd, vd = _int(cfg, "linear_key_head_dim"), _int(cfg, "linear_value_head_dim")
        lin = hidden * (2 * kh * kd + 2 * vh * vd + 2 * vh) + vh * vd * hidden
        state = linear * vh * kd * vd * nbytes
    experts = int(cfg.get("num_experts") or cfg.get("n_routed_experts") or 0)
    if experts:
        per_expert = 3 * hidden * _int(cfg, "moe_intermediate_size")
        expert_params = float(layers * experts * per_expert)
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        mlp = 3 * hidden * shared + hidden * experts  # shared expert, router
        k = _int(cfg, "num_experts_per_tok")
    else:
        expert_params, k = 0.0, 0
        mlp = 3 * hidden * _int(cfg, "intermediate_size")
    tied = bool(cfg.get("tie_word_embeddings"))
    embed = vocab * hidden * (1 if tied else 2)
    dense = float(embed + full * attn + linear * lin + layers * mlp)
    return ModelProfile(
        name=name,
        layers=layers,
        hidden=hidden,
        full_attention_layers=full,
        kv_bytes_per_token=float(2 * full * kv_heads * head_dim * nbytes),
        state_bytes_per_seq=float(state),
        dense_params=dense,
        expert_params=expert_params,
        experts=experts,
        experts_per_tok=k,
        bytes_per_param=nbytes,
        attn_dim=heads * head_dim,
        input_embed_params=0.0 if tied else float(vocab * hidden),
        kv_heads=kv_heads,
    )
