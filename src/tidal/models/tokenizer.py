"""The tokenizer and chat template of a model directory, from ``transformers`` (one source of truth
for the engine, the trainer and the records).

In: a Hugging Face model directory (``tokenizer.json``, ``tokenizer_config.json``, the chat
template in ``chat_template.jinja`` or the config). Out: ``HFTokenizer`` with the small surface the
engine uses (``encode``, ``decode``, ``decode_token``, ``apply_chat_template``, ``eos_id``,
``vocab_size``). Chat templates are rendered by ``transformers`` itself, so a template's own
helpers (``raise_exception``, ``tojson``, ``strftime_now``) behave as they do for every other
consumer of the checkpoint; a template that raises is a one-line ``TidalError``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from tidal.errors import TidalError


class Tokenizer(Protocol):
    eos_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def apply_chat_template(
        self, messages: list[dict], tools: list[dict] | None = None
    ) -> list[int]: ...


class HFTokenizer:
    """``transformers.AutoTokenizer`` of a model directory, behind the engine's surface."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        model_dir = Path(model_dir)
        try:
            self.hf = AutoTokenizer.from_pretrained(str(model_dir))
        except (OSError, ValueError) as exc:
            raise TidalError(
                f"{model_dir}: no tokenizer transformers can read: {str(exc).splitlines()[0]}"
            ) from exc
        if self.hf.eos_token_id is None:
            raise TidalError(f"{model_dir}: tokenizer_config.json names no eos_token")
        self.eos_id: int = int(self.hf.eos_token_id)
        self.vocab_size: int = len(self.hf)
        self.has_chat_template = bool(self.hf.chat_template)
        # transformers renders ``tools=`` only where the template reads ``tools``; any other
        # template would drop the tool definitions without a word
        self.renders_tools = "tools" in str(self.hf.chat_template or "")

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=False)

    def decode_token(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.vocab_size:
            raise TidalError(f"token id {token_id} outside vocabulary of {self.vocab_size}")
        return self.decode([token_id]).encode("utf-8")

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The prompt text of ``messages`` (and ``tools``, OpenAI's function definitions) with
        the generation prompt appended."""
        if not self.has_chat_template:
            raise TidalError("this model directory has no chat template; send a raw prompt")
        if tools and not self.renders_tools:
            raise TidalError("tools: this model's chat template has no tool support")
        try:
            return self.hf.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # jinja2's TemplateError and the template's raise_exception
            raise TidalError(f"chat template: {str(exc).splitlines()[0]}") from exc

    def apply_chat_template(
        self, messages: list[dict], tools: list[dict] | None = None
    ) -> list[int]:
        return self.encode(self.render_chat(messages, tools))
