from __future__ import annotations

from tidal.models.tokenizer import ByteBPETokenizer, bundled_corpus


def test_bpe_round_trips_any_text_and_compresses_the_corpus(tmp_path):
    tok = ByteBPETokenizer.train(bundled_corpus(), 200)
    text = "The agent writes answer.txt: 12 plus 30 is 42 — ünïcode ✓ <|eos|>"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.eos_id in ids
    corpus = bundled_corpus()
    assert len(tok.encode(corpus)) < 0.6 * len(corpus.encode())
    tok.save(tmp_path / "tok.json")
    again = ByteBPETokenizer.load(tmp_path / "tok.json")
    assert again.encode(text) == ids and again.vocab_size == tok.vocab_size


def test_chat_template_marks_roles():
    tok = ByteBPETokenizer.train(bundled_corpus(), 50)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids[0] == tok.bos_id
    assert tok.decode(ids[1:]).endswith("<|assistant|>")
