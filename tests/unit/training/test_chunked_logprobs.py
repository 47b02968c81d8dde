"""Chunked log-probs (issue 25): the output head and its log-normaliser a chunk of rows at a
time equal the full-logits path, values and gradients, to float32 rounding."""

from __future__ import annotations

import pytest
import torch

from tidal.models.hf import tiny_model
from tidal.training.loss import target_logprobs
from tidal.training.worker import forward_logits, model_logprobs


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_chunked_logprobs_match_full_logits_and_their_gradients(arch):
    torch.manual_seed(0)
    model = tiny_model(arch, 0, 97, n_layers=2, n_heads=2, d_model=16, d_ff=32, max_seq_len=32)
    ids = torch.randint(0, 97, (3, 11))
    full = target_logprobs(forward_logits(model, ids), ids)
    full.sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    chunked = model_logprobs(model, ids, chunk_tokens=7)  # 30 rows: chunks of 7, 7, 7, 7, 2
    torch.testing.assert_close(chunked, full, rtol=0, atol=1e-5)
    chunked.sum().backward()
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-6, msg=n)
    with torch.no_grad():
        torch.testing.assert_close(model_logprobs(model, ids, 5), full.detach(), atol=1e-5, rtol=0)
