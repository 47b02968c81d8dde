"""The project's tiny GPT: learned positions, pre-LayerNorm blocks, GELU MLP, tied head.

In: a ``GPTConfig`` (or a directory written by ``save``). Out: a ``CausalLM``. On disk a model is
``config.json`` (``model_type: tidal-gpt``) + ``model.safetensors`` + ``tokenizer.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file, save_file
from torch import nn

from tidal.models.base import Attention, CausalLM, init_normal, residual_scale
from tidal.models.kv import RaggedBatch
from tidal.models.tokenizer import ByteBPETokenizer, bundled_corpus

MODEL_TYPE = "tidal-gpt"


class GPTConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_type: str = MODEL_TYPE
    vocab_size: int = Field(512, gt=0)
    n_layers: int = Field(4, gt=0)
    n_heads: int = Field(4, gt=0)
    d_model: int = Field(128, gt=0)
    d_ff: int = Field(512, gt=0)
    max_seq_len: int = Field(1024, gt=0)


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg.d_model, cfg.n_heads, cfg.n_heads, bias=True, rope_theta=None)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model)


class TinyGPT(CausalLM):
    model_type = MODEL_TYPE

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise ValueError("d_model must be divisible by n_heads")
        self.cfg = cfg
        self.n_layers, self.n_kv_heads = cfg.n_layers, cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.max_seq_len, self.vocab_size = cfg.max_seq_len, cfg.vocab_size
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        init_normal(self)
        for block in self.blocks:
            nn.init.normal_(block.proj.weight, std=residual_scale(cfg.n_layers))
            nn.init.normal_(block.attn.o_proj.weight, std=residual_scale(cfg.n_layers))

    def _embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.wte(ids) + self.wpe(positions)

    def _block(self, i: int, h: torch.Tensor, positions: torch.Tensor,
               batch: RaggedBatch | None) -> torch.Tensor:
        blk = self.blocks[i]
        h = h + blk.attn(blk.ln_1(h), positions, i, batch)
        return h + blk.proj(nn.functional.gelu(blk.fc(blk.ln_2(h))))

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        return self.ln_f(h) @ self.wte.weight.T

    def save(self, out_dir: str | Path) -> None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(self.cfg.model_dump_json(indent=2))
        save_file({k: v.contiguous() for k, v in self.state_dict().items()},
                  str(out / "model.safetensors"))

    @classmethod
    def load(cls, model_dir: str | Path) -> TinyGPT:
        model_dir = Path(model_dir)
        cfg = GPTConfig.model_validate(json.loads((model_dir / "config.json").read_text()))
        model = cls(cfg)
        model.load_weights(load_file(str(model_dir / "model.safetensors")))
        return model.eval()


def create_tiny(out_dir: str | Path, seed: int = 0, num_merges: int = 256,
                **overrides: int) -> Path:
    """Train the byte-BPE tokenizer on the bundled corpus, initialise a GPT, save both."""
    tok = ByteBPETokenizer.train(bundled_corpus(), num_merges)
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=tok.vocab_size, **overrides)
    out = Path(out_dir)
    TinyGPT(cfg).save(out)
    tok.save(out / "tokenizer.json")
    return out
