"""A request's KV blocks out of a paged KV cache and into another, on any device and layout:
the tensor half of tidal's vLLM KV connector (``serving.vllm_kv_connector``), kept free of vLLM
so it runs (and is tested) wherever torch does.

In: the cache tensors of every attention layer (vLLM's ``register_kv_caches``: one per layer,
some layers may share one) and the cache's block count; block ids. Out: ``save_blocks``: the
blocks' bytes, layer after layer, on the CPU; ``load_blocks``: those bytes copied into other
block ids of a cache with the same layout (on its device).

Layouts: the block dimension is the one of ``num_blocks`` entries, dim 0 first (vLLM-CPU
``[blocks, kv_heads, block_size, 2 * head]``, FlashAttention ``[blocks, 2, block_size, heads,
head]``), then dim 1 (the older ``[2, blocks, block_size, heads, head]``), then any.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def block_dim(shape: Sequence[int], num_blocks: int | None) -> int:
    """The dimension of ``shape`` that indexes blocks (``ValueError`` if none can)."""
    if num_blocks is None:
        return 0
    for d in (0, 1, *range(2, len(shape))):
        if d < len(shape) and shape[d] == num_blocks:
            return d
    raise ValueError(f"no dimension of {tuple(shape)} holds {num_blocks} blocks")


def cache_layers(
    kv_caches: Mapping[str, torch.Tensor], num_blocks: int | None
) -> list[tuple[torch.Tensor, int]]:
    """Each distinct cache tensor (layers sharing one counted once), in layer-name order,
    with its block dimension."""
    seen, out = set(), []
    for _, t in sorted(kv_caches.items()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out.append((t, block_dim(t.shape, num_blocks)))
    return out


def block_bytes(layers: list[tuple[torch.Tensor, int]]) -> int:
    """Bytes of one block over every layer."""
    return sum(t.numel() // t.shape[d] * t.element_size() for t, d in layers)


def save_blocks(layers: list[tuple[torch.Tensor, int]], block_ids: list[int]) -> torch.Tensor:
    """The blocks ``block_ids`` of every layer, as one flat uint8 CPU tensor."""
    parts = []
    for t, d in layers:
        ids = torch.tensor(block_ids, dtype=torch.long, device=t.device)
        parts.append(t.index_select(d, ids).cpu().contiguous().view(torch.uint8).reshape(-1))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def load_blocks(
    layers: list[tuple[torch.Tensor, int]],
    raw: torch.Tensor,
    src_first: int,
    block_ids: list[int],
) -> None:
    """Copy saved blocks ``src_first ..`` of ``raw`` (``save_blocks``' bytes of some number of
    blocks) into ``block_ids`` of each layer. A size that does not fit: ``ValueError``."""
    per_block = block_bytes(layers)
    size = raw.numel()
    n_src, n = (size // per_block if per_block else 0), len(block_ids)
    if not per_block or size % per_block or src_first + n > n_src:
        raise ValueError(f"{size} bytes do not hold blocks {src_first}..+{n}")
    off = 0
    for t, d in layers:
        shape = list(t.shape)
        shape[d] = n_src
        nbytes = t.numel() // t.shape[d] * n_src * t.element_size()
        src = raw[off : off + nbytes].view(t.dtype).view(shape).narrow(d, src_first, n)
        dst = torch.tensor(block_ids, dtype=torch.long, device=t.device)
        t.index_copy_(d, dst, src.to(t.device))
        off += nbytes
