"""The built-in engine's causal-LM surface (the Llama family) and its attention layer.

In: token ids (a padded batch for training, or ragged per-sequence lists plus KV caches for
serving). Out: logits. Subclasses build ``embed`` / ``blocks`` / ``final_norm`` / ``lm_head``; this
module owns full-sequence forward, cached incremental forward, in-place weight loading, and
freeing / re-materialising weights (engine sleep and wake).

Device: a model moved with ``.to(device)`` keeps working; every tensor a forward builds (ids,
positions, masks, rotary tables, new KV caches) is made on the parameters' device. A freed model
remembers that device and ``materialize`` re-creates its parameters there; freeing on CUDA also
hands the cached blocks back to the driver, so a sleeping engine really holds no weight memory.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tidal.errors import TidalError
from tidal.models.device import release_cached
from tidal.models.kv import KVCache, RaggedBatch

# A cached step's attention mask (sequences x new tokens x keys) above this many elements runs
# chunked (``forward_cached``): 2^28 is more than any batch of 16 sequences of 2048 tokens, so
# SmolLM2-sized prompts never chunk; chunks keep the mask at 2^26 (64 MiB of bools; the scores
# are that times the heads, in the model's dtype).
CHUNKED_STEP_ELEMENTS = 1 << 28
CHUNK_ELEMENTS = 1 << 26


def chunk_tokens(sequences: int, keys: int) -> int:
    """New tokens per sequence of one chunked step over ``keys`` positions (at least 256)."""
    return max(256, CHUNK_ELEMENTS // max(1, sequences * keys))


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding, ``rotate_half`` convention; ``x`` is ``[B, T, H, D]``."""
    d = x.shape[-1]
    steps = torch.arange(0, d, 2, dtype=torch.float32, device=positions.device)
    inv_freq = 1.0 / (theta ** (steps / d))
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, :, None, :]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether a tensor holds no NaN or infinite value. Its sum is finite whenever every value
    is (a NaN or an infinity carries into it), so one reduction in the tensor's own dtype
    (15x faster than the elementwise mask on the CPU, no mask allocated) decides the common
    case; only a sum that overflowed from finite values needs the exact elementwise check."""
    if not tensor.is_floating_point():
        return True
    if (
        tensor.device.type == "cpu"
        and tensor.dtype in (torch.float32, torch.float64)
        and tensor.is_contiguous()
        and tensor.numel()
    ):
        # numpy's sum: one pass on one thread; torch's threaded reduction measured 3-10x
        # slower on two busy cores (SmolLM2's weights 0.16-0.24 s against 0.77-2.2 s)
        import numpy as np

        with np.errstate(over="ignore", invalid="ignore"):
            if bool(np.isfinite(np.add.reduce(tensor.detach().numpy().reshape(-1)))):
                return True
    elif bool(torch.isfinite(tensor.sum())):
        return True
    return bool(torch.isfinite(tensor).all())


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads, optional RoPE, HF parameter names."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        bias: bool,
        rope_theta: float | None,
        o_bias: bool | None = None,
    ) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = d_model // n_heads
        self.rope_theta = rope_theta
        self.q_proj = nn.Linear(d_model, n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(
            n_heads * self.head_dim, d_model, bias=bias if o_bias is None else o_bias
        )

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, layer: int, batch: RaggedBatch | None
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim)
        if self.rope_theta is not None:
            q, k = rope(q, positions, self.rope_theta), rope(k, positions, self.rope_theta)
        gqa = self.n_kv_heads != self.n_heads
        if batch is None:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                is_causal=True,
                enable_gqa=gqa,
            )
        else:
            keys, values = batch.attend_keys(layer, k, v)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, attn_mask=batch.mask[:, None], enable_gqa=gqa
            )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class CausalLM(nn.Module):
    """Base class. Subclasses set ``n_layers``, ``n_kv_heads``, ``head_dim``, ``max_seq_len``,
    ``vocab_size`` and implement ``_embed``, ``_block`` and ``_head``."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    max_seq_len: int
    vocab_size: int
    model_type: str
    _weights_device: torch.device = torch.device("cpu")  # where freed weights come back

    @property
    def device(self) -> torch.device:
        """Where the weights live (while freed: where ``materialize`` puts them back)."""
        p = next(self.parameters())
        return self._weights_device if p.is_meta else p.device

    def _embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _block(
        self, i: int, h: torch.Tensor, positions: torch.Tensor, batch: RaggedBatch | None
    ) -> torch.Tensor:
        raise NotImplementedError

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full-sequence forward: ``[B, T]`` ids (right-padded is fine) -> ``[B, T, V]`` logits."""
        b, t = input_ids.shape
        if t > self.max_seq_len:
            raise TidalError(f"sequence of {t} tokens exceeds max_seq_len {self.max_seq_len}")
        positions = torch.arange(t, device=input_ids.device).expand(b, t)
        h = self._embed(input_ids, positions)
        for i in range(self.n_layers):
            h = self._block(i, h, positions, None)
        return self._head(h)

    def new_cache(self) -> KVCache:
        return KVCache(
            self.n_layers, self.n_kv_heads, self.head_dim, self._param_dtype(), self.device
        )

    def cache_from_tensors(self, tensors: dict[str, torch.Tensor]) -> KVCache:
        """An exported cache (CPU tensors) on this model's device, in its dtype."""
        return KVCache.from_tensors(
            tensors, self.n_layers, self.n_kv_heads, self.head_dim, self.device, self._param_dtype()
        )

    @torch.no_grad()
    def forward_cached(self, tokens: list[list[int]], caches: list[KVCache]) -> torch.Tensor:
        """Feed ``tokens[i]`` to sequence ``i`` (appending to ``caches[i]``); return the logits at
        each sequence's last new token, ``[B, V]``. Sequences may have any cache length. A step
        whose attention mask would pass ``CHUNKED_STEP_ELEMENTS`` (a long prompt: Claude Code's
        first call is ~50K tokens) runs as several steps of at most ``chunk_tokens`` new tokens
        per sequence, so its memory is that of a chunk, not of the whole prompt squared."""
        if not tokens or len(tokens) != len(caches) or any(not t for t in tokens):
            raise TidalError("forward_cached needs one non-empty token list per cache")
        total = max(c.length + len(t) for c, t in zip(caches, tokens, strict=True))
        if total > self.max_seq_len:
            raise TidalError(f"sequence of {total} tokens exceeds max_seq_len {self.max_seq_len}")
        longest = max(len(t) for t in tokens)
        if len(tokens) * longest * total <= CHUNKED_STEP_ELEMENTS:
            return self._step_cached(tokens, caches)
        chunk = chunk_tokens(len(tokens), total)
        last: list[torch.Tensor | None] = [None] * len(tokens)
        for at in range(0, longest, chunk):
            live = [i for i, t in enumerate(tokens) if at < len(t)]
            logits = self._step_cached(
                [tokens[i][at : at + chunk] for i in live], [caches[i] for i in live]
            )
            for row, i in enumerate(live):
                if at + chunk >= len(tokens[i]):
                    last[i] = logits[row]
        return torch.stack(last)  # type: ignore[arg-type]

    def _step_cached(self, tokens: list[list[int]], caches: list[KVCache]) -> torch.Tensor:
        """One forward step of ``forward_cached`` (its checks done)."""
        batch = RaggedBatch(caches, [len(t) for t in tokens])
        ids = torch.zeros((len(tokens), batch.max_new), dtype=torch.long)
        for i, t in enumerate(tokens):
            ids[i, : len(t)] = torch.tensor(t)
        ids = ids.to(batch.device)  # built on CPU: one copy, not one per sequence
        # padding rows of short sequences may run past the context; their outputs are unused
        positions = batch.positions.clamp_max(self.max_seq_len - 1)
        h = self._embed(ids, positions)
        for i in range(self.n_layers):
            h = self._block(i, h, positions, batch)
        last = torch.tensor(batch.new_tokens, device=batch.device) - 1
        h = h[torch.arange(len(tokens), device=batch.device), last]
        batch.commit()
        return self._head(h[:, None, :])[:, 0, :]

    def _param_dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    # -- weights ------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Copy ``state_dict`` into the existing parameters (same storage; no re-allocation);
        tensors may be on another device or of another dtype (e.g. CPU reads into CUDA)."""
        self.check_weights(state_dict, strict=strict, finite=False)  # all before any copy
        own = dict(self.named_parameters())
        # a lazily read file (``loading.WeightFile``) reads each tensor into its parameter
        read_into = getattr(state_dict, "read_into", None)
        for name in state_dict:
            if name not in own:
                continue
            if read_into is not None:
                read_into(name, own[name])
            else:
                own[name].copy_(state_dict[name])

    def check_weights(
        self, state_dict: dict[str, torch.Tensor], strict: bool = True, finite: bool = True
    ) -> None:
        """Raise a ``TidalError`` naming the first tensor of ``state_dict`` that does not fit
        this model: a missing or unknown name (``strict``), another shape, a non-finite value
        (``finite``). Checked whole before a version is served, so a bad one changes nothing."""
        own = dict(self.named_parameters())
        missing = [n for n in own if n not in state_dict and not self._is_tied(n)]
        unknown = [n for n in state_dict if n not in own]
        if strict and (missing or unknown):
            raise TidalError(f"weights do not fit: missing {missing[:3]}, unknown {unknown[:3]}")
        # a lazily read file (``loading.WeightFile``) answers shapes without reading tensors
        shape_of = None if finite else getattr(state_dict, "shape_of", None)
        for name in state_dict:
            if name not in own:
                continue
            tensor = None if shape_of is not None else state_dict[name]
            shape = tuple(shape_of(name) if shape_of is not None else tensor.shape)
            if tuple(own[name].shape) != shape:
                raise TidalError(f"weight {name}: shape {shape} != {tuple(own[name].shape)}")
            if finite and not all_finite(tensor):
                raise TidalError(f"weight {name}: holds NaN or infinite values")

    @torch.no_grad()
    def nonfinite_weight(self) -> str | None:
        """The first parameter holding a NaN or an infinite value, or None (checked on the
        loaded parameters: a sleeping engine loads in one pass and checks after)."""
        for name, param in self.named_parameters():
            if not all_finite(param):
                return name
        return None

    def _is_tied(self, name: str) -> bool:
        return False

    def weights_nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters() if not p.is_meta)

    def free_weights(self) -> None:
        """Release parameter memory (engine sleep); ``materialize`` + ``load_weights`` undo it.
        Whoever calls this holds no other reference to the parameters (or they stay alive)."""
        device = self.device
        self._weights_device = device
        self.to("meta")
        self._retie()
        release_cached(device)

    def materialize(self, device: torch.device | str | None = None) -> None:
        """Fresh, uninitialised parameters on ``device`` (default: where they were freed)."""
        self._weights_device = torch.device(device) if device is not None else self.device
        self.to_empty(device=self._weights_device)
        self._retie()

    def _retie(self) -> None:
        """Subclasses with tied embeddings re-point the head at the embedding."""

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def save(self, out_dir: str | Path) -> None:
        raise NotImplementedError
