"""Llama-family causal LM in plain torch (the built-in engine's fast KV-cache path), loading a
Hugging Face directory (SmolLM2, Llama, Mistral without sliding window, Qwen2).

In: a directory with ``config.json`` (``llama`` / ``mistral`` / ``qwen2``) and
``*.safetensors``. Out: a ``CausalLM`` whose parameter names (and their order) equal the HF
checkpoint's, so HF state dicts and flat layouts load as they are. Supports grouped KV heads,
RMSNorm, SwiGLU, RoPE (no scaling), q/k/v biases (Qwen2) and tied embeddings.
``LlamaForCausalLM.random(SMOLLM2_135M)`` builds a randomly initialised model of a known shape
without any file (GPU tests and cost benchmarks of the real size).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, model_validator
from safetensors.torch import load_file, save_file
from torch import nn

from tidal.errors import TidalError
from tidal.models.base import Attention, CausalLM
from tidal.models.kv import RaggedBatch

log = logging.getLogger(__name__)

# SmolLM2-135M(-Instruct)'s config.json, the fields this implementation reads
SMOLLM2_135M = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}


class LlamaConfig(BaseModel):
    """The fields of an HF Llama ``config.json`` this implementation reads (others ignored)."""

    model_config = ConfigDict(extra="ignore")

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_parameters: dict | None = None
    model_type: str = "llama"
    head_dim: int | None = None
    use_sliding_window: bool = False

    @model_validator(mode="after")
    def _rope_from_parameters(self) -> LlamaConfig:
        # transformers >= 5 nests rope settings under ``rope_parameters``
        if self.rope_parameters:
            self.rope_theta = float(self.rope_parameters.get("rope_theta", self.rope_theta))
            if self.rope_parameters.get("rope_type", "default") != "default":
                self.rope_scaling = self.rope_parameters
        if self.head_dim not in (None, self.hidden_size // self.num_attention_heads):
            raise TidalError(
                f"head_dim {self.head_dim} != hidden_size / num_attention_heads: "
                "not supported by the built-in engine; serve it with vLLM"
            )
        if self.use_sliding_window:
            raise TidalError(
                "sliding-window attention is not supported by the built-in engine; "
                "serve it with vLLM"
            )
        return self

    @property
    def qkv_bias(self) -> bool:
        """Qwen2 always carries q/k/v biases (and none on o_proj)."""
        return self.attention_bias or self.model_type == "qwen2"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class _MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        # transformers' order: parameter layouts (and their fingerprints) then agree
        self.self_attn = Attention(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads or cfg.num_attention_heads,
            bias=cfg.qkv_bias,
            rope_theta=cfg.rope_theta,
            o_bias=cfg.attention_bias,
        )
        self.mlp = _MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class _Body(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def fill_random_(model: torch.nn.Module, seed: int) -> None:
    """N(0, 0.02) weights, unit norms, zero biases, drawn from ``seed`` where the parameters
    live (the same values on every device of one kind)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)


class LlamaForCausalLM(CausalLM):
    model_type = "llama"

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        if cfg.rope_scaling:
            raise TidalError(f"rope_scaling {cfg.rope_scaling} is not supported")
        self.cfg = cfg
        self.n_layers = cfg.num_hidden_layers
        self.n_kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.max_seq_len, self.vocab_size = cfg.max_position_embeddings, cfg.vocab_size
        self.model = _Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._retie()

    def _retie(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _is_tied(self, name: str) -> bool:
        return self.cfg.tie_word_embeddings and name == "lm_head.weight"

    def _embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def _block(
        self, i: int, h: torch.Tensor, positions: torch.Tensor, batch: RaggedBatch | None
    ) -> torch.Tensor:
        layer = self.model.layers[i]
        h = h + layer.self_attn(layer.input_layernorm(h), positions, i, batch)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(h))

    def save(self, out_dir: str | Path) -> None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        sd = {k: v.contiguous() for k, v in self.state_dict().items()}
        if self.cfg.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        save_file(sd, str(out / "model.safetensors"))

    @classmethod
    def random(
        cls,
        shape: dict,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> LlamaForCausalLM:
        """A model of ``shape`` (``config.json`` fields) with N(0, 0.02) weights and unit norms,
        no file; drawn on the CPU from ``seed`` alone, so every device gets the same values."""
        with torch.device("meta"):
            model = cls(LlamaConfig.model_validate(shape))
        model.materialize("cpu")
        fill_random_(model, seed)
        return model.to(device=device, dtype=dtype).eval()

    @classmethod
    def load(cls, model_dir: str | Path, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
        model_dir = Path(model_dir)
        raw = json.loads((model_dir / "config.json").read_text())
        cfg = LlamaConfig.model_validate(raw)
        with torch.device("meta"):
            model = cls(cfg)
        model.materialize()
        model.to(dtype)
        model.load_weights(load_hf_state_dict(model_dir, dtype))
        log.info("loaded %s: %d params", model_dir, model.num_params())
        return model.eval()


def load_hf_state_dict(model_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise TidalError(f"{model_dir}: no *.safetensors file")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update({k: v.to(dtype) for k, v in load_file(str(f)).items()})
    return sd
