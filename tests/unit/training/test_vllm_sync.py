"""The vLLM worker extension's loading path, without vLLM.

vLLM is not run in this suite (see ``test_vllm_publisher_against_a_live_server`` for the live
check). Here the extension is mixed into an object whose ``model_runner.model`` is a real torch
module with vLLM's ``load_weights(weights=[(name, tensor), ...])`` signature.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from tidal.models.hf import tiny_model
from tidal.training.flat import ParamLayout
from tidal.training.transport import SharedMemoryTransport
from tidal.training.vllm_sync import TidalWorkerExtension, VLLMWeightPublisher

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
        for (n, a), (_, b) in zip(trainer.named_parameters(),
                                  served.inner.named_parameters(), strict=True):
            assert torch.equal(a, b), n
    finally:
        shm.close()


@pytest.mark.vllm
@pytest.mark.skipif("TIDAL_VLLM_URL" not in os.environ, reason="needs a live vLLM server "
                    "(VLLM_SERVER_DEV_MODE=1, --worker-extension-cls "
                    "tidal.training.vllm_sync.TidalWorkerExtension) at $TIDAL_VLLM_URL")
def test_vllm_publisher_against_a_live_server():
    from tidal.models import fetch, load_model

    model, _ = load_model(fetch("smollm2-135m"))
    layout = ParamLayout.of(model)
    pub = VLLMWeightPublisher(os.environ["TIDAL_VLLM_URL"], layout, "shm")
    try:
        pub.publish(3, layout.params_to_flat(model))
        info = pub._get("/weight_info") if pub._has_version else {"weight_version": "v3"}
        assert info["weight_version"] == "v3"
    finally:
        pub.close()
