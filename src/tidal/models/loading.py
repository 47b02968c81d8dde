"""Load any supported model directory: the tiny GPT or an HF Llama-family checkpoint.

In: a directory path. Out: ``(model, tokenizer)``; the model type is read from ``config.json``
(``tidal-gpt`` or an HF ``LlamaForCausalLM``). Also reads weight files for in-place updates.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from tidal.errors import TidalError
from tidal.models.base import CausalLM
from tidal.models.gpt import MODEL_TYPE as GPT_TYPE
from tidal.models.gpt import TinyGPT
from tidal.models.llama import LlamaForCausalLM, load_hf_state_dict
from tidal.models.tokenizer import ByteBPETokenizer, HFTokenizer, Tokenizer


def model_kind(model_dir: str | Path) -> str:
    cfg_path = Path(model_dir) / "config.json"
    if not cfg_path.is_file():
        raise TidalError(f"{model_dir}: no config.json (not a model directory)")
    raw = json.loads(cfg_path.read_text())
    if raw.get("model_type") == GPT_TYPE:
        return GPT_TYPE
    if raw.get("model_type") in ("llama", "mistral") or "LlamaForCausalLM" in raw.get(
            "architectures", []):
        return "llama"
    raise TidalError(f"{model_dir}: unsupported model_type {raw.get('model_type')!r}")


def load_model(model_dir: str | Path) -> tuple[CausalLM, Tokenizer]:
    model_dir = Path(model_dir)
    if model_kind(model_dir) == GPT_TYPE:
        return TinyGPT.load(model_dir), ByteBPETokenizer.load(model_dir / "tokenizer.json")
    return LlamaForCausalLM.load(model_dir), HFTokenizer(model_dir)


def read_weights(path: str | Path, dtype: torch.dtype = torch.float32
                 ) -> dict[str, torch.Tensor]:
    """A state dict from a ``.safetensors`` file or a directory of them."""
    path = Path(path)
    if path.is_dir():
        return load_hf_state_dict(path, dtype)
    if path.is_file():
        return {k: v.to(dtype) for k, v in load_file(str(path)).items()}
    raise TidalError(f"weights not found: {path}")
