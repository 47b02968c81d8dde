from __future__ import annotations

import torch

from tidal.models import TinyGPT, load_model, read_weights


def test_cached_ragged_batch_matches_full_forward(tiny_dir):
    model, tok = load_model(tiny_dir)
    seqs = [tok.encode("The agent reads the task and lists the files."),
            tok.encode("12 plus 30 is 42"), tok.encode("Read the file")]
    full = [model(torch.tensor([s]))[0] for s in seqs]
    caches = [model.new_cache() for _ in seqs]
    # prefill different prefix lengths in one ragged call, then decode one token at a time
    cut = [5, 2, 1]
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


def test_kv_export_import_continues_identically(tiny_dir):
    model, tok = load_model(tiny_dir)
    ids = tok.encode("The workspace holds files such as notes.txt")
    cache = model.new_cache()
    model.forward_cached([ids[:-1]], [cache])
    moved = model.cache_from_tensors(cache.export_tensors())
    assert moved.length == len(ids) - 1
    a = model.forward_cached([ids[-1:]], [cache])
    b = model.forward_cached([ids[-1:]], [moved])
    torch.testing.assert_close(a, b)


def test_full_forward_is_differentiable(tiny_dir):
    model, _ = load_model(tiny_dir)
    ids = torch.randint(0, model.vocab_size, (2, 16))
    logp = torch.log_softmax(model(ids[:, :-1]), -1).gather(-1, ids[:, 1:, None]).sum()
    logp.backward()
    assert model.wte.weight.grad is not None and torch.isfinite(model.wte.weight.grad).all()


def test_weights_load_in_place_and_free_and_restore(tiny_dir, tmp_path):
    model, _ = load_model(tiny_dir)
    ids = torch.tensor([[1, 2, 3, 4]])
    before = model(ids).detach()
    other = TinyGPT(model.cfg)
    other.save(tmp_path / "v2")
    storage = model.wte.weight.data_ptr()
    model.load_weights(read_weights(tmp_path / "v2" / "model.safetensors"))
    assert model.wte.weight.data_ptr() == storage
    torch.testing.assert_close(model(ids), other(ids))
    model.free_weights()
    assert model.weights_nbytes() == 0
    model.materialize()
    model.load_weights(read_weights(tiny_dir / "model.safetensors"))
    torch.testing.assert_close(model(ids).detach(), before)


def test_ragged_batch_near_the_context_end(tiny_dir):
    model, _ = load_model(tiny_dir)
    long_cache, short_cache = model.new_cache(), model.new_cache()
    model.forward_cached([[3] * (model.max_seq_len - 2)], [long_cache])
    # one sequence near the end of the context next to one with a long new chunk
    out = model.forward_cached([[4], [5] * 100], [long_cache, short_cache])
    assert torch.isfinite(out).all() and long_cache.length == model.max_seq_len - 1
