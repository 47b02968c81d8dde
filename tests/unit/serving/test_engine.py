from __future__ import annotations

import asyncio

import pytest
import torch

from tidal.errors import TidalError
from tidal.models import LlamaForCausalLM, load_model
from tidal.models.base import all_finite
from tidal.seeding import continued_seed
from tidal.serving.engine import Engine, EngineConfig
from tidal.serving.protocol import BadRequest, GenerateRequest, SamplingParams


def _engine(tiny_dir, **cfg) -> Engine:
    model, tok = load_model(tiny_dir)
    return Engine(model, tok, tiny_dir, EngineConfig(**cfg))


async def _collect(engine, rid, prompt, **params):
    req = GenerateRequest(rid, prompt, SamplingParams(**params))
    chunks = [c async for c in engine.generate(req)]
    toks = [t for c in chunks for t in c.token_ids]
    return chunks, toks


async def _aborted_mid_stream(tiny_dir):
    """Two started engines; request ``x`` on the first aborted with ``keep_kv`` once it has
    5 tokens: (a, b, its prompt, its (chunks, tokens))."""
    a, b = _engine(tiny_dir), _engine(tiny_dir)
    await a.start()
    await b.start()
    prompt = [7, 8, 9, 10]
    task = asyncio.create_task(
        _collect(a, "x", prompt, max_tokens=400, temperature=0, ignore_eos=True)
    )
    while len(a._requests.get("x").tokens if "x" in a._requests else []) < 5:
        await asyncio.sleep(0.005)
    assert a.abort(["x"], keep_kv=True) == 1
    return a, b, prompt, await task


def run(coro):
    return asyncio.run(coro)


def test_concurrent_requests_match_unbatched_greedy(tiny_dir):
    async def main():
        eng = _engine(tiny_dir, max_batch=8)
        await eng.start()
        prompts = [[5 + i] * (3 + 2 * i) for i in range(6)]
        results = await asyncio.gather(
            *[
                _collect(eng, f"r{i}", p, max_tokens=12, temperature=0, ignore_eos=True)
                for i, p in enumerate(prompts)
            ]
        )
        await eng.stop()
        return eng, prompts, results

    eng, prompts, results = run(main())
    model = eng.model
    for p, (chunks, toks) in zip(prompts, results, strict=True):
        assert len(toks) == 12 and chunks[-1].finish_reason == "length"
        assert chunks[0].prompt_token_ids == p
        seq = list(p)
        for t in toks:  # greedy reference without any cache
            nxt = int(model(torch.tensor([seq]))[0, -1].argmax())
            assert nxt == t
            seq.append(nxt)
        lps = [lp for c in chunks for lp in c.logprobs]
        assert all(lp <= 0 for lp in lps) and len(lps) == 12
        assert {v for c in chunks for v in c.versions} == {"v0"}


def test_abort_returns_partial_tokens_and_pins_kv_for_handoff(tiny_dir):
    async def main():
        a, b, prompt, (chunks, partial) = await _aborted_mid_stream(tiny_dir)
        assert chunks[-1].finish_reason == "abort" and 5 <= len(partial) < 400
        blob = await a.export_kv("x")
        handle, covered = await b.import_kv(blob)
        assert covered == len(prompt) + len(partial) - 1
        assert a.release_kv("x")
        req = GenerateRequest(
            "y",
            prompt + partial,
            SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
            kv_handle=handle,
        )
        cont = [c async for c in b.generate(req)]
        _ref, ref_toks = await _collect(
            a, "z", prompt, max_tokens=len(partial) + 5, temperature=0, ignore_eos=True
        )
        await a.stop()
        await b.stop()
        return partial, cont, ref_toks, b

    partial, cont, ref_toks, b = run(main())
    assert cont[0].cached_tokens == len(partial) + 3  # 0 re-prefilled tokens
    assert partial + [t for c in cont for t in c.token_ids] == ref_toks
    assert b.stats()["prefill_tokens"] == 1


def test_a_step_that_appends_after_the_pin_does_not_spoil_the_export(tiny_dir):
    """An abort with keep_kv that lands while a step runs pins the tokens so far; the step
    then writes one more position into the same cache. The export covers the pinned tokens
    only, so the next engine takes it (it refused a blob of 195 positions for 194 tokens)."""

    async def main():
        a, b, prompt, (_chunks, partial) = await _aborted_mid_stream(tiny_dir)
        tokens, cache, _ = a.kv._entries["x"]
        pinned = len(tokens)
        cache.reserve(cache.length + 1)  # what the step in flight did after the pin
        cache.length += 1
        handle, covered = await b.import_kv(await a.export_kv("x"))
        await a.stop()
        await b.stop()
        return pinned, covered, partial

    pinned, covered, partial = run(main())
    assert covered == pinned == len(partial) + 3


def test_pause_modes_and_resume(tiny_dir):
    async def main():
        eng = _engine(tiny_dir)
        await eng.start()
        # long enough not to finish before the pause on a fast machine (30 tokens took < 50 ms)
        t1 = asyncio.create_task(_collect(eng, "k", [3, 4], max_tokens=300, ignore_eos=True))
        while "k" not in eng._requests or len(eng._requests["k"].tokens) < 3:
            await asyncio.sleep(0.002)
        await eng.pause("keep")
        n = len(eng._requests["k"].tokens)
        await asyncio.sleep(0.1)
        assert len(eng._requests["k"].tokens) == n and eng.is_paused
        await eng.resume()
        chunks, toks = await t1
        assert chunks[-1].finish_reason == "length" and len(toks) == 300
        t2 = asyncio.create_task(_collect(eng, "w", [3, 4], max_tokens=20, ignore_eos=True))
        await asyncio.sleep(0.02)
        await eng.pause("wait")
        chunks, toks = await t2
        assert chunks[-1].finish_reason == "length" and eng.is_paused
        t3 = asyncio.create_task(_collect(eng, "q", [3], max_tokens=5, ignore_eos=True))
        await asyncio.sleep(0.05)
        assert eng.stats()["waiting"] == 1  # admitted but held while paused
        await eng.resume()
        assert len((await t3)[1]) == 5
        t4 = asyncio.create_task(_collect(eng, "a", [3], max_tokens=300, ignore_eos=True))
        await asyncio.sleep(0.05)
        await eng.pause("abort")
        chunks, toks = await t4
        assert chunks[-1].finish_reason == "abort" and len(toks) < 300
        with pytest.raises(BadRequest):
            await eng.pause("freeze")
        await eng.stop()

    run(main())


def test_sleep_frees_memory_and_weight_versions_tag_tokens(tiny_dir, tmp_path):
    async def main():
        eng = _engine(tiny_dir)
        await eng.start()
        before = await _collect(eng, "a", [1, 2, 3], max_tokens=8, temperature=0, ignore_eos=True)
        await eng.sleep(1)
        s = eng.stats()
        assert eng.is_sleeping and s["weights_bytes"] == 0 and s["kv_bytes"] == 0
        await eng.wake_up()
        again = await _collect(eng, "b", [1, 2, 3], max_tokens=8, temperature=0, ignore_eos=True)
        assert again[1] == before[1]
        LlamaForCausalLM.random(eng.model.cfg.model_dump(), seed=5).save(tmp_path / "w2")
        task = asyncio.create_task(_collect(eng, "c", [1, 2, 3], max_tokens=200, ignore_eos=True))
        await asyncio.sleep(0.05)
        await eng.update_weights(tmp_path / "w2" / "model.safetensors", "v2")
        chunks, _toks = await task
        versions = [v for c in chunks for v in c.versions]
        assert versions[0] == "v0" and versions[-1] == "v2" and len(versions) == 200
        assert versions == sorted(versions)  # one switch, never back
        await eng.sleep(2)
        await eng.wake_up()  # level 2 reloads from the last weight source (v2)
        assert eng.weight_version == "v2"
        await eng.stop()

    run(main())


def test_a_load_says_how_long_it_waited_for_the_step_in_flight(tiny_dir, tmp_path):
    """A version's load is itemised: ``prepare_s`` (read and checked, off the step path),
    ``step_wait_s`` (waiting for the step in flight to end) and ``last_pause_s`` (the swap,
    steps held). A step held for 0.3 s (the step lock, as a long step holds it) shows as the
    wait, not as the pause."""
    LlamaForCausalLM.random(load_model(tiny_dir)[0].cfg.model_dump(), seed=5).save(tmp_path / "w")

    async def main():
        eng = _engine(tiny_dir)
        await eng.start()
        held = asyncio.Event()

        async def long_step():
            async with eng._step_lock:
                held.set()
                await asyncio.sleep(0.3)

        step = asyncio.create_task(long_step())
        await held.wait()
        await eng.update_weights(tmp_path / "w" / "model.safetensors", "v1")
        await step
        parts, pause = dict(eng.last_load_parts), eng.last_pause_s
        await eng.update_weights(tmp_path / "w" / "model.safetensors", "v2")  # nothing in flight
        idle = dict(eng.last_load_parts)
        await eng.stop()
        return parts, pause, idle

    parts, pause, idle = run(main())
    assert sorted(parts) == ["prepare_s", "step_wait_s"]
    assert 0.1 <= parts["step_wait_s"] <= 0.35 and pause < 0.1, (parts, pause)
    assert idle["step_wait_s"] < 0.05, idle


def test_a_sleeping_engine_wakes_into_a_version_in_one_pass_and_refuses_a_bad_one(
    tiny_dir, tmp_path
):
    """A load into a sleeping engine (a cell moving back to rollout) reads the file once,
    straight into the weights: the engine then serves exactly that version; a version holding
    a NaN leaves it asleep, with nothing materialised, and the next good load serves."""
    from safetensors.torch import save_file

    _, tok = load_model(tiny_dir)
    w2 = LlamaForCausalLM.random(load_model(tiny_dir)[0].cfg.model_dump(), seed=5)
    w2.save(tmp_path / "w2")
    bad = {k: v.detach().clone() for k, v in w2.named_parameters()}
    name = sorted(bad)[-1]
    bad[name].view(-1)[3] = float("nan")
    save_file(bad, str(tmp_path / "bad.safetensors"))

    async def main():
        eng, ref = _engine(tiny_dir), Engine(w2, tok, tiny_dir, EngineConfig())
        await eng.start()
        await ref.start()
        await eng.sleep(2)
        with pytest.raises(TidalError, match=f"{name}: holds NaN"):
            await eng.update_weights(tmp_path / "bad.safetensors", "v1")
        assert eng.is_sleeping and eng.stats()["weights_bytes"] == 0
        assert eng.weight_version == "v0"
        await eng.update_weights(tmp_path / "w2" / "model.safetensors", "v2")
        assert not eng.is_sleeping and eng.weight_version == "v2"
        for (n, p), (_, q) in zip(
            eng.model.named_parameters(), ref.model.named_parameters(), strict=True
        ):
            assert torch.equal(p, q), n
        got = await _collect(eng, "a", [1, 2, 3], max_tokens=8, temperature=0, ignore_eos=True)
        want = await _collect(ref, "a", [1, 2, 3], max_tokens=8, temperature=0, ignore_eos=True)
        assert got[1] == want[1]
        await eng.stop()
        await ref.stop()

    run(main())


def test_all_finite_decides_overflowing_sums_exactly():
    big = torch.full((4,), 3e38)  # finite values whose float32 sum overflows
    assert all_finite(big) and all_finite(torch.tensor([1, 2]))
    assert not all_finite(torch.tensor([1.0, float("inf"), -float("inf")]))
    assert not all_finite(torch.tensor([float("nan")], dtype=torch.bfloat16))


def test_bad_requests_are_rejected(tiny_dir):
    async def main():
        eng = _engine(tiny_dir)
        await eng.start()
        for prompt in ([], [10**6], [1] * 600):
            with pytest.raises(BadRequest):
                await _collect(eng, "bad", prompt)
        await eng.stop()

    run(main())


def test_abort_of_an_id_not_seen_yet_ends_that_request_on_arrival(tiny_dir):
    """A caller's abort may overtake its own request (two connections): the engine remembers
    it, and the request ends at once with 0 tokens; with keep_kv its adopted KV stays pinned
    and is reported as cached (nothing was computed again)."""

    async def main():
        a, b = _engine(tiny_dir), _engine(tiny_dir)
        await a.start()
        await b.start()
        assert a.abort(["late"]) == 0
        chunks, toks = await _collect(a, "late", [5, 6, 7], max_tokens=8, ignore_eos=True)
        assert toks == [] and [c.finish_reason for c in chunks] == ["abort"]
        _, again = await _collect(a, "late", [5, 6, 7], max_tokens=8, ignore_eos=True)
        assert len(again) == 8  # the memory is used once
        # a handed-off request aborted (keep_kv) before it arrived at its destination
        prompt = [7, 8, 9, 10, 11, 12]
        task = asyncio.create_task(
            _collect(a, "x", prompt, max_tokens=400, temperature=0, ignore_eos=True)
        )
        while len(a._requests["x"].tokens if "x" in a._requests else []) < 3:
            await asyncio.sleep(0.005)
        a.abort(["x"], keep_kv=True)
        _, partial = await task
        handle, covered = await b.import_kv(await a.export_kv("x"))
        b.abort(["y"], keep_kv=True)
        req = GenerateRequest(
            "y",
            prompt + partial,
            SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
            kv_handle=handle,
        )
        cont = [c async for c in b.generate(req)]
        pinned = b.kv.export("y")
        await a.stop()
        await b.stop()
        return cont, covered, pinned, b.stats()

    cont, covered, pinned, stats = run(main())
    assert [c.finish_reason for c in cont] == ["abort"] and not cont[0].token_ids
    assert cont[0].cached_tokens == covered and cont[0].kv_tokens == covered
    assert pinned and stats["prefill_tokens"] == 0 and stats["generated_tokens"] == 0


def test_a_level_1_sleep_spills_into_its_spill_dir_only_and_leaves_nothing(tiny_dir, tmp_path):
    """Issue 29, item 5: the spill is in the run's directory (``spill_dir``) or in memory, never
    in the system's temporary directory, and it is gone once the engine wakes or stops."""
    import tempfile

    from tidal.runtime.spill import stale_in_tmp

    before_tmp = set(stale_in_tmp())

    async def main():
        spilled = tmp_path / "run" / "spill"
        eng = _engine(tiny_dir, spill_dir=str(spilled), name="c1")
        await eng.start()
        ref = await _collect(eng, "a", [1, 2, 3], max_tokens=8, temperature=0, ignore_eos=True)
        await eng.sleep(1)
        assert [p.name.startswith("tidal-spill-c1-") for p in spilled.iterdir()] == [True]
        await eng.wake_up()
        assert list(spilled.iterdir()) == []
        again = await _collect(eng, "b", [1, 2, 3], max_tokens=8, temperature=0, ignore_eos=True)
        assert again[1] == ref[1]
        await eng.sleep(1)
        await eng.stop()  # a sleeping engine that ends removes its spill
        assert list(spilled.iterdir()) == []

        held = _engine(tiny_dir)  # no spill_dir (a plain `tidal engine`): held in memory
        await held.start()
        await held.sleep(1)
        assert held.stats()["weights_bytes"] == 0
        await held.wake_up()
        again = await _collect(held, "c", [1, 2, 3], max_tokens=8, temperature=0, ignore_eos=True)
        assert again[1] == ref[1]
        await held.stop()

    run(main())
    assert set(stale_in_tmp()) == before_tmp, tempfile.gettempdir()


def test_a_character_cut_between_two_engines_is_sent_whole_once(tiny_dir):
    """A call rerouted while its last token ends half a character: the engine it left sends
    its text less that half (an abort's text ends with no U+FFFD), the next one gets the
    earlier output as ``output_context`` and sends the character whole. The two engines'
    texts add up to the uncut call's text, for every cut that splits a character."""

    async def main():
        a, b = _engine(tiny_dir), _engine(tiny_dir)
        await a.start()
        await b.start()
        prompt = [7, 8, 9, 10]
        sampled = {"temperature": 1.0, "seed": 11, "ignore_eos": True}
        chunks, ref = await _collect(a, "ref", prompt, max_tokens=80, **sampled)
        whole = "".join(c.text for c in chunks)
        cuts = [  # a character cut in half that the next token completes
            k
            for k in range(1, len(ref))
            if a.tokenizer.decode(ref[:k]).endswith("\ufffd")
            and not a.tokenizer.decode(ref[: k + 1]).endswith("\ufffd")
        ]
        assert cuts, "the greedy answer splits no character: pick another prompt"
        for k in cuts:
            first = a._admit(GenerateRequest(f"p{k}", prompt, SamplingParams(max_tokens=1)))
            first.tokens = ref[:k]
            head = a._text(first, 0, k, final=True)[0].rstrip("\ufffd")  # as an abort sends
            a._requests.pop(first.id)
            req = GenerateRequest(
                f"c{k}",
                prompt + ref[:k],
                SamplingParams(
                    max_tokens=len(ref) - k, **sampled | {"seed": continued_seed(11, k)}
                ),
                output_context=k,
            )
            cont = [c async for c in b.generate(req)]
            assert [t for c in cont for t in c.token_ids] == ref[k:]
            assert head + "".join(c.text for c in cont) == whole, k
        await a.stop()
        await b.stop()
        return cuts

    assert run(main())
