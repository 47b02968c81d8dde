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


def test_read_into_reads_each_tensor_straight_into_its_target(tmp_path):
    sd = {
        "a.weight": torch.randn(3, 4),
        "b.bias": torch.arange(5, dtype=torch.float16),
        "c": torch.randn(2, 2).to(torch.bfloat16),
    }
    save_file(sd, str(tmp_path / "w.safetensors"))
    wf = WeightFile(tmp_path / "w.safetensors")
    a = torch.empty(3, 4)
    wf.read_into("a.weight", a)  # from the file into a's memory
    assert torch.equal(a, sd["a.weight"])
    b = torch.empty(5)  # another dtype: converted from the tensor as read
    wf.read_into("b.bias", b)
    assert torch.equal(b, sd["b.bias"].float())
    c = torch.empty(2, 2, dtype=torch.bfloat16)
    wf.read_into("c", c)
    assert torch.equal(c, sd["c"])
    p = torch.nn.Parameter(torch.zeros(3, 4))  # a parameter, as an engine's load gives it
    with torch.no_grad():
        wf.read_into("a.weight", p)
    assert torch.equal(p.detach(), sd["a.weight"])
    with pytest.raises(KeyError):
        wf.read_into("nope", a)


def test_a_truncated_file_is_one_error_naming_the_tensor(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.randn(64), "b": torch.randn(64)}, str(path))
    data = path.read_bytes()
    wf = WeightFile(path)
    path.write_bytes(data[:-100])  # cut after it was opened: the last tensor lacks bytes
    last = max(
        wf._header.items(),
        key=lambda kv: kv[1]["data_offsets"][0] if kv[0] != "__metadata__" else -1,
    )[0]
    with pytest.raises(TidalError, match=f"tensor {last} truncated"):
        wf.read_into(last, torch.empty(64))
