"""The built-in engine and the trainer on a CUDA device, against the same code on the CPU.

Skipped where torch sees no CUDA device. ``TIDAL_TEST_DEVICE=cpu`` runs the same checks with the
"device" side on the CPU too (a dry run of this file on a machine without a GPU; the memory
checks are then skipped). Models: the tiny HF Llama and a randomly initialised Llama of
SmolLM2-135M's shape (no weights on disk needed), both float32, so greedy tokens must agree and
log-probs agree to float32 kernel noise.

Run: ``python -m pytest tests/gpu -v`` (about a minute on an H200).
"""

from __future__ import annotations

import asyncio
import copy
import multiprocessing as mp
import os
import sys
from pathlib import Path

import pytest
import torch

from tidal.models import create_tiny, load_model
from tidal.models.llama import SMOLLM2_135M, LlamaForCausalLM
from tidal.serving.engine import Engine, EngineConfig
from tidal.serving.protocol import GenerateRequest, SamplingParams

DEVICE = os.environ.get("TIDAL_TEST_DEVICE", "cuda")
ON_CUDA = DEVICE.startswith("cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(ON_CUDA and not torch.cuda.is_available(), reason="no CUDA device"),
]
sys.path.insert(0, str(Path(__file__).parents[1] / "integration" / "training"))
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
LP_ATOL = 2e-3  # log-probs of float32 models: CPU and cuBLAS / SDPA kernels differ ~1e-5
MiB = 2**20


class _Ids:
    """The tokenizer surface the engine uses, for a model without a tokenizer file."""

    eos_id = 0

    def decode(self, ids: list[int]) -> str:
        return ""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return create_tiny(tmp_path_factory.mktemp("tiny") / "model", seed=1, max_seq_len=256)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A random SmolLM2-135M-shaped Llama, saved (the weight source of a level-2 wake)."""
    out = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM.random(SMOLLM2_135M, seed=0).save(out)
    return out


def _models(kind: str, tiny_dir: Path, llama_dir: Path):
    """(CPU model, model for the device, tokenizer, weights dir): equal weights."""
    if kind == "tiny":
        cpu, tok = load_model(tiny_dir)
        return cpu, copy.deepcopy(cpu), tok, tiny_dir
    cpu = LlamaForCausalLM.random(SMOLLM2_135M, seed=0)
    return cpu, copy.deepcopy(cpu), _Ids(), llama_dir


def _memory() -> tuple[int, int]:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


async def _greedy(engine: Engine, prompts: list[list[int]], n: int, tag: str = "r"):
    async def one(i: int, p: list[int]):
        req = GenerateRequest(
            f"{tag}{i}", p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        )
        chunks = [c async for c in engine.generate(req)]
        return ([t for c in chunks for t in c.token_ids], [lp for c in chunks for lp in c.logprobs])

    return await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])


def _run_engine(model, tok, model_dir, device: str, prompts, n: int):
    async def main():
        engine = Engine(model, tok, model_dir, EngineConfig(device=device, max_batch=16))
        await engine.start()
        try:
            return await _greedy(engine, prompts, n)
        finally:
            await engine.stop()

    return asyncio.run(main())


def _assert_same_greedy(cpu_model, prompts, ref, got) -> None:
    """Same tokens; a split is tolerated only at a near tie of the CPU logits."""
    for p, (rt, rl), (gt, gl) in zip(prompts, ref, got, strict=True):
        n = next((i for i, (a, b) in enumerate(zip(rt, gt, strict=True)) if a != b), len(rt))
        if n < len(rt):
            with torch.no_grad():
                top = cpu_model(torch.tensor([p + rt[:n]]))[0, -1].float().topk(2).values
            assert float(top[0] - top[1]) < 1e-3, f"tokens split at {n} without a tie"
        assert n > 0
        torch.testing.assert_close(torch.tensor(gl[:n]), torch.tensor(rl[:n]), atol=LP_ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["tiny", "llama"])
def test_engine_generation_matches_cpu_greedy(kind, tiny_dir, llama_dir):
    cpu, dev, tok, model_dir = _models(kind, tiny_dir, llama_dir)
    prompts = [[5 + i] * (3 + 5 * i) for i in range(5)]
    ref = _run_engine(cpu, tok, model_dir, "cpu", prompts, 16)
    got = _run_engine(dev, tok, model_dir, DEVICE, prompts, 16)
    assert dev.device.type == DEVICE.split(":")[0]
    _assert_same_greedy(cpu, prompts, ref, got)


def test_sleep_frees_device_memory_and_wake_restores_outputs(tiny_dir, llama_dir):
    _, dev, tok, model_dir = _models("llama", tiny_dir, llama_dir)
    prompts = [[7, 8, 9, 10], [11] * 9]

    async def main():
        engine = Engine(dev, tok, model_dir, EngineConfig(device=DEVICE, max_batch=8))
        await engine.start()
        first = await _greedy(engine, prompts, 12, "a")
        weights = engine.model.weights_nbytes()
        peak = engine.stats()["device_peak_mb"]  # the allocator's peak: summary.json's figure
        assert (peak >= weights / 2**20) if ON_CUDA else peak is None, (peak, weights)
        for level in (1, 2):
            awake = _memory() if ON_CUDA else None
            await engine.sleep(level)
            assert engine.stats()["weights_bytes"] == 0
            if ON_CUDA:
                asleep = _memory()
                assert awake[0] - asleep[0] >= 0.95 * weights, (level, awake, asleep, weights)
                assert awake[1] - asleep[1] >= 0.8 * weights, (level, awake, asleep, weights)
            await engine.wake_up()
            assert {p.device for p in engine.model.parameters()} == {engine.device}
            again = await _greedy(engine, prompts, 12, f"b{level}")
            assert [t for t, _ in again] == [t for t, _ in first]
            for (_, la), (_, lb) in zip(again, first, strict=True):
                torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), atol=1e-5, rtol=0)
        await engine.stop()

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["tiny", "llama"])
def test_kv_exported_on_device_continues_on_cpu_and_back(kind, tiny_dir, llama_dir):
    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save

    cpu, dev, _, _ = _models(kind, tiny_dir, llama_dir)
    dev.to(DEVICE)
    ids = [(7 * i + 3) % 200 + 1 for i in range(40)]
    with torch.no_grad():
        made = dev.new_cache()
        assert made.device == dev.device
        dev.forward_cached([ids[:-1]], [made])
        tensors = made.export_tensors()
        assert {t.device.type for t in tensors.values()} == {"cpu"}
        on_cpu = cpu.cache_from_tensors(st_load(st_save(tensors)))
        own = cpu.new_cache()
        cpu.forward_cached([ids[:-1]], [own])
        a = cpu.forward_cached([ids[-1:]], [on_cpu])
        b = cpu.forward_cached([ids[-1:]], [own])
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
        back = dev.cache_from_tensors(on_cpu.export_tensors())
        assert back.device == dev.device and back.length == len(ids)
        g = dev.forward_cached([[5]], [back])
        c = cpu.forward_cached([[5]], [on_cpu])
        assert g.device == dev.device
        torch.testing.assert_close(g.cpu(), c, atol=1e-3, rtol=1e-3)
        assert int(g.argmax()) == int(c.argmax())


def test_engine_kv_handoff_from_device_engine_to_cpu_engine(tiny_dir):
    cpu, dev, tok, _ = _models("tiny", tiny_dir, tiny_dir)
    prompt = [9, 10, 11, 12, 13, 14]

    async def main():
        a = Engine(dev, tok, tiny_dir, EngineConfig(device=DEVICE))
        b = Engine(cpu, tok, tiny_dir, EngineConfig(device="cpu"))
        await a.start()
        await b.start()
        try:
            [(toks, _)] = await _greedy(a, [prompt], 8, "a")
            cache = a.model.new_cache()
            a.model.forward_cached([prompt + toks], [cache])
            a.kv.pin("x", prompt + toks, cache)
            handle, covered = await b.import_kv(await a.export_kv("x"))
            assert covered == len(prompt) + len(toks)
            req = GenerateRequest(
                "y",
                prompt + toks,
                SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                kv_handle=handle,
            )
            chunks = [c async for c in b.generate(req)]
            assert chunks[0].cached_tokens == covered - 1
            cont = [t for c in chunks for t in c.token_ids]
            [(ref, _)] = await _greedy(b, [prompt], 14, "r")
            assert ref[: len(toks)] == toks and ref[len(toks) :] == cont
        finally:
            await a.stop()
            await b.stop()

    asyncio.run(main())


# -- trainer ---------------------------------------------------------------------------------
def _core(device: str, records, optimizer: str):
    """SGD where two devices are compared (AdamW's first steps are ~lr * sign(g): float noise
    on a near-zero gradient would flip it), AdamW where one device is compared with itself."""
    from satellite_harness import make_core, trainer_config

    lr = 1e-2 if optimizer == "adamw" else 0.5
    cfg = trainer_config().model_copy(
        update={"device": device, "optimizer": optimizer, "lr": lr, "max_grad_norm": 1.0}
    )
    core, buf = make_core(cfg, 0)
    for r in records:
        buf.add(r)
    return core


@pytest.fixture(scope="module")
def records():
    from satellite_harness import build_model, make_records

    return make_records(build_model(0), 16)


def _state_tensors(core) -> list[torch.Tensor]:
    out = [p.detach() for p in core.model.parameters()]
    for st in core.optimizer.state.values():
        out += [v for k, v in st.items() if isinstance(v, torch.Tensor) and k != "step"]
    return out


def test_trainer_step_on_device_matches_cpu(records):
    from satellite_harness import params

    cpu, dev = _core("cpu", records, "sgd"), _core(DEVICE, records, "sgd")
    try:
        assert dev.device.type == DEVICE.split(":")[0]
        for final in (False, True):
            rc, rd = cpu.train_step(final), dev.train_step(final)
            assert rc.group_ids == rd.group_ids
            assert rd.loss == pytest.approx(rc.loss, rel=1e-4, abs=1e-6)
            assert rd.grad_norm == pytest.approx(rc.grad_norm, rel=1e-4)
        torch.testing.assert_close(params(dev.model).cpu(), params(cpu.model), atol=1e-5, rtol=1e-4)
        state = dev.state_dict()  # checkpoints are CPU tensors
        assert {t.device.type for t in state["model"].values()} == {"cpu"}
    finally:
        cpu.close()
        dev.close()


def test_host_stash_reuses_its_pinned_buffers():
    """What offload moves through (the core trainer and satellites): pinned host buffers, one
    per key, allocated once; the values exact both ways; a new shape gets a new buffer."""
    from tidal.models.device import HostStash

    dev = torch.device(DEVICE)
    stash = HostStash()
    a = torch.randn(1000, 33, device=dev, dtype=torch.bfloat16)
    host = stash.to_host("a", a)
    stash.settle()
    assert host.device.type == "cpu" and torch.equal(host, a.cpu())
    assert host.is_pinned() == ON_CUDA
    back = stash.move("a", host, dev)
    assert back.device == a.device and torch.equal(back, a)
    b = a * 2
    again = stash.to_host("a", b)
    stash.settle()
    assert torch.equal(again, b.cpu())
    if ON_CUDA:
        assert again.data_ptr() == host.data_ptr()  # the same pinned buffer
        assert stash.pinned_bytes == a.numel() * a.element_size()
        other = stash.to_host("a", torch.zeros(7, device=dev))
        stash.settle()
        assert other.data_ptr() != host.data_ptr() and other.shape == (7,)


def test_trainer_offload_and_onload_round_trip(records):
    from satellite_harness import params

    core, twin = _core(DEVICE, records, "adamw"), _core(DEVICE, records, "adamw")
    try:
        core.train_step(final=False)  # AdamW state exists now
        twin.train_step(final=False)
        saved = [t.cpu().clone() for t in _state_tensors(core)]
        held = sum(t.numel() * t.element_size() for t in _state_tensors(core))
        before = _memory() if ON_CUDA else None
        core.offload()
        assert core.offloaded == ON_CUDA
        if ON_CUDA:
            after = _memory()
            host = _state_tensors(core)
            assert {t.device.type for t in host} == {"cpu"}
            assert all(t.is_pinned() for t in host)  # the host link's rate, not pageable copies
            assert before[0] - after[0] >= 0.9 * held, (before, after, held)
            pinned = {t.data_ptr() for t in host}
        core.onload()
        assert not core.offloaded
        restored = _state_tensors(core)
        assert {t.device for t in restored} == {core.device}
        assert all(torch.equal(a.cpu(), b) for a, b in zip(restored, saved, strict=True))
        core.offload()  # the next step brings it back by itself
        if ON_CUDA:  # the second offload copies into the first one's buffers: pinned once
            assert {t.data_ptr() for t in _state_tensors(core)} == pinned
            assert all(torch.equal(a, b) for a, b in zip(_state_tensors(core), saved, strict=True))
        rc, rt = core.train_step(final=True), twin.train_step(final=True)
        assert rc.grad_norm == pytest.approx(rt.grad_norm, rel=1e-5)
        torch.testing.assert_close(params(core.model), params(twin.model), atol=1e-6, rtol=1e-5)
    finally:
        core.close()
        twin.close()


def test_satellite_on_device_joins_a_core_on_device(records):
    from satellite_harness import Feeder, make_core, params, ready, trainer_config, wait_for
    from satellite_harness import tiny_dir as harness_dir

    from tidal.training.satellite import ModelSpec, SatelliteConfig, run_satellite

    alone, _ = make_core(trainer_config().model_copy(update={"device": "cpu"}))
    core, buf = make_core(trainer_config().model_copy(update={"device": DEVICE}))
    addr = core.address()
    cfg = SatelliteConfig(
        cell=1,
        rpc_port=addr["rpc_port"],
        store_port=addr["store_port"],
        authkey=addr["authkey"],
        model=ModelSpec(model_dir=str(harness_dir())),
        timeout_s=60.0,
        device=DEVICE,
    )
    proc = mp.get_context("spawn").Process(
        target=run_satellite, args=(cfg.model_dump_json(),), daemon=True
    )
    try:
        for r in records:
            alone.trajectories.add(r)
        expected = [alone.train_step(final=False), alone.train_step(final=True)]
        proc.start()
        feeder = Feeder(
            buf,
            records,
            chunks=[2, 6, 8],
            gate=lambda i: (
                i == 1 and wait_for(lambda: ready(core, 1), 120, "the satellite to join step 0")
            ),
        )
        feeder.start()
        got = [core.train_step(final=False), core.train_step(final=True)]
        by_sat = [r.micro_steps_by_cell.get(1, 0) for r in got]
        assert sum(by_sat) > 0, [r.micro_steps_by_cell for r in got]
        # each trainer's GPU peak rides on its step report (the satellite's on its delivery)
        peaks = got[-1].device_peak_mb if by_sat[-1] else got[0].device_peak_mb
        assert set(peaks) == ({0, 1} if ON_CUDA else set()), peaks
        assert all(mb > 0 for mb in peaks.values())
        for g, e in zip(got, expected, strict=True):
            assert g.grad_norm == pytest.approx(e.grad_norm, rel=1e-4)
        torch.testing.assert_close(
            params(core.model).cpu(), params(alone.model), atol=1e-5, rtol=1e-4
        )
    finally:
        core.close()
        alone.close()
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def test_a_version_published_in_bfloat16_from_the_device_is_the_cast_of_its_values(tmp_path):
    """What a run whose engines all serve in bfloat16 writes (``backends.published_dtype``):
    the trainer's float32 vector on the GPU, each value cast to bfloat16 (as vLLM would cast
    it), read back exactly by safetensors, in half the bytes of the float32 file."""
    from safetensors.torch import load_file

    from tidal.training.flat import ParamLayout
    from tidal.training.transport import FilePublisher

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.Linear(128, 8)).to(DEVICE)
    layout = ParamLayout.of(net)
    flat = layout.params_to_flat(net)
    assert flat.device.type == torch.device(DEVICE).type
    full = FilePublisher(tmp_path / "f32", layout)
    half = FilePublisher(tmp_path / "bf16", layout, dtype=torch.bfloat16)
    full.publish(1, flat)
    half.publish(1, flat)
    got = load_file(half.path(1))
    for name, view in layout.views(flat).items():
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name], view.to(torch.bfloat16).cpu()), name
    assert os.path.getsize(half.path(1)) < 0.55 * os.path.getsize(full.path(1))
