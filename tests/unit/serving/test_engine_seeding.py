"""A seeded request samples the same tokens on any engine instance, whatever the engine's own
seed; another execution's seed draws another stream; a call continued on a second engine
after n tokens (``continued_seed``) goes on exactly as it would have on the first."""

from __future__ import annotations

import asyncio

from tidal.models import load_model
from tidal.seeding import call_seed, continued_seed
from tidal.serving.engine import Engine, EngineConfig
from tidal.serving.protocol import GenerateRequest, SamplingParams

PROMPT = [5, 6, 7, 8, 9]


async def _tokens(engine: Engine, rid: str, prompt: list[int], **params) -> list[int]:
    req = GenerateRequest(rid, prompt, SamplingParams(ignore_eos=True, **params))
    return [t for c in [c async for c in engine.generate(req)] for t in c.token_ids]


def _run(tiny_dir, body):
    async def main():
        engines = []
        for seed in (11, 12, 13):  # each engine its own (unused) stream
            model, tok = load_model(tiny_dir)
            engines.append(Engine(model, tok, tiny_dir, EngineConfig(seed=seed, max_batch=4)))
        for e in engines:
            await e.start()
        try:
            return await body(*engines)
        finally:
            for e in engines:
                await e.stop()

    return asyncio.run(main())


def test_same_call_seed_same_tokens_on_two_engines(tiny_dir):
    s0, s1 = call_seed(0, "b0-g0-e0", 0), call_seed(0, "b0-g0-e1", 0)

    async def body(a, b, c):
        # b serves the call next to another request (another batch): same tokens all the same
        same_a, same_b, _, other = await asyncio.gather(
            _tokens(a, "x", PROMPT, max_tokens=24, seed=s0),
            _tokens(b, "x", PROMPT, max_tokens=24, seed=s0),
            _tokens(b, "y", [3, 4], max_tokens=24),
            _tokens(c, "z", PROMPT, max_tokens=24, seed=s1),
        )
        top_k = [
            await _tokens(e, "k", PROMPT, max_tokens=16, seed=s0, top_k=8, temperature=0.8)
            for e in (a, c)
        ]
        return same_a, same_b, other, top_k

    same_a, same_b, other, top_k = _run(tiny_dir, body)
    assert len(same_a) == 24 and same_a == same_b
    assert other != same_a  # another execution, another stream
    assert top_k[0] == top_k[1]


def test_continued_call_keeps_its_stream_position(tiny_dir):
    seed, n = call_seed(3, "b1-g0-e2", 1), 7

    async def body(a, b, c):
        whole = await _tokens(a, "w", PROMPT, max_tokens=20, seed=seed)
        head = await _tokens(b, "h", PROMPT, max_tokens=n, seed=seed)
        # what the proxy sends the next engine after a drain: prompt + tokens so far
        tail = await _tokens(c, "t", PROMPT + head, max_tokens=20 - n, seed=continued_seed(seed, n))
        restarted = await _tokens(c, "r", PROMPT + head, max_tokens=20 - n, seed=seed)
        return whole, head, tail, restarted

    whole, head, tail, restarted = _run(tiny_dir, body)
    assert head + tail == whole
    assert head + restarted != whole  # re-sent with the original seed: the stream restarts
