"""Where the runtime puts engines and the core trainer: ``runtime.device`` resolution, a cell
actor's device from its Ray GPUs, the core's CUDA index from cell 0's GPU."""

from __future__ import annotations

import pytest

from tidal.config import RunConfig, validate_model
from tidal.errors import ConfigError
from tidal.runtime.cell import actor_device, trainer_device


def _runtime(**kw):
    return validate_model(RunConfig, {"runtime": kw}).runtime


def test_auto_is_cuda_only_with_gpus_reserved_and_seen():
    assert _runtime().device == "auto"
    assert _runtime().resolved_device(cuda_available=True) == "cpu"  # use_gpus off
    rt = _runtime(use_gpus=True)
    assert rt.resolved_device(cuda_available=True) == "cuda"
    assert rt.resolved_device(cuda_available=False) == "cpu"
    assert _runtime(device="cpu", use_gpus=True).resolved_device(True) == "cpu"


def test_cuda_without_use_gpus_names_the_field():
    with pytest.raises(ConfigError) as err:
        _runtime(device="cuda")
    assert err.value.field == "runtime.device"
    with pytest.raises(ConfigError):
        _runtime(device="tpu")


def test_a_cell_actor_runs_on_cuda_when_ray_gave_it_gpus():
    assert actor_device("auto", ["3"], cuda_present=True) == "cuda"
    assert actor_device("auto", ["3"], cuda_present=False) == "cpu"  # GPUs declared to Ray only
    assert actor_device("auto", [], cuda_present=True) == "cpu"
    assert actor_device("cpu", ["3"]) == "cpu"
    assert actor_device("cuda", []) == "cuda"  # the engine reports the missing GPU


def test_the_core_trainer_uses_cell_0s_first_gpu():
    assert trainer_device("cpu", ["2"], None) == "cpu"
    assert trainer_device("cuda", ["2", "3"], None) == "cuda:2"
    assert trainer_device("cuda", ["2"], "5,2") == "cuda:1"
    assert trainer_device("cuda", ["7"], "0,1") == "cuda"  # not visible here: the first one
    assert trainer_device("cuda", [], None) == "cuda"
