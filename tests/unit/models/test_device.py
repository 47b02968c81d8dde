"""Device handling of the models on the CPU: explicit devices, freeing and re-materialising, KV
export / import keeping dtype and device, and the errors for devices this process lacks."""

from __future__ import annotations

import pytest
import torch

from tidal.errors import TidalError
from tidal.models import KVCache, load_model
from tidal.models.device import DeviceError, describe_devices, resolve_device
from tidal.models.kv import RaggedBatch
from tidal.models.llama import SMOLLM2_135M, LlamaForCausalLM

SMALL_LLAMA = {
    **SMOLLM2_135M,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 128,
}


def test_device_names_resolve_or_fail_in_one_line():
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(DeviceError, match="use 'cpu', 'cuda' or 'cuda:N'"):
        resolve_device("gpu0")
    assert describe_devices().startswith("torch ")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="sees no CUDA device"):
            resolve_device("cuda:0")


def test_model_on_explicit_cpu_builds_every_tensor_there(tiny_dir):
    model, tok = load_model(tiny_dir)
    model.to("cpu")
    assert model.device == torch.device("cpu")
    cache = model.new_cache()
    assert cache.device == torch.device("cpu") and cache.dtype == torch.float32
    ids = tok.encode("The agent reads the task")
    full = model(torch.tensor([ids]))[0]
    out = model.forward_cached([ids], [cache])
    torch.testing.assert_close(out[0], full[-1], atol=1e-5, rtol=1e-4)


def test_free_and_materialize_round_trip_keeps_device_and_outputs(tiny_dir):
    model, _ = load_model(tiny_dir)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    before = model(ids).detach()
    saved = {k: v.clone() for k, v in model.named_parameters()}
    model.free_weights()
    assert all(p.is_meta for p in model.parameters())
    assert model.weights_nbytes() == 0
    assert model.device == torch.device("cpu")  # remembered while freed
    model.materialize()
    assert all(p.device.type == "cpu" for p in model.parameters())
    model.load_weights(saved)
    assert torch.equal(model(ids), before)


def test_tied_llama_survives_free_and_materialize():
    model = LlamaForCausalLM.random(SMALL_LLAMA, seed=3)
    ids = torch.tensor([[5, 6, 7]])
    before = model(ids).detach()
    sd = {k: v.clone() for k, v in model.named_parameters()}
    model.free_weights()
    model.materialize("cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.load_weights(sd)
    assert torch.equal(model(ids), before)
    assert torch.equal(LlamaForCausalLM.random(SMALL_LLAMA, seed=3)(ids), before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_export_is_cpu_and_import_keeps_dtype_and_continues(dtype):
    model = LlamaForCausalLM.random(SMALL_LLAMA, seed=1, dtype=dtype)
    ids = [3, 14, 15, 92, 65, 35, 89, 79]
    cache = model.new_cache()
    assert cache.dtype == dtype
    model.forward_cached([ids[:-1]], [cache])
    exported = cache.export_tensors()
    assert {t.device.type for t in exported.values()} == {"cpu"}
    assert {t.dtype for t in exported.values()} == {dtype}
    moved = model.cache_from_tensors(exported)
    assert moved.device == model.device and moved.dtype == dtype
    assert moved.length == len(ids) - 1
    a = model.forward_cached([ids[-1:]], [cache])
    b = model.forward_cached([ids[-1:]], [moved])
    assert torch.equal(a, b)


def test_kv_import_casts_to_the_importing_models_dtype():
    model = LlamaForCausalLM.random(SMALL_LLAMA, seed=1, dtype=torch.bfloat16)
    fp32 = LlamaForCausalLM.random(SMALL_LLAMA, seed=1)
    cache = fp32.new_cache()
    fp32.forward_cached([[1, 2, 3]], [cache])
    moved = model.cache_from_tensors(cache.export_tensors())
    assert moved.dtype == torch.bfloat16
    assert model.forward_cached([[4]], [moved]).dtype == torch.bfloat16


def test_a_ragged_batch_refuses_caches_on_two_devices():
    cpu = KVCache(1, 2, 4)
    meta = KVCache(1, 2, 4, device="meta")
    assert meta.device == torch.device("meta")
    with pytest.raises(TidalError, match="several devices"):
        RaggedBatch([cpu, meta], [1, 1])
    meta.reserve(3)  # allocates where the cache lives
    assert meta.buffers(0, 3)[0].is_meta


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_every_tensor_a_forward_builds_is_on_the_models_device(kind):
    """``meta`` stands in for a GPU: it refuses to mix with CPU tensors as CUDA does, so an id,
    position, mask, rotary table or cache made on the CPU by mistake fails here."""
    model = LlamaForCausalLM.random({**SMALL_LLAMA, "model_type": kind})
    model.to("meta")
    model._weights_device = torch.device("meta")  # meta means "freed" otherwise
    assert model.device == torch.device("meta")
    assert model(torch.tensor([[1, 2, 3]], device="meta")).shape == (1, 3, 256)
    caches = [model.new_cache(), model.new_cache()]
    assert {c.device for c in caches} == {torch.device("meta")}
    out = model.forward_cached([[1, 2, 3], [4, 5]], caches)  # ragged prefill
    out = model.forward_cached([[6], [7]], caches)  # decode
    assert out.device == torch.device("meta") and out.shape == (2, 256)
    model.forward_cached([[1] * 70], [caches[0]])  # the cache grows where it lives
    assert caches[0].capacity == 128 and caches[0].buffers(0, 1)[0].is_meta
    exported = {
        f"{kv}.{i}": torch.zeros(4, model.n_kv_heads, model.head_dim)
        for kv in "kv"
        for i in range(model.n_layers)
    }
    imported = model.cache_from_tensors(exported)  # CPU tensors in, device cache out
    assert imported.device == torch.device("meta") and imported.length == 4
    assert model.forward_cached([[8], [9]], [imported, caches[1]]).is_meta
