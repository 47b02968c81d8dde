"""The token-in answer written as text (``token_in.token_in_json``) is the JSON of the answer
built as objects (``token_in_response``): every token id, log-prob (finite or not), version span
and usage figure the same."""

from __future__ import annotations

import json
import math
import random

from tidal.serving.openai_api import Result
from tidal.serving.token_in import token_in_json, token_in_response


def _result(n: int, seed: int) -> Result:
    rng = random.Random(seed)
    res = Result([rng.randrange(257, 32000) for _ in range(300)])
    res.token_ids = [rng.randrange(0, 2**31 - 1) for _ in range(n)]
    res.logprobs = [-rng.random() * 20 for _ in range(n)]
    res.versions = ["v1"] * (n // 2) + ["v2"] * (n - n // 2)
    res.finish_reason = "length"
    res.cached_tokens = 17
    return res


def test_the_text_answer_is_the_objects_answer():
    for n, seed in ((1, 0), (2000, 1), (5, 2)):
        res = _result(n, seed)
        text = json.loads(token_in_json("rid", "m", res))
        assert text == token_in_response("rid", "m", res)


def test_log_probs_of_any_float_round_trip():
    res = _result(4, 3)
    res.logprobs = [-0.0, -1e-300, -math.inf, 1.5e-7]
    text = json.loads(token_in_json("rid", "m", res))
    assert text["choices"][0]["logprobs"]["content"] == [
        {"token": f"token_id:{t}", "logprob": lp}
        for t, lp in zip(res.token_ids, res.logprobs, strict=True)
    ]
    assert json.loads(token_in_json("r", "m", res).decode()) == token_in_response("r", "m", res)
