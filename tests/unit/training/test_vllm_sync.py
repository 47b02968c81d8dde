"""The vLLM worker extension's loading path, without vLLM.

vLLM is not run in this suite (the live check of the shared-memory carrier is
``tests/integration/serving/test_vllm_tier.py::test_shm_publication_loads_into_the_live_server``).
Here the extension is mixed into an object whose ``model_runner.model`` is a real torch module
with vLLM's ``load_weights(weights=[(name, tensor), ...])`` signature.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from tidal.models.hf import tiny_model
from tidal.training.flat import ParamLayout
from tidal.training.transport import SharedMemoryTransport
from tidal.training.vllm_sync import TidalWorkerExtension

SHM = f"tidal-test-vllm-{os.getpid()}"

SHAPE = {"n_layers": 1, "n_heads": 2, "d_model": 32, "d_ff": 64, "max_seq_len": 32}


class VLLMStyleModel(torch.nn.Module):
    """A transformers model behind vLLM's model API: ``load_weights`` of (name, tensor) pairs."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.inner = model

    def load_weights(self, weights):
        named = dict(self.inner.named_parameters())
        loaded = set()
        with torch.no_grad():
            for name, tensor in weights:
                named[name].copy_(tensor)
                loaded.add(name)
        return loaded


class Worker(TidalWorkerExtension):
    def __init__(self, model):
        self.model_runner = SimpleNamespace(model=model)


def test_extension_loads_a_published_version_from_shared_memory():
    trainer = tiny_model("llama", 0, 64, **SHAPE)
    layout = ParamLayout.of(trainer)
    shm = SharedMemoryTransport(SHM, layout, create=True)
    try:
        shm.publish(7, layout.params_to_flat(trainer))
        served = VLLMStyleModel(tiny_model("llama", 1, 64, **SHAPE))
        assert Worker(served).tidal_load_shm(SHM, min_version=7) == 7
        for (n, a), (_, b) in zip(
            trainer.named_parameters(), served.inner.named_parameters(), strict=True
        ):
            assert torch.equal(a, b), n
    finally:
        shm.close()
