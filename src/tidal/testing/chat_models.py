"""Tiny chat models for tests of what harnesses send: a tools-capable Hermes/Qwen2.5-style chat
template, a Qwen3-style one that drops earlier turns' reasoning, and a tiny model taught (by a
few hundred optimizer steps) to answer one prompt with one exact text (e.g. a tool call).

In: a directory from ``tidal.models.create_tiny``. Out: the same directory with another chat
template (``set_template``) or other weights (``teach``), written as a user's checkpoint is.
"""

from __future__ import annotations

from pathlib import Path

# Qwen2.5's tool format (Hermes): tools listed as JSON in the system turn, calls as
# <tool_call>{json}</tool_call>, results as <tool_response> in a user turn.
_HEAD = (
    "{%- if tools %}{{ '<|im_start|>system\n' }}"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}"
    "{%- else %}{{ 'You are a helpful assistant.' }}{%- endif %}"
    "{{ '\n\n# Tools\n\n<tools>\n' }}{%- for tool in tools %}{{ tool | tojson }}{{ '\n' }}"
    "{%- endfor %}{{ '</tools>\n\nFor each function call, return a json object with function "
    "name and arguments within <tool_call></tool_call> XML tags.<|im_end|>\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{ '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}{%- endif %}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}"
)
_ASSISTANT_ALL = "{%- set content = message.content or '' %}"
# Qwen3: an assistant turn before the last user turn loses its <think>...</think> part
_ASSISTANT_STRIP = (
    "{%- set content = message.content or '' %}"
    "{%- if loop.index0 < ns.last_user and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}"
)
_TAIL = (
    "{{ '<|im_start|>assistant\n' + content }}"
    "{%- for tc in message.tool_calls or [] %}"
    '{{ \'\n<tool_call>\n{"name": "\' + tc.function.name + \'", "arguments": \' }}'
    "{{ tc.function.arguments | tojson }}{{ '}\n</tool_call>' }}{%- endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response>"
    "<|im_end|>\n' }}"
    "{%- else %}{{ '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)
HERMES_TOOLS_TEMPLATE = _HEAD + _ASSISTANT_ALL + _TAIL
QWEN3_STRIP_THINK_TEMPLATE = _HEAD + _ASSISTANT_STRIP + _TAIL


def set_template(model_dir: str | Path, template: str) -> Path:
    """Write ``template`` as the directory's chat template (tokenizer files rewritten)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.chat_template = template
    tok.save_pretrained(str(model_dir))
    return Path(model_dir)


def teach(
    model_dir: str | Path,
    prompt_ids: list[int],
    answer_ids: list[int],
    steps: int = 300,
    lr: float = 3e-3,
    seed: int = 0,
) -> int:
    """Train the directory's model until greedy decoding of ``prompt_ids`` yields
    ``answer_ids`` (loss on the answer only; checked every 25 steps), save it, and return the
    steps taken. Raises ``AssertionError`` if ``steps`` were not enough."""
    import torch

    from tidal.models.hf import load_training_model

    torch.manual_seed(seed)
    model = load_training_model(model_dir)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    ids = torch.tensor([prompt_ids + answer_ids])
    labels = ids.clone()
    labels[0, : len(prompt_ids)] = -100
    for step in range(1, steps + 1):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 25 == 0 and _greedy_matches(model, ids, len(prompt_ids)):
            model.save_pretrained(str(model_dir), safe_serialization=True)
            return step
    raise AssertionError(
        f"the model did not learn the answer in {steps} steps (loss {float(loss):.3f})"
    )


def _greedy_matches(model, ids, n_prompt: int) -> bool:
    """Teacher-forced greedy check: every answer token is the argmax after its prefix (what
    greedy decoding then reproduces token by token)."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    predicted = logits[n_prompt - 1 : -1].argmax(-1)
    return bool((predicted == ids[0, n_prompt:]).all())


def shorten_answers(model_dir: str | Path, shift: float = 0.3, eos: float = 0.8) -> None:
    """Make a tiny model's sampled answers end after a few tokens (about 8 on average at
    temperature 1, measured over 8 samples: 1 to 22), for plumbing runs of harnesses that take
    an answer cut at ``max_tokens`` as an error (Claude Code does). Every token embedding gets
    ``shift`` on dimension 0, EOS gets ``eos``: the residual stream carries dimension 0, and with
    tied embeddings EOS's logit leads every other by about ``eos - shift`` times its normalized
    value. The weights stay a user's checkpoint (safetensors)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tidal.models.tokenizer import HFTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    if not model.config.tie_word_embeddings:
        raise ValueError(f"{model_dir}: shorten_answers needs tied embeddings")
    emb = model.get_input_embeddings().weight
    with torch.no_grad():
        emb[:, 0] = shift
        emb[HFTokenizer(model_dir).eos_id, 0] = eos
    model.save_pretrained(str(model_dir), safe_serialization=True)
