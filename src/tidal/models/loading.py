"""Load a Hugging Face model directory for the built-in engine, or refuse it naming vLLM.

In: a directory path. Out: ``(model, tokenizer)``: the built-in ``LlamaForCausalLM`` (its fast
KV-cache path; architectures ``llama``, ``mistral``, ``qwen2``) and the directory's
``transformers`` tokenizer. Any other architecture is a one-line ``TidalError`` naming vLLM
(``runtime.engine: vllm``), which serves whatever transformers / vLLM support; the trainer
(``tidal.models.hf.load_training_model``) trains them all. Also reads weight files for in-place
updates.
"""

from __future__ import annotations

import json
import mmap
import os
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from tidal.errors import TidalError
from tidal.models.base import CausalLM
from tidal.models.llama import LlamaForCausalLM, load_hf_state_dict
from tidal.models.tokenizer import HFTokenizer

BUILTIN_TYPES = ("llama", "mistral", "qwen2")


def model_kind(model_dir: str | Path) -> str:
    """The directory's ``model_type``, if the built-in engine implements it."""
    cfg_path = Path(model_dir) / "config.json"
    if not cfg_path.is_file():
        raise TidalError(f"{model_dir}: no config.json (not a model directory)")
    kind = json.loads(cfg_path.read_text()).get("model_type")
    if kind not in BUILTIN_TYPES:
        raise TidalError(
            f"{model_dir}: model_type {kind!r} has no built-in engine path "
            f"(it runs {', '.join(BUILTIN_TYPES)}); serve it with vLLM "
            "(runtime.engine: vllm)"
        )
    return kind


def load_model(model_dir: str | Path) -> tuple[CausalLM, HFTokenizer]:
    model_dir = Path(model_dir)
    model_kind(model_dir)
    return LlamaForCausalLM.load(model_dir), HFTokenizer(model_dir)


def read_weights(path: str | Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A state dict from a ``.safetensors`` file or a directory of them. Anything else (no
    such path, another kind of file, a file that does not parse) is a ``TidalError`` naming
    the path."""
    path = Path(path)
    try:
        if path.is_dir():
            return load_hf_state_dict(path, dtype)
        if path.is_file():
            if path.suffix != ".safetensors":
                raise TidalError(f"{path}: not a .safetensors file")
            return {k: v.to(dtype) for k, v in load_file(str(path)).items()}
    except (SafetensorError, OSError) as exc:
        raise TidalError(f"{path}: not readable safetensors weights ({exc})") from None
    raise TidalError(f"weights not found: {path}")


# safetensors dtype names whose bytes a torch tensor of that dtype holds as they are
_SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
}


class WeightFile(Mapping[str, torch.Tensor]):
    """One ``.safetensors`` file as a read-only state dict whose tensors are read one at a time
    when asked for, in ``dtype`` (in the file's dtype they are views of its mapping: read them,
    never write into them): checking and loading a version go through it tensor by tensor, so
    an engine never holds a second whole copy of its weights."""

    def __init__(self, path: Path, dtype: torch.dtype = torch.float32) -> None:
        self.path, self.dtype = path, dtype
        try:
            self._file = safe_open(str(path), framework="pt")
            self._names = list(self._file.keys())
            with path.open("rb") as fh:  # safetensors: 8-byte length, JSON header, data
                n = int.from_bytes(fh.read(8), "little")
                self._header = json.loads(fh.read(n))
            self._data_start = 8 + n
        except (SafetensorError, OSError, ValueError) as exc:
            raise TidalError(f"{path}: not readable safetensors weights ({exc})") from None

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Tensor ``name`` copied into ``out`` (checked shape). Into a contiguous CPU tensor
        of the file's dtype the bytes are read from the file straight into ``out``'s memory:
        one copy by the kernel, where copying from the mapping pays a page fault per page
        (measured on 2 busy cores, SmolLM2's 0.54 GB: 0.10-0.26 s against 0.96-1.16 s);
        anything else is copied from the tensor as read."""
        entry = self._header.get(name)
        if entry is None:
            raise KeyError(name)
        start, end = entry["data_offsets"]
        if (
            out.device.type == "cpu"
            and out.is_contiguous()
            and _SAFETENSORS_DTYPES.get(entry["dtype"]) == out.dtype
            and out.numel() * out.element_size() == end - start
        ):
            try:
                with self.path.open("rb", buffering=0) as fh:
                    fh.seek(self._data_start + start)
                    got = fh.readinto(out.detach().reshape(-1).view(torch.uint8).numpy())
            except OSError as exc:
                raise TidalError(f"{self.path}: tensor {name} not readable ({exc})") from None
            if got != end - start:
                raise TidalError(
                    f"{self.path}: tensor {name} truncated ({got} of {end - start} bytes)"
                )
            return
        with torch.no_grad():
            out.copy_(self[name])

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        view = self._view(name)
        if view is not None:
            return view
        try:
            return self._file.get_tensor(name).to(self.dtype)
        except (SafetensorError, OSError) as exc:
            raise TidalError(f"{self.path}: tensor {name} not readable ({exc})") from None

    _mm: mmap.mmap | None = None

    def _view(self, name: str) -> torch.Tensor | None:
        """Tensor ``name`` as a read-only view of the file's mapping, when it is stored in
        ``dtype``: the mapping is populated in one call (``MAP_POPULATE``), so checking a
        version reads it at memory speed instead of a page fault per page, and nothing is
        copied (None: another dtype, read by safetensors)."""
        entry = self._header.get(name)
        if entry is None or _SAFETENSORS_DTYPES.get(entry["dtype"]) != self.dtype:
            return None
        start, end = entry["data_offsets"]
        if self._mm is None:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                self._mm = mmap.mmap(fd, 0, flags=flags, prot=mmap.PROT_READ)
            except (OSError, ValueError):
                return None
            finally:
                os.close(fd)
        if self._data_start + end > len(self._mm):
            raise TidalError(f"{self.path}: tensor {name} truncated")
        with warnings.catch_warnings():  # read-only: a view is read, never written
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(
                self._mm,
                dtype=self.dtype,
                offset=self._data_start + start,
                count=(end - start) // self.dtype.itemsize,
            )
        return flat.view(entry["shape"])

    def shape_of(self, name: str) -> list[int]:
        """A tensor's shape from the file's header (nothing read)."""
        return list(self._file.get_slice(name).get_shape())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names


def open_weights(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> Mapping[str, torch.Tensor]:
    """``read_weights``, but a single ``.safetensors`` file is read lazily (``WeightFile``)."""
    path = Path(path)
    if path.is_file() and path.suffix == ".safetensors":
        return WeightFile(path, dtype)
    return read_weights(path, dtype)
