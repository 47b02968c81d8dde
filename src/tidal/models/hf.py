"""Hugging Face model directories: the tiny test model, and the training model of any directory.

In: a directory written by ``save_pretrained`` (``config.json``, ``*.safetensors``, tokenizer
files). Out: ``load_training_model(dir)`` -> a ``transformers`` ``AutoModelForCausalLM`` (any
architecture transformers supports; what the trainer trains), ``create_tiny(out, ...)`` -> a new
directory holding a small ``LlamaConfig`` / ``Qwen2Config`` model with random weights and a
byte-level BPE tokenizer trained on the bundled corpus, carrying SmolLM2's chat template. The tiny
model is written and read exactly as a user's checkpoint is, so tests run the users' code path.
Keeps: the same ``seed`` writes the same weights and the same tokenizer.
"""

from __future__ import annotations

import logging
from importlib import resources
from pathlib import Path
from typing import Literal

import torch

from tidal.errors import TidalError

log = logging.getLogger(__name__)


def _quiet_transformers() -> None:
    """The loaders' progress bars off (they would interleave with every process's log lines);
    called where transformers is used, so importing this module (an engine does) does not load
    transformers (2 s and ~100 MB per process)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


# SmolLM2-135M-Instruct's chat template, verbatim (the tiny model speaks the same format).
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
Arch = Literal["llama", "qwen2"]


def bundled_corpus() -> str:
    return resources.files("tidal.models").joinpath("data/corpus.txt").read_text("utf-8")


def train_tokenizer(vocab_size: int = 512):
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on the bundled corpus (deterministic:
    the trainer is run on one thread over a fixed text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(bundled_corpus().splitlines(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = SMOLLM2_CHAT_TEMPLATE
    return fast


def tiny_config(
    arch: Arch,
    vocab_size: int,
    n_layers: int = 4,
    d_model: int = 128,
    n_heads: int = 4,
    d_ff: int | None = None,
    max_seq_len: int = 1024,
    bos_id: int = 1,
    eos_id: int = 2,
):
    """The ``transformers`` config of a tiny model: grouped KV heads (half the query heads);
    Llama ties its embeddings like SmolLM2, Qwen2 keeps a separate head and q/k/v biases."""
    from transformers import LlamaConfig, Qwen2Config

    if d_model % n_heads:
        raise TidalError(f"d_model {d_model} is not divisible by n_heads {n_heads}")
    common = dict(
        vocab_size=vocab_size,
        hidden_size=d_model,
        intermediate_size=d_ff or 4 * d_model,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=max(1, n_heads // 2),
        max_position_embeddings=max_seq_len,
        rms_norm_eps=1e-5,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    if arch == "llama":
        return LlamaConfig(tie_word_embeddings=True, **common)
    if arch == "qwen2":
        return Qwen2Config(tie_word_embeddings=False, use_sliding_window=False, **common)
    raise TidalError(f"tiny model arch {arch!r}: expected 'llama' or 'qwen2'")


def tiny_model(arch: Arch = "llama", seed: int = 0, vocab_size: int = 512, **shape: int):
    """A tiny ``transformers`` model in memory (fp32, train mode), weights drawn from ``seed``."""
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        tiny_config(arch, vocab_size, **shape), dtype=torch.float32
    )
    model.config.use_cache = False
    return model.train()


def create_tiny(
    out_dir: str | Path, seed: int = 0, arch: Arch = "llama", vocab_size: int = 512, **shape: int
) -> Path:
    """Write a tiny HF model directory (random weights drawn from ``seed``, tokenizer, chat
    template) and return its path. ``shape``: ``n_layers``, ``d_model``, ``n_heads``, ``d_ff``,
    ``max_seq_len``."""
    tok = train_tokenizer(vocab_size)
    model = tiny_model(
        arch, seed, len(tok), bos_id=tok.bos_token_id, eos_id=tok.eos_token_id, **shape
    )
    model.config.use_cache = True  # what a user's checkpoint says; the trainer turns it off
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return out


def load_training_model(model_dir: str | Path, dtype: torch.dtype = torch.float32):
    """``AutoModelForCausalLM`` of ``model_dir`` in ``dtype`` (fp32: the trainer's master
    weights), on the CPU, in train mode, with eager attention (deterministic on CPU and able to
    take any mask); a directory transformers cannot read is a one-line ``TidalError``."""
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise TidalError(f"{model_dir}: no config.json (not a model directory)")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=dtype, attn_implementation="sdpa"
        )
    except (ValueError, OSError, KeyError) as exc:
        raise TidalError(
            f"{model_dir}: transformers cannot load it: {str(exc).splitlines()[0]}"
        ) from exc
    model.config.use_cache = False
    # activation checkpointing per decoder layer (verl's enable_gradient_checkpointing): the
    # backward recomputes each layer's activations instead of keeping them, the attention
    # probabilities of [B, heads, L, L] among them; measured on the demo below
    if getattr(model, "supports_gradient_checkpointing", False):
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.x's name
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
    log.info(
        "training model %s: %s, %d params",
        model_dir,
        type(model).__name__,
        sum(p.numel() for p in model.parameters()),
    )
    return model.train()
