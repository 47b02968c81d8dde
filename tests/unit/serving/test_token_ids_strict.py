"""Issue 38 (14): token ids are JSON integers; a string "4", a float 4.0 or a bool true is
refused by name on the token-in route (and on a token-id completion prompt), never coerced."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tidal.serving.openai_api import CompletionRequest
from tidal.serving.token_in import TokenInRequest


@pytest.mark.parametrize("bad", ["4", True, 4.0])
def test_a_token_id_that_is_not_an_integer_is_refused(bad):
    with pytest.raises(ValidationError) as err:  # main: "4" -> 4, true -> 1
        TokenInRequest.model_validate({"token_ids": [3, bad]})
    assert err.value.errors()[0]["loc"] == ("token_ids", 1)
    with pytest.raises(ValidationError):
        TokenInRequest.model_validate(
            {"token_ids": [3], "sampling_params": {"stop_token_ids": [bad]}}
        )
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": [3, bad]})


def test_integer_token_ids_pass():
    assert TokenInRequest.model_validate_json('{"token_ids": [0, 4, 2147483647]}').token_ids == [
        0,
        4,
        2147483647,
    ]
    assert CompletionRequest.model_validate({"prompt": [1, 2]}).prompt == [1, 2]
