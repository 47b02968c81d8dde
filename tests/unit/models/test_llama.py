from __future__ import annotations

import pytest
import torch

from tidal.models import LlamaForCausalLM, load_model


@pytest.mark.slow
def test_llama_matches_transformers_on_smollm2(smollm2_dir):
    transformers = pytest.importorskip("transformers")
    ours, tok = load_model(smollm2_dir)
    assert isinstance(ours, LlamaForCausalLM)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_dir), torch_dtype=torch.float32
    ).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        expected = ref(x).logits[0]
        got = ours(x)[0]
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)
    # incremental decoding with a KV cache reproduces the full forward too
    cache = ours.new_cache()
    last = ours.forward_cached([ids[:-3]], [cache])
    torch.testing.assert_close(last[0], expected[len(ids) - 4], atol=2e-3, rtol=1e-3)
    for j in range(len(ids) - 3, len(ids)):
        step = ours.forward_cached([[ids[j]]], [cache])
        torch.testing.assert_close(step[0], expected[j], atol=2e-3, rtol=1e-3)
    # greedy continuation is an answer in English
    cache = ours.new_cache()
    logits = ours.forward_cached([ids], [cache])
    out = []
    for _ in range(12):
        nxt = int(logits[0].argmax())
        out.append(nxt)
        logits = ours.forward_cached([[nxt]], [cache])
    assert "Paris" in tok.decode(out)
