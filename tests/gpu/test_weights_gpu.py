"""Weight carriers and the built-in engine's pinned sleep on a CUDA device.

- CUDA IPC (the trainer's own GPU): the trainer's device tensors exported as handles
  (``cuda_ipc.ipc_export``), mapped in another process that serves them in a built-in engine
  (``Engine.update_weights_from``, what ``POST /tidal/weights/ipc`` runs): every weight the
  engine serves has the trainer's sha256;
- a segment written from device tensors (``SegmentRing``: through its staging buffer, pinned on
  CUDA), in bfloat16: the exact cast of each tensor;
- level-1 sleep through pinned host buffers kept across sleeps (``HostStash``): the same
  buffers at the second sleep, pinned, the device memory freed, greedy tokens unchanged.

``TIDAL_TEST_DEVICE=cpu`` runs the same checks on the CPU (a dry run on a machine without a GPU):
IPC then checks that CPU tensors are refused (the round trip needs CUDA: skipped), and the
pinned / memory checks are skipped. Run: ``python -m pytest tests/gpu/test_weights_gpu.py``.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os

import pytest
import torch

from tidal.models.llama import SMOLLM2_135M, LlamaForCausalLM
from tidal.serving.engine import Engine, EngineConfig
from tidal.serving.protocol import GenerateRequest, SamplingParams

DEVICE = os.environ.get("TIDAL_TEST_DEVICE", "cuda")
ON_CUDA = DEVICE.startswith("cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(ON_CUDA and not torch.cuda.is_available(), reason="no CUDA device"),
]


class _Ids:
    eos_id = 0

    def decode(self, ids: list[int]) -> str:
        return ""


def _sha(named) -> dict[str, str]:
    from tidal.training.vllm_sync import tensor_sha

    return {n: tensor_sha(t) for n, t in named.items()}


def _serve_from_ipc(handles: list[dict], out: mp.Queue) -> None:
    """The engine's process: map the trainer's tensors, load them, report what it serves."""
    try:
        from tidal.training.cuda_ipc import ipc_import

        model = LlamaForCausalLM.random(SMOLLM2_135M, seed=9)

        async def main():
            engine = Engine(model, _Ids(), "/nonexistent", EngineConfig(device=DEVICE))
            await engine.update_weights_from(ipc_import(handles), "v7")
            return engine.weight_version, await engine.weight_hashes(), engine.last_pause_s

        version, hashes, pause_s = asyncio.run(main())
        out.put(("ok", version, {n: h for n, h in hashes.items()}, pause_s))
    except BaseException as exc:  # reported to the test
        out.put(("error", f"{type(exc).__name__}: {exc}", {}, 0.0))


def test_cuda_ipc_hands_the_trainers_tensors_to_an_engine_bit_for_bit():
    from tidal.training.cuda_ipc import ipc_export
    from tidal.training.transport import TransportError

    trainer = LlamaForCausalLM.random(SMOLLM2_135M, seed=0).to(DEVICE)
    named = {n: p.detach() for n, p in trainer.named_parameters()}
    if not ON_CUDA:
        with pytest.raises(TransportError, match="CUDA IPC carries CUDA tensors"):
            ipc_export(named)
        pytest.skip("the IPC round trip needs CUDA (CPU tensors are refused: checked)")
    handles = ipc_export(named)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_serve_from_ipc, args=(handles, out))
    child.start()
    status, version, hashes, pause_s = out.get(timeout=300)  # tensors alive until it read
    child.join(60)
    assert status == "ok", version
    assert version == "v7" and hashes == _sha(named)
    print(
        f"IPC load of {sum(t.numel() for t in named.values()) * 4 / 1e9:.2f} GB: "
        f"pause {pause_s:.3f} s"
    )


def test_a_segment_written_from_device_tensors_is_the_exact_cast(tmp_path):
    from safetensors.torch import load_file

    from tidal.training.carriers import SegmentRing
    from tidal.training.flat import ParamLayout

    trainer = LlamaForCausalLM.random(SMOLLM2_135M, seed=1).to(DEVICE)
    ring = SegmentRing(tmp_path / "shm", ParamLayout.of(trainer), dtype=torch.bfloat16)
    named = {n: p.detach() for n, p in trainer.named_parameters()}
    for version in (1, 2, 3):  # the third reuses the first's pages
        ring.publish_stream(version, iter(named.items()))
    got = load_file(ring.path(3))
    assert set(got) == set(named)
    for n, t in named.items():
        assert torch.equal(got[n], t.to(torch.bfloat16).cpu()), n
    if ON_CUDA:
        assert ring._stage is not None and ring._stage.is_pinned()
    ring.close()


def test_level_one_sleep_keeps_pinned_buffers_across_sleeps():
    model = LlamaForCausalLM.random(SMOLLM2_135M, seed=3)
    prompts = [[5 + i] * (3 + 4 * i) for i in range(3)]

    async def greedy(engine, tag):
        async def one(i, p):
            req = GenerateRequest(
                f"{tag}{i}", p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
            )
            return [t for c in [c async for c in engine.generate(req)] for t in c.token_ids]

        return await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])

    async def main():
        engine = Engine(model, _Ids(), "/nonexistent", EngineConfig(device=DEVICE, max_batch=8))
        await engine.start()
        try:
            first = await greedy(engine, "a")
            ptrs = []
            for round_ in range(2):
                awake = torch.cuda.memory_allocated() if ON_CUDA else 0
                await engine.sleep(1)
                if ON_CUDA:
                    assert torch.cuda.memory_allocated() <= awake - 0.95 * model.weights_nbytes()
                    assert all(b.is_pinned() for b in engine._held.values())
                ptrs.append({k: b.data_ptr() for k, b in engine._held.items()})
                await engine.wake_up()
                assert await greedy(engine, f"b{round_}") == first
            if ON_CUDA:  # the second sleep copied into the first one's buffers
                assert ptrs[0] == ptrs[1] and engine._stash.pinned_bytes > 0
        finally:
            await engine.stop()

    asyncio.run(main())
