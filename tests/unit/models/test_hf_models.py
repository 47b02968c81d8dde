"""The built-in engine's model against transformers on the same HF directories (tiny Llama,
tiny Qwen2), its cached path against its full forward, in-place weight loads, and the refusal of
architectures it does not implement."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tidal.errors import TidalError
from tidal.models import create_tiny, load_model, load_training_model, read_weights


def _greedy_builtin(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    cache = model.new_cache()
    logits = model.forward_cached([prompt], [cache])
    out, logps = [], []
    for _ in range(n):
        nxt = int(logits[0].argmax())
        out.append(nxt)
        logps.append(float(torch.log_softmax(logits[0], -1)[nxt]))
        logits = model.forward_cached([[nxt]], [cache])
    return out, logps


@pytest.mark.parametrize("fixture", ["tiny_dir", "tiny_qwen2_dir"])
def test_builtin_engine_matches_transformers(fixture, request):
    """Greedy tokens equal and their log-probs within 1e-4 of the HF model's."""
    mdir = request.getfixturevalue(fixture)
    ours, tok = load_model(mdir)
    ref = load_training_model(mdir).eval()
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 12 plus 30?"}])
    got, got_lp = _greedy_builtin(ours, prompt, 24)
    with torch.no_grad():
        x = torch.tensor([prompt])  # the prompt holds <|im_end|> (= pad): mask nothing
        gen = ref.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=24,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=None,
            pad_token_id=tok.eos_id,
        )
    want = gen.sequences[0, len(prompt) :].tolist()
    want_lp = [float(torch.log_softmax(s[0], -1)[t]) for s, t in zip(gen.logits, want, strict=True)]
    assert got == want
    torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(want_lp), atol=1e-4, rtol=0)


def test_cached_ragged_batch_matches_full_forward(tiny_dir):
    model, tok = load_model(tiny_dir)
    seqs = [
        tok.encode("The agent reads the task and lists the files."),
        tok.encode("12 plus 30 is 42"),
        tok.encode("Read the file"),
    ]
    full = [model(torch.tensor([s]))[0] for s in seqs]
    caches = [model.new_cache() for _ in seqs]
    cut = [5, 2, 1]  # different prefix lengths in one ragged call, then one token at a time
    out = model.forward_cached([s[:c] for s, c in zip(seqs, cut, strict=True)], caches)
    for i, c in enumerate(cut):
        torch.testing.assert_close(out[i], full[i][c - 1], atol=1e-5, rtol=1e-4)
    pos = list(cut)
    while any(p < len(s) for p, s in zip(pos, seqs, strict=True)):
        live = [i for i, s in enumerate(seqs) if pos[i] < len(s)]
        out = model.forward_cached([[seqs[i][pos[i]]] for i in live], [caches[i] for i in live])
        for row, i in enumerate(live):
            torch.testing.assert_close(out[row], full[i][pos[i]], atol=1e-5, rtol=1e-4)
            pos[i] += 1
    assert [c.length for c in caches] == [len(s) for s in seqs]


def test_long_prefill_runs_chunked_with_the_same_logits(tiny_dir, monkeypatch):
    """A step over the mask limit (a long prompt) runs in chunks of new tokens: the logits at
    each sequence's last token and the caches match one unchunked step's, ragged batch and
    cached prefixes included."""
    from tidal.models import base

    assert base.chunk_tokens(1, 52_000) == (1 << 26) // 52_000  # ~1290 of Claude Code's 50K
    assert base.chunk_tokens(16, 1 << 20) == 256
    model, tok = load_model(tiny_dir)
    seqs = [
        tok.encode("The agent reads the task and lists the files in the workspace. " * 12),
        tok.encode("12 plus 30 is 42"),
        tok.encode("Read the file notes.txt and fix the bug in calc.py " * 6),
    ]
    prefix = [3, 0, 7]  # already cached before the long step
    whole, chunked = [model.new_cache() for _ in seqs], [model.new_cache() for _ in seqs]
    for caches in (whole, chunked):
        for s, p, c in zip(seqs, prefix, caches, strict=True):
            if p:
                model.forward_cached([s[:p]], [c])
    ref = model.forward_cached([s[p:] for s, p in zip(seqs, prefix, strict=True)], whole)
    monkeypatch.setattr(base, "CHUNKED_STEP_ELEMENTS", 64)
    monkeypatch.setattr(base, "chunk_tokens", lambda sequences, keys: 16)
    got = model.forward_cached([s[p:] for s, p in zip(seqs, prefix, strict=True)], chunked)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    for a, b in zip(whole, chunked, strict=True):
        assert a.length == b.length
        torch.testing.assert_close(a.buffers(0, a.length), b.buffers(0, b.length))


def test_kv_export_import_continues_identically(tiny_dir):
    model, tok = load_model(tiny_dir)
    ids = tok.encode("The workspace holds files such as notes.txt")
    cache = model.new_cache()
    model.forward_cached([ids[:-1]], [cache])
    moved = model.cache_from_tensors(cache.export_tensors())
    assert moved.length == len(ids) - 1
    torch.testing.assert_close(
        model.forward_cached([ids[-1:]], [cache]), model.forward_cached([ids[-1:]], [moved])
    )


def test_weights_load_in_place_and_free_and_restore(tiny_dir, tmp_path):
    model, _ = load_model(tiny_dir)
    ids = torch.tensor([[1, 2, 3, 4]])
    before = model(ids).detach()
    other_dir = create_tiny(tmp_path / "v2", seed=9, n_layers=2, d_model=64, max_seq_len=256)
    other, _ = load_model(other_dir)
    storage = model.model.embed_tokens.weight.data_ptr()
    model.load_weights(read_weights(other_dir / "model.safetensors"))
    assert model.model.embed_tokens.weight.data_ptr() == storage
    torch.testing.assert_close(model(ids), other(ids))
    model.free_weights()
    assert model.weights_nbytes() == 0
    model.materialize()
    model.load_weights(read_weights(tiny_dir))
    torch.testing.assert_close(model(ids).detach(), before)


def test_ragged_batch_near_the_context_end(tiny_dir):
    model, _ = load_model(tiny_dir)
    long_cache, short_cache = model.new_cache(), model.new_cache()
    model.forward_cached([[3] * (model.max_seq_len - 2)], [long_cache])
    out = model.forward_cached([[4], [5] * 100], [long_cache, short_cache])
    assert torch.isfinite(out).all() and long_cache.length == model.max_seq_len - 1


def test_other_architectures_are_refused_naming_vllm(tiny_dir, tmp_path):
    shutil.copytree(tiny_dir, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "model_type": "gemma3"}))
    with pytest.raises(TidalError, match=r"model_type 'gemma3' has no built-in engine path.*vLLM"):
        load_model(tmp_path / "m")
    with pytest.raises(TidalError, match=r"no config\.json"):
        load_training_model(tmp_path / "missing")
