"""A deterministic engine (``EngineConfig.deterministic``, a ``runtime.deterministic`` run)
gives a seeded request the same tokens and log-probs, bit for bit, whatever else shares its
batch, and a call moved after n tokens (re-prefilled on another engine with
``continued_seed``, or continued there from the first engine's exported KV) goes on with
exactly the tokens and log-probs it would have had unmoved."""

from __future__ import annotations

import asyncio

from tidal.models import load_model
from tidal.seeding import call_seed, continued_seed
from tidal.serving.engine import Engine, EngineConfig
from tidal.serving.protocol import GenerateRequest, SamplingParams

PROMPT = [5, 6, 7, 8, 9, 10, 11]


async def _gen(
    engine: Engine, rid: str, prompt: list[int], kv_handle: str | None = None, **params
) -> tuple[list[int], list[float]]:
    req = GenerateRequest(rid, prompt, SamplingParams(ignore_eos=True, **params), kv_handle)
    chunks = [c async for c in engine.generate(req)]
    return ([t for c in chunks for t in c.token_ids], [x for c in chunks for x in c.logprobs])


def _run(tiny_dir, body, deterministic=True):
    async def main():
        engines = []
        for seed in (1, 2):
            model, tok = load_model(tiny_dir)
            engines.append(
                Engine(
                    model,
                    tok,
                    tiny_dir,
                    EngineConfig(seed=seed, max_batch=8, deterministic=deterministic),
                )
            )
        for e in engines:
            await e.start()
        try:
            return await body(*engines)
        finally:
            for e in engines:
                await e.stop()

    return asyncio.run(main())


def test_batch_mates_change_no_bit(tiny_dir):
    seed = call_seed(0, "b0-g0-e0", 0)

    async def body(a, b):
        alone = await _gen(a, "x", PROMPT, max_tokens=24, seed=seed)
        # the same call beside prompts of other lengths, started at other moments
        crowd = [
            _gen(
                b, f"o{i}", list(range(3, 3 + 5 * i)), max_tokens=30, seed=call_seed(0, "other", i)
            )
            for i in range(1, 6)
        ]
        together = await asyncio.gather(
            *crowd[:3], _gen(b, "x", PROMPT, max_tokens=24, seed=seed), *crowd[3:]
        )
        return alone, together[3]

    alone, together = _run(tiny_dir, body)
    assert len(alone[0]) == 24
    assert alone == together  # token ids and float log-probs, exactly


def test_a_moved_call_goes_on_bit_for_bit(tiny_dir):
    seed, n = call_seed(3, "b1-g0-e2", 0), 9

    async def body(a, b):
        whole = await _gen(a, "w", PROMPT, max_tokens=20, seed=seed)
        head = await _gen(a, "h", PROMPT, max_tokens=n, seed=seed)
        # re-prefill on another engine: prompt + tokens so far, the continued seed
        tail = await _gen(b, "t", PROMPT + head[0], max_tokens=20 - n, seed=continued_seed(seed, n))
        # KV handoff: the first engine's cache, pinned at an abort, imported by the second
        held = asyncio.ensure_future(_gen(a, "k", PROMPT, max_tokens=20, seed=seed))
        while a.stats()["generated_tokens"] < 20 + n + 4:  # some tokens of "k" are out
            await asyncio.sleep(0)
        a.abort(["k"], keep_kv=True)
        part = await held
        handle, _ = await b.import_kv(await a.export_kv("k"))
        rest = await _gen(
            b,
            "r",
            PROMPT + part[0],
            kv_handle=handle,
            max_tokens=20 - len(part[0]),
            seed=continued_seed(seed, len(part[0])),
        )
        return whole, head, tail, part, rest

    whole, head, tail, part, rest = _run(tiny_dir, body)
    assert head[0] + tail[0] == whole[0] and head[1] + tail[1] == whole[1]
    assert 0 < len(part[0]) < 20
    assert part[0] + rest[0] == whole[0] and part[1] + rest[1] == whole[1]
