"""Tokenizers: the project's own byte-level BPE, and a wrapper over Hugging Face ``tokenizers``.

In: text (or chat messages). Out: token ids, and back. Both classes share one small surface
(``encode``, ``decode``, ``decode_token``, ``apply_chat_template``, ``eos_id``, ``vocab_size``) so
the engine does not care which model family it serves.

``ByteBPETokenizer`` is trained on bundled text (``data/corpus.txt``) and saved as JSON; every byte
sequence round-trips because the base vocabulary is the 256 bytes.
"""

from __future__ import annotations

import itertools
import json
import re
from collections import Counter
from importlib import resources
from pathlib import Path
from typing import Protocol

from tidal.errors import TidalError

_WORD_RE = re.compile(r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+")
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")


class Tokenizer(Protocol):
    eos_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]: ...


def bundled_corpus() -> str:
    return resources.files("tidal.models").joinpath("data/corpus.txt").read_text("utf-8")


class ByteBPETokenizer:
    """Byte-level BPE: 256 byte tokens, then special tokens, then one token per merge."""

    def __init__(self, merges: list[tuple[int, int]]) -> None:
        self.merges = [tuple(m) for m in merges]
        self.special = {tok: 256 + i for i, tok in enumerate(SPECIAL_TOKENS)}
        first_merge_id = 256 + len(SPECIAL_TOKENS)
        self._rank = {pair: i for i, pair in enumerate(self.merges)}
        self._bytes: list[bytes] = [bytes([i]) for i in range(256)]
        self._bytes += [tok.encode() for tok in SPECIAL_TOKENS]
        for a, b in self.merges:
            self._bytes.append(self._bytes[a] + self._bytes[b])
        self._merge_id = {pair: first_merge_id + i for i, pair in enumerate(self.merges)}
        self.vocab_size = len(self._bytes)
        self.bos_id = self.special["<|bos|>"]
        self.eos_id = self.special["<|eos|>"]
        self._cache: dict[str, list[int]] = {}
        self._special_re = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")

    @classmethod
    def train(cls, text: str, num_merges: int) -> ByteBPETokenizer:
        words = Counter(_WORD_RE.findall(text))
        seqs = {w: list(w.encode("utf-8")) for w in words}
        merges: list[tuple[int, int]] = []
        next_id = 256 + len(SPECIAL_TOKENS)
        for _ in range(num_merges):
            pairs: Counter[tuple[int, int]] = Counter()
            for w, seq in seqs.items():
                for pair in itertools.pairwise(seq):
                    pairs[pair] += words[w]
            if not pairs:
                break
            best, count = max(pairs.items(), key=lambda kv: (kv[1], -kv[0][0], -kv[0][1]))
            if count < 2:
                break
            merges.append(best)
            for w, seq in seqs.items():
                seqs[w] = _merge(seq, best, next_id)
            next_id += 1
        return cls(merges)

    def _encode_word(self, word: str) -> list[int]:
        cached = self._cache.get(word)
        if cached is not None:
            return cached
        seq = list(word.encode("utf-8"))
        while len(seq) > 1:
            pairs = [(self._rank.get(p, 1 << 30), p) for p in itertools.pairwise(seq)]
            rank, pair = min(pairs)
            if rank == 1 << 30:
                break
            seq = _merge(seq, pair, self._merge_id[pair])
        if len(self._cache) < 100_000:
            self._cache[word] = seq
        return seq

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self._special_re.split(text):
            if piece in self.special:
                ids.append(self.special[piece])
            elif piece:
                for word in _WORD_RE.findall(piece):
                    ids.extend(self._encode_word(word))
        return ids

    def decode_token(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.vocab_size:
            raise TidalError(f"token id {token_id} outside vocabulary of {self.vocab_size}")
        return self._bytes[token_id]

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.decode_token(i) for i in ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        text = "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in messages)
        return [self.bos_id, *self.encode(text + "<|assistant|>")]

    def save(self, path: str | Path) -> None:
        data = {"type": "tidal-byte-bpe", "special_tokens": list(SPECIAL_TOKENS),
                "merges": [list(m) for m in self.merges]}
        Path(path).write_text(json.dumps(data))

    @classmethod
    def load(cls, path: str | Path) -> ByteBPETokenizer:
        data = json.loads(Path(path).read_text())
        if data.get("type") != "tidal-byte-bpe" or data["special_tokens"] != list(SPECIAL_TOKENS):
            raise TidalError(f"{path}: not a tidal byte-BPE tokenizer")
        return cls([tuple(m) for m in data["merges"]])


def _merge(seq: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    out: list[int] = []
    i = 0
    while i < len(seq):
        if i + 1 < len(seq) and seq[i] == pair[0] and seq[i + 1] == pair[1]:
            out.append(new_id)
            i += 2
        else:
            out.append(seq[i])
            i += 1
    return out


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` plus the chat template of ``tokenizer_config.json``."""

    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer as _HFTok

        model_dir = Path(model_dir)
        self._tok = _HFTok.from_file(str(model_dir / "tokenizer.json"))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self._template = cfg.get("chat_template")
        if not self._template and (model_dir / "chat_template.jinja").is_file():
            self._template = (model_dir / "chat_template.jinja").read_text()
        eos = cfg.get("eos_token") or "<|im_end|>"
        eos = eos["content"] if isinstance(eos, dict) else eos
        eos_id = self._tok.token_to_id(eos)
        self.eos_id = eos_id if eos_id is not None else 0
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def decode_token(self, token_id: int) -> bytes:
        return self.decode([token_id]).encode("utf-8")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if self._template:
            import jinja2

            env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
            text = env.from_string(self._template).render(
                messages=messages, add_generation_prompt=True)
        else:
            text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
                           for m in messages) + "<|im_start|>assistant\n"
        return self.encode(text)
