"""The engine's device setting on a CPU-only machine: ``device="cpu"`` changes nothing, a bad
name is a config error, CUDA asked for without a GPU is one clear error."""

from __future__ import annotations

import asyncio

import pytest
import torch
from pydantic import ValidationError

from tidal.models import load_model
from tidal.models.device import DeviceError
from tidal.serving.engine import Engine, EngineConfig
from tidal.serving.protocol import GenerateRequest, SamplingParams


async def _generate(engine: Engine, prompts: list[list[int]], **params):
    outs = []
    for i, p in enumerate(prompts):
        req = GenerateRequest(f"r{i}", p, SamplingParams(**params))
        chunks = [c async for c in engine.generate(req)]
        outs.append(
            ([t for c in chunks for t in c.token_ids], [lp for c in chunks for lp in c.logprobs])
        )
    return outs


async def _run(engine: Engine, prompts: list[list[int]], **params):
    await engine.start()
    try:
        return await _generate(engine, prompts, **params)
    finally:
        await engine.stop()


def test_explicit_cpu_device_samples_exactly_like_the_default(tiny_dir):
    prompts = [[5, 6, 7], [9] * 6]
    runs = []
    for cfg in (EngineConfig(seed=3), EngineConfig(seed=3, device="cpu")):
        model, tok = load_model(tiny_dir)
        engine = Engine(model, tok, tiny_dir, cfg)
        assert engine.device == torch.device("cpu")
        runs.append(
            asyncio.run(_run(engine, prompts, max_tokens=10, temperature=1.0, ignore_eos=True))
        )
    assert runs[0] == runs[1]


def test_sleep_and_wake_on_cpu_restore_the_same_greedy_output(tiny_dir):
    async def main():
        model, tok = load_model(tiny_dir)
        engine = Engine(model, tok, tiny_dir, EngineConfig(device="cpu"))
        await engine.start()
        first = await _generate(engine, [[4, 5, 6]], max_tokens=8, temperature=0, ignore_eos=True)
        for level in (1, 2):
            await engine.sleep(level)
            assert engine.model.device == torch.device("cpu")
            await engine.wake_up()
            assert all(p.device.type == "cpu" for p in engine.model.parameters())
            again = await _generate(
                engine, [[4, 5, 6]], max_tokens=8, temperature=0, ignore_eos=True
            )
            assert again == first
        await engine.stop()

    asyncio.run(main())


def test_device_names_are_checked():
    with pytest.raises(ValidationError):
        EngineConfig(device="gpu")
    assert EngineConfig(device="cuda:1").device == "cuda:1"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_one_clear_error(tiny_dir):
    model, tok = load_model(tiny_dir)
    with pytest.raises(DeviceError, match="sees no CUDA device"):
        Engine(model, tok, tiny_dir, EngineConfig(device="cuda"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_engine_command_refuses_cuda_before_reading_the_model(tiny_dir, capsys):
    from tidal.cli import main

    assert main(["engine", "--model", str(tiny_dir), "--device", "cuda"]) != 0
    assert "sees no CUDA device" in capsys.readouterr().err
