"""``WeightFile``: a safetensors file read one tensor at a time (engines load versions through
it, never holding a second whole copy), shapes from the header, bad files one-line errors."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from tidal.errors import TidalError
from tidal.models import open_weights
from tidal.models.loading import WeightFile


def test_tensors_come_one_at_a_time_equal_to_the_file(tmp_path):
    sd = {"a.weight": torch.randn(3, 4), "b.bias": torch.arange(5, dtype=torch.float16)}
    save_file(sd, str(tmp_path / "w.safetensors"))
    wf = open_weights(tmp_path / "w.safetensors")
    assert isinstance(wf, WeightFile) and sorted(wf) == ["a.weight", "b.bias"] and len(wf) == 2
    assert wf.shape_of("a.weight") == [3, 4]
    assert torch.equal(wf["a.weight"], sd["a.weight"])
    assert wf["b.bias"].dtype == torch.float32  # in the engine's dtype
    assert "c" not in wf
    with pytest.raises(KeyError):
        wf["c"]


def test_a_file_that_is_not_safetensors_is_one_error_naming_it(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{notjson")
    with pytest.raises(TidalError, match=r"bad\.safetensors"):
        open_weights(bad)
