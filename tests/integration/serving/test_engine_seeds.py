"""Engines of one cluster must not draw the same samples: the executions of a GRPO group are
spread over engines, and identical samples carry no advantage. ``tidal engine --seed`` sets an
engine's sampling seed (the runtime gives every engine process its own)."""

from __future__ import annotations

import httpx

from tidal.serving.launch import start_engine


def _sample(url: str) -> list[int]:
    body = {
        "prompt": [5, 6, 7, 8],
        "max_tokens": 24,
        "temperature": 1.0,
        "ignore_eos": True,
        "logprobs": 0,
    }
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_engines_with_other_seeds_sample_differently(tiny_model, tmp_path):
    engines = [start_engine(tiny_model, log_path=tmp_path / f"e{s}.log", seed=s) for s in (1, 1, 2)]
    try:
        for e in engines:
            e.wait_healthy(120)
        a, b, c = (_sample(e.url) for e in engines)
    finally:
        for e in engines:
            e.stop()
    assert a == b  # same seed, same first draw
    assert a != c  # another seed, another sample
