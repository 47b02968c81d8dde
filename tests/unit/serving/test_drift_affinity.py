"""Multi-turn harnesses that re-send their conversation as text, through the proxy's HTTP front
over built-in engines (real uvicorn servers on loopback, in this process):

- drift: with a template that re-renders earlier turns as they were, every call extends its
  execution's chain (0 breaks; where the text re-tokenizes differently the sampled ids are put
  back); with a Qwen3-style template that drops earlier turns' ``<think>`` part, the calls that
  lost it are counted as chain breaks and train as separate sequences;
- affinity: a seeded multi-turn run over two engines with prefix caches finds more of its
  prompts cached with session affinity on than off (both shares printed)."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from tidal.models import load_model
from tidal.models.tokenizer import HFTokenizer
from tidal.serving.engine import Engine, EngineConfig
from tidal.serving.engine_server import build_engine_app
from tidal.serving.execution_keys import execution_key, execution_url
from tidal.serving.proxy import Proxy, ProxyConfig
from tidal.serving.proxy_app import build_proxy_app
from tidal.testing.chat_models import (
    HERMES_TOOLS_TEMPLATE,
    QWEN3_STRIP_THINK_TEMPLATE,
    set_template,
    teach,
)
from tidal.training.records import chain_breaks, record_from_proxy, record_to_sequences

openai = pytest.importorskip("openai")
QUESTION = [{"role": "user", "content": "Capital of France?"}]
ANSWER = "<think>It is Paris.</think>\nParis"


@pytest.fixture(scope="module")
def thinking_models(tmp_path_factory):
    """One taught model (it answers QUESTION with ANSWER) under both templates."""
    from tidal.models import create_tiny

    root = tmp_path_factory.mktemp("think")
    consistent = create_tiny(
        root / "consistent", seed=5, max_seq_len=512, n_layers=2, d_model=64, n_heads=2
    )
    set_template(consistent, HERMES_TOOLS_TEMPLATE)
    tok = HFTokenizer(consistent)
    teach(consistent, tok.apply_chat_template(QUESTION), [*tok.encode(ANSWER), tok.eos_id], lr=1e-2)
    strip = shutil.copytree(consistent, root / "strip")
    set_template(strip, QWEN3_STRIP_THINK_TEMPLATE)
    return {"consistent": consistent, "strip": strip}


async def _serving(serve_asgi, stack, model_dirs, affinity=True, prefix_cache_mb=0.0, seed=None):
    proxy = Proxy(ProxyConfig(admin_token="t", affinity=affinity, seed=seed))
    for i, d in enumerate(model_dirs):
        model, tok = load_model(d)
        engine = Engine(model, tok, d, EngineConfig(name=f"e{i}", prefix_cache_mb=prefix_cache_mb))
        url = await stack.enter_async_context(serve_asgi(build_engine_app(engine, "tiny")))
        await proxy.join(f"e{i}", url, kind="standalone" if i == 0 else "cell", cell_index=i)
    url = await stack.enter_async_context(serve_asgi(build_proxy_app(proxy)))
    return proxy, url


async def _conversation(
    url: str,
    eid: str,
    turns: list[str],
    first_tokens: int = 32,
    temperature: float = 0.0,
    opening: list[dict] = QUESTION,
) -> None:
    """A harness that keeps its history as text and re-sends all of it each turn."""
    async with openai.AsyncOpenAI(
        base_url=execution_url(url, eid),
        api_key=execution_key("t", eid),
        max_retries=0,
        default_headers={"X-Session-ID": f"s-{eid}"},
    ) as oa:
        messages = list(opening)
        for i, user in enumerate([None, *turns]):
            if user is not None:
                messages.append({"role": "user", "content": user})
            out = await oa.chat.completions.create(
                model="tiny",
                messages=messages,
                temperature=temperature,
                max_tokens=first_tokens if i == 0 else 12,
            )
            messages.append({"role": "assistant", "content": out.choices[0].message.content})


@pytest.mark.parametrize("template", ["consistent", "strip"])
def test_chain_breaks_counted_only_where_the_template_drops_text(
    thinking_models, serve_asgi, template
):
    import contextlib

    async def main():
        async with contextlib.AsyncExitStack() as stack:
            proxy, url = await _serving(serve_asgi, stack, [thinking_models[template]])
            await _conversation(url, "x", ["And of Italy?", "Thanks."])
            await _conversation(
                url,
                "y",
                ["Sure?", "Go on."],
                temperature=1.0,
                opening=[{"role": "user", "content": "Tell me a story."}],
            )
            return proxy.stats(), proxy.records.calls("x"), proxy.records.calls("y")

    stats, calls_x, calls_y = asyncio.run(main())
    first = calls_x[0]
    assert HFTokenizer(thinking_models[template]).decode(first.output_token_ids).startswith(ANSWER)
    record = record_from_proxy("x", "g", [c.model_dump(mode="json") for c in calls_x], 1.0)
    sequences = record_to_sequences(record)
    assert chain_breaks(record) == sum(c.chain_break for c in calls_x)
    if template == "consistent":
        print(f"\n{stats['bridged_calls']} of 6 calls bridged (sampled ids put back)")
        assert stats["chain_breaks"] == 0 and stats["recorded_calls"] == 6
        assert len(sequences) == 1  # one stream: the model's own ids for every turn
    else:  # turn 2 of x lost the first answer's reasoning (turn 3 extends turn 2); the
        # answers of y had none to lose
        assert [c.chain_break for c in calls_x] == [False, True, False]
        assert [c.chain_break for c in calls_y] == [False, False, False]
        assert stats["chain_breaks"] == 1 and stats["chain_breaks_per_100_calls"] == 16.67
        assert len(sequences) == 2  # trained apart, never merged


def test_affinity_keeps_prefixes_cached(tiny_dir, serve_asgi):
    import contextlib

    async def run(affinity: bool) -> dict:
        async with contextlib.AsyncExitStack() as stack:
            proxy, url = await _serving(
                serve_asgi,
                stack,
                [tiny_dir, tiny_dir],
                affinity=affinity,
                prefix_cache_mb=64,
                seed=11,
            )
            await asyncio.gather(
                *[
                    _conversation(
                        url,
                        f"ex{i}",
                        ["Go on.", "And then?", "Why?"],
                        first_tokens=12,
                        temperature=1.0,
                    )
                    for i in range(8)
                ]
            )
            return proxy.stats()

    on, off = asyncio.run(run(True)), asyncio.run(run(False))
    print(
        f"\ncached token share: affinity on {on['cached_token_share']:.3f} "
        f"{on['cached_token_share_by_engine']}, off {off['cached_token_share']:.3f} "
        f"{off['cached_token_share_by_engine']} (prompt tokens {on['prompt_tokens']} / "
        f"{off['prompt_tokens']})"
    )
    assert on["recorded_calls"] == off["recorded_calls"] == 32
    assert on["cached_token_share"] > off["cached_token_share"]


def test_sampled_ids_replace_a_different_retokenization(tiny_dir, serve_asgi):
    """The model sampled "Paris" one character per token (not how BPE encodes it): the next
    turn's re-rendered prompt tokenizes it differently, and the proxy puts the sampled ids
    back (the rest of the new prompt as the template rendered it); a prompt whose text does
    not extend the earlier one is left alone."""
    import contextlib

    from tidal.contracts import CallRecord, Segment

    tok = HFTokenizer(tiny_dir)
    prompt = tok.apply_chat_template(QUESTION)
    sampled = [i for ch in "Paris" for i in tok.encode(ch)] + [tok.eos_id]
    assert tok.encode("Paris") != sampled[:-1]
    follow = [
        *QUESTION,
        {"role": "assistant", "content": "Paris"},
        {"role": "user", "content": "Sure?"},
    ]
    rendered = tok.apply_chat_template(follow)

    async def main():
        async with contextlib.AsyncExitStack() as stack:
            proxy, _ = await _serving(serve_asgi, stack, [tiny_dir])
            seg = Segment(
                engine_id="e0",
                request_id="r1",
                token_ids=sampled,
                logprobs=[-1.0] * 6,
                versions=["v0"] * 6,
            )
            call = CallRecord(call_id="c1", prompt_token_ids=prompt, max_tokens=8, segments=[seg])
            proxy.records.add("x", call)
            bridged = await proxy.bridge("x", rendered)
            unrelated = await proxy.bridge(
                "x", tok.apply_chat_template([{"role": "user", "content": "Other"}])
            )
            return bridged, unrelated

    bridged, unrelated = asyncio.run(main())
    assert rendered[: len(prompt) + 6] != prompt + sampled
    assert bridged[: len(prompt) + 6] == prompt + sampled
    assert tok.decode(bridged) == tok.decode(rendered)
    assert unrelated is None
