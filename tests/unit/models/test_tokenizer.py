"""Chat templates rendered by transformers: parity with the reference rendering of SmolLM2's
template, the tiny model speaking the same format, and the template's own helpers."""

from __future__ import annotations

import shutil

import pytest

from tidal.errors import TidalError
from tidal.models import HFTokenizer

CHATS = [
    [{"role": "user", "content": "What is 12 plus 30?"}],
    [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "7 * 6 = ?"},
        {"role": "assistant", "content": "42"},
        {"role": "user", "content": "and 40 + 2?\n\nunicode: é ✓"},
    ],
]


@pytest.mark.parametrize("messages", CHATS)
def test_smollm2_template_parity_with_transformers(smollm2_dir, messages):
    from transformers import AutoTokenizer

    ours = HFTokenizer(smollm2_dir)
    ref = AutoTokenizer.from_pretrained(str(smollm2_dir))
    want = ref.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ours.apply_chat_template(messages) == list(want)
    text = ours.render_chat(messages)
    assert text.endswith("<|im_start|>assistant\n") and messages[-1]["content"] in text
    assert ours.decode(ours.apply_chat_template(messages)) == text


def test_tiny_model_speaks_smollm2s_format(tiny_dir, smollm2_dir):
    tiny, smol = HFTokenizer(tiny_dir), HFTokenizer(smollm2_dir)
    for messages in CHATS:
        assert tiny.render_chat(messages) == smol.render_chat(messages)
        assert tiny.decode(tiny.apply_chat_template(messages)) == tiny.render_chat(messages)
    assert tiny.decode([tiny.eos_id]) == "<|im_end|>"
    text = "The agent reads notes.txt: 12 + 30 = 42 ✓"
    assert tiny.decode(tiny.encode(text)) == text
    with pytest.raises(TidalError, match="outside vocabulary"):
        tiny.decode_token(tiny.vocab_size)


def test_template_helpers_and_errors(tiny_dir, tmp_path):
    shutil.copytree(tiny_dir, tmp_path / "m")
    (tmp_path / "m" / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('roles must be user or assistant') }}{% endif %}"
        "{{ m['content'] | tojson }}{% endfor %}"
    )
    tok = HFTokenizer(tmp_path / "m")
    assert tok.render_chat([{"role": "user", "content": 'say "hi"'}]) == '"say \\"hi\\""'
    with pytest.raises(TidalError, match="chat template: roles must be user or assistant"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
