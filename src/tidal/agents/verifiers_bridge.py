"""A verifiers renderer that keeps a multi-turn chain: the next turn's prompt ids are the last
turn's prompt and sampled ids verbatim, then the ids the chat template adds for the new
messages.

Why: ``renderers``' ``DefaultRenderer`` (every model without a hand-coded renderer, e.g. SmolLM2
or a tiny model) never bridges (``bridge_to_next_turn`` returns ``None``), so verifiers'
``TrainClient`` re-renders the whole conversation each turn and re-tokenizes the earlier turns'
sampled text; where that tokenizes differently from what the engine sampled, the turn's prompt
no longer extends the last one and the record's token chain breaks (3 of 24 calls of
``configs/verifiers-multiturn.yaml`` on 2026-12-05).

How: the template's text for what follows a closed assistant turn is read off two renders of a
probe conversation (``[user, assistant]`` and the same with the new messages and the generation
prompt); a template whose render of the probe is not a prefix of the longer one (it is not
turn-local) gets ``None``, and verifiers re-renders as before. The assistant's close (e.g.
``<|im_end|>\\n``) is added after the sampled ids, less the stop token the model sampled itself.

In: the previous turn's prompt and sampled ids, the new (user / tool) messages. Out:
``RenderedTokens`` whose ids start with the previous ids unchanged, the added ones attributed to
their new message (``-1``: separators and the generation prompt).
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

from renderers.base import RenderedTokens, extract_message_tool_names
from renderers.configs import DefaultRendererConfig
from renderers.default import DefaultRenderer

IMPORT_PATH = "tidal.agents.verifiers_bridge.ChainRenderer"
_USER, _ANSWER = "\x00tidal-probe-user", "\x00tidal-probe-answer"


class ChainRenderer(DefaultRenderer):
    """``DefaultRenderer`` (the model's own chat template, verbatim) whose
    ``bridge_to_next_turn`` keeps the sampled ids."""

    config_class = DefaultRendererConfig

    def bridge_to_next_turn(
        self,
        previous_prompt_ids: list[int],
        previous_completion_ids: list[int],
        new_messages: list[Any],
        *,
        tools: list[Any] | None = None,
        **_: Any,
    ) -> RenderedTokens | None:
        if not new_messages or any(m.get("role") == "assistant" for m in new_messages):
            return None
        probe = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ANSWER}]
        texts = [self._text(probe, tools)]
        for i in range(len(new_messages)):
            texts.append(self._text(probe + list(new_messages[: i + 1]), tools))
        texts.append(self._text(probe + list(new_messages), tools, generation=True))
        if any(not b.startswith(a) for a, b in pairwise(texts)):
            return None  # not turn-local: re-render
        closed = texts[0]
        at = closed.rfind(_ANSWER)
        if at < 0:
            return None
        close = closed[at + len(_ANSWER) :]
        stops = set(self.get_stop_token_ids())
        if previous_completion_ids and previous_completion_ids[-1] in stops:
            sampled_close = self._tokenizer.decode([previous_completion_ids[-1]])
            if not close.startswith(sampled_close):
                return None
            close = close[len(sampled_close) :]
        ids = [*previous_prompt_ids, *previous_completion_ids]
        owners = [-1] * len(ids)
        pieces = [(close, -1)]
        pieces += [(b[len(a) :], i) for i, (a, b) in enumerate(pairwise(texts[:-1]))]
        pieces.append((texts[-1][len(texts[-2]) :], -1))
        for text, owner in pieces:
            added = self._tokenizer.encode(text, add_special_tokens=False) if text else []
            ids += added
            owners += [owner] * len(added)
        return RenderedTokens(
            token_ids=ids,
            message_indices=owners,
            message_roles=[m.get("role") or "" for m in new_messages],
            message_tool_names=extract_message_tool_names(new_messages),
        )

    def _text(self, messages: list[Any], tools: list[Any] | None, generation: bool = False) -> str:
        kwargs = dict(self.config.model_extra or {})
        if tools is not None:
            kwargs["tools"] = tools
        return self._tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation, **kwargs
        )
