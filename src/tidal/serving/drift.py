"""Re-tokenization drift, removed where it can be: a harness that re-sends its conversation as
text gets back the token ids the model sampled for its own earlier turns.

In: an execution's recorded calls and the prompt ids its chat template gave the new call. Out:
prompt ids that extend the previous call's prompt + sampled output whenever the re-rendered
conversation's text does (the earlier turns' ids are the sampled ones; only the new text is
tokenized), else the template's ids unchanged (a template that drops earlier reasoning: the
call breaks the chain, which ``records.RecordStore`` counts and training keeps apart).
"""

from __future__ import annotations

import logging

from tidal.contracts.calls import CallRecord
from tidal.serving.protocol import ServingError

log = logging.getLogger(__name__)


async def bridge(adapter, earlier: list[CallRecord], prompt: list[int]) -> list[int] | None:
    """The prompt with the sampled ids of the last call in place, or None (nothing to do: no
    earlier call, the ids extend it already, or its text is not a prefix of the new text).
    ``adapter``: an engine's adapter, for ``detokenize`` and raw ``tokenize``."""
    if not earlier:
        return None
    last = earlier[-1]
    stream = last.prompt_token_ids + last.output_token_ids
    if prompt[: len(stream)] == stream or not last.output_token_ids:
        return None
    try:
        before = await adapter.detokenize(stream)
        now = await adapter.detokenize(prompt)
        if len(now) <= len(before) or not now.startswith(before):
            return None
        rest = await adapter.tokenize(prompt=now[len(before) :], add_special_tokens=False)
    except ServingError as exc:  # an engine without /detokenize: the chain breaks, counted
        log.debug("drift bridge unavailable: %s", exc)
        return None
    return stream + rest
