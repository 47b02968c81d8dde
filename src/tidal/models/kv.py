"""Per-sequence KV cache and the ragged batch view the attention layers read.

In: new keys/values per layer for a batch of sequences of different lengths. Out: padded key/value
tensors plus a boolean mask, so one SDPA call serves the whole batch (continuous batching).
A cache can be exported to plain tensors and rebuilt elsewhere (KV handoff between engines):
exports are always CPU tensors (they become safetensors bytes), an import lands on the device the
importing model runs on. A cache lives on one device; a ragged batch builds its positions and
mask on its caches' device.

Invariant: ``length`` positions are valid in every layer; positions beyond are zeros and masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal.errors import TidalError

_MIN_CAPACITY = 64


class KVCache:
    """Keys and values of one sequence: per layer ``[capacity, n_kv_heads, head_dim]``."""

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.length = 0
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self.capacity = 0

    def reserve(self, tokens: int) -> None:
        if tokens <= self.capacity:
            return
        cap = max(_MIN_CAPACITY, self.capacity)
        while cap < tokens:
            cap *= 2
        shape = (cap, self.n_kv_heads, self.head_dim)
        kw = {"dtype": self.dtype, "device": self.device}
        new_k = [torch.zeros(shape, **kw) for _ in range(self.n_layers)]
        new_v = [torch.zeros(shape, **kw) for _ in range(self.n_layers)]
        for layer in range(len(self._k)):
            new_k[layer][: self.length] = self._k[layer][: self.length]
            new_v[layer][: self.length] = self._v[layer][: self.length]
        self._k, self._v, self.capacity = new_k, new_v, cap

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v`` (``[T, n_kv_heads, head_dim]``) at positions ``length .. length+T``."""
        end = self.length + k.shape[0]
        self._k[layer][self.length : end] = k
        self._v[layer][self.length : end] = v

    def buffers(self, layer: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._k[layer][:tokens], self._v[layer][:tokens]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self._k, *self._v))

    def export_tensors(self, length: int | None = None) -> dict[str, torch.Tensor]:
        """The first ``length`` (default: all ``length``) valid positions per layer, as CPU
        tensors of the cache's dtype."""
        n = self.length if length is None else length
        if not 0 <= n <= self.length:
            raise ValueError(f"export of {n} positions from a cache holding {self.length}")
        out: dict[str, torch.Tensor] = {}
        for layer in range(self.n_layers):
            k, v = self.buffers(layer, n)
            out[f"k.{layer}"] = k.contiguous().cpu()
            out[f"v.{layer}"] = v.contiguous().cpu()
        return out

    @classmethod
    def from_tensors(
        cls,
        tensors: dict[str, torch.Tensor],
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
    ) -> KVCache:
        """A cache on ``device`` holding ``tensors`` (``dtype`` None: the tensors' own)."""
        if len(tensors) != 2 * n_layers:
            raise TidalError(f"KV import: {len(tensors)} tensors, model needs {2 * n_layers}")
        k0 = tensors["k.0"]
        if tuple(k0.shape[1:]) != (n_kv_heads, head_dim):
            raise TidalError(f"KV import: shape {tuple(k0.shape)} does not fit this model")
        cache = cls(n_layers, n_kv_heads, head_dim, dtype=dtype or k0.dtype, device=device)
        cache.reserve(k0.shape[0])
        for layer in range(n_layers):
            cache.write(
                layer,
                tensors[f"k.{layer}"].to(cache.device),
                tensors[f"v.{layer}"].to(cache.device),
            )
        cache.length = k0.shape[0]
        return cache


@dataclass
class RaggedBatch:
    """A forward step over ``B`` sequences, sequence ``i`` adding ``new_tokens[i]`` tokens; its
    tensors live on the caches' device (every cache of a batch is on the same one)."""

    caches: list[KVCache]
    new_tokens: list[int]

    def __post_init__(self) -> None:
        self.starts = [c.length for c in self.caches]
        self.ends = [s + t for s, t in zip(self.starts, self.new_tokens, strict=True)]
        self.max_new = max(self.new_tokens)
        self.max_total = max(self.ends)
        self.device = self.caches[0].device
        if any(c.device != self.device for c in self.caches):
            raise TidalError(
                f"a ragged batch over caches on several devices "
                f"{sorted({str(c.device) for c in self.caches})}"
            )
        for c in self.caches:
            c.reserve(self.max_total)
        dev = self.device
        t = torch.arange(self.max_new, device=dev)
        start = torch.tensor(self.starts, device=dev)
        self.positions = start[:, None] + t[None, :]
        key = torch.arange(self.max_total, device=dev)
        end = torch.tensor(self.ends, device=dev)
        # query t of sequence i sees keys j <= start_i + t that have been written (j < end_i)
        self.mask = (key[None, None, :] <= self.positions[:, :, None]) & (
            key[None, None, :] < end[:, None, None]
        )

    def attend_keys(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's ``k, v`` (``[B, T, Hkv, D]``) and return padded keys/values."""
        for i, cache in enumerate(self.caches):
            cache.write(layer, k[i, : self.new_tokens[i]], v[i, : self.new_tokens[i]])
        ks, vs = zip(*(c.buffers(layer, self.max_total) for c in self.caches), strict=True)
        return torch.stack(ks).transpose(1, 2), torch.stack(vs).transpose(1, 2)

    def commit(self) -> None:
        for cache, end in zip(self.caches, self.ends, strict=True):
            cache.length = end
