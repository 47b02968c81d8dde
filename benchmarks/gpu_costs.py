"""Costs of the built-in engine and the trainer on one CUDA GPU: the figures the simulator's
engine and trainer models need (decode and prefill speed, sleep / wake, KV handoff, micro-step
and optimizer step, offload / onload, weight publication).

Model: a randomly initialised Llama of SmolLM2-135M's shape (``LlamaForCausalLM.random``; no
weights on disk), in bf16 and fp32. Per dtype, in one process on ``cuda:0``:
- engine decode tokens/s at batch 1, 8, 32, 64 (16-token prompts, 64 new tokens, temperature 1,
  through ``Engine.generate``: continuous batching, CPU sampling) and the mean step time;
- prefill tokens/s (8 sequences of 512 tokens in one ragged ``forward_cached``);
- engine sleep level 1 (spill to disk) and level 2 (drop) and wake seconds, and the GPU bytes
  sleep gives back (``memory_allocated`` and ``memory_reserved`` before minus after);
- KV export (device -> safetensors bytes) and import (bytes -> device cache) seconds per 1,000
  tokens, on a 1,000-token cache;
- trainer micro-step (forward + backward + gradient into the flat sum) seconds per 1,000 tokens
  on a 4,096-token micro-step; the optimizer step (aggregate, clip, AdamW);
- trainer offload / onload seconds (model + AdamW state to CPU memory and back);
- weight publication: parameters to a CPU flat vector, then the safetensors file write.
Times are the best of ``--repeats`` after one warm-up (decode: ``--decode-repeats``, default 1,
Python-bound and steady). Prints a table; ``--out FILE`` writes JSON; progress with elapsed
seconds goes to stderr. Without a CUDA device it says so and exits 0 (``--device cpu --layers 2
--vocab 2048 --train-seq-len 128`` smoke-tests the script itself; it measures nothing).

Run: ``python benchmarks/gpu_costs.py --out gpu_costs.json`` (under 90 s on an H200).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DECODE_BATCHES = (1, 8, 32, 64)
NEW_TOKENS = 64
MiB = 2**20
T0 = time.perf_counter()


def note(what: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {what}", file=sys.stderr, flush=True)


class _Ids:
    """The tokenizer surface the engine uses (decoded text is not needed here)."""

    eos_id = 0

    def decode(self, ids: list[int]) -> str:
        return ""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory(device: torch.device) -> tuple[int, int]:
    if device.type != "cuda":
        return 0, 0
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)


def best(fn, repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


# -- engine -----------------------------------------------------------------------------------
async def _decode(engine, batch: int, tag: str, new_tokens: int = NEW_TOKENS) -> float:
    from tidal.serving.protocol import GenerateRequest, SamplingParams

    vocab = engine.model.vocab_size
    prompts = [[(97 * i + 13 * j) % (vocab - 10) + 10 for j in range(16)] for i in range(batch)]

    async def one(i: int, p: list[int]) -> int:
        req = GenerateRequest(
            f"{tag}-{i}", p, SamplingParams(max_tokens=new_tokens, temperature=1.0, ignore_eos=True)
        )
        return sum([len(c.token_ids) async for c in engine.generate(req)])

    t0 = time.perf_counter()
    made = await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
    dt = time.perf_counter() - t0
    assert sum(made) == batch * new_tokens, made
    return dt


async def engine_costs(model, weights_dir: Path, device: torch.device, decode_repeats: int) -> dict:
    from tidal.serving.engine import Engine, EngineConfig

    engine = Engine(
        model,
        _Ids(),
        weights_dir,
        EngineConfig(name="bench", device=str(device), max_batch=max(DECODE_BATCHES), seed=0),
    )
    await engine.start()
    out: dict = {}
    try:
        await _decode(engine, 8, "warm", 8)
        note("engine warm")
        for b in DECODE_BATCHES:
            dt = min([await _decode(engine, b, f"d{b}-{r}") for r in range(decode_repeats)])
            out[f"decode_tok_s_b{b}"] = b * NEW_TOKENS / dt
            out[f"decode_step_ms_b{b}"] = 1000 * dt / NEW_TOKENS
            note(f"decode batch {b}: {b * NEW_TOKENS / dt:.0f} tok/s")
        for level in (1, 2):
            before = memory(device)
            t0 = time.perf_counter()
            await engine.sleep(level)
            out[f"sleep{level}_s"] = time.perf_counter() - t0
            after = memory(device)
            out[f"sleep{level}_freed_allocated_mib"] = (before[0] - after[0]) / MiB
            out[f"sleep{level}_freed_reserved_mib"] = (before[1] - after[1]) / MiB
            t0 = time.perf_counter()
            await engine.wake_up()
            sync(device)
            out[f"wake{level}_s"] = time.perf_counter() - t0
            note(f"sleep / wake level {level}")
        await _decode(engine, 8, "after-wake", 8)  # still serves
    finally:
        await engine.stop()
    return out


def prefill_and_kv(model, device: torch.device, repeats: int) -> dict:
    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save

    vocab = model.vocab_size
    seqs = [[(31 * i + 7 * j) % (vocab - 10) + 10 for j in range(512)] for i in range(8)]
    with torch.no_grad():
        model.forward_cached([s[:32] for s in seqs], [model.new_cache() for _ in seqs])  # warm
        t = best(
            lambda: model.forward_cached(seqs, [model.new_cache() for _ in seqs]), repeats, device
        )
        out = {"prefill_tok_s": 8 * 512 / t}
        cache = model.new_cache()
        model.forward_cached([[(5 * j) % (vocab - 10) + 10 for j in range(1000)]], [cache])
        blob = st_save(cache.export_tensors())
        out["kv_export_s_per_1k_tokens"] = best(
            lambda: st_save(cache.export_tensors()), repeats, device
        )
        out["kv_import_s_per_1k_tokens"] = best(
            lambda: model.cache_from_tensors(st_load(blob)), repeats, device
        )
        out["kv_mib_per_1k_tokens"] = len(blob) / MiB
    note("prefill and KV")
    return out


# -- trainer ----------------------------------------------------------------------------------
def _micro_step(vocab: int, n_seqs: int, length: int):
    from tidal.training.packing import MicroStep, PackedSequence

    g = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(n_seqs):
        ids = torch.randint(10, vocab, (length,), generator=g).tolist()
        trainable = [j >= 64 for j in range(length)]
        seqs.append(
            PackedSequence(
                f"e{i}",
                ids,
                trainable,
                [-3.0] * length,
                [0] * length,
                1.0 if i % 2 else -1.0,
                1.0 / (length - 64),
            )
        )
    return MicroStep(0, 0, 0, seqs)


def trainer_costs(model, device: torch.device, repeats: int, seq_len: int) -> dict:
    from tidal.clock import WallClock
    from tidal.training.aggregate import aggregate, clip_
    from tidal.training.core import CoreTrainer, TrainerConfig
    from tidal.training.trajectory_buffer import TrajectoryBuffer, TrajectoryBufferConfig
    from tidal.training.transport import FilePublisher

    clock = WallClock()
    buf = TrajectoryBuffer(TrajectoryBufferConfig(group_size=4), clock)
    model.train()
    core = CoreTrainer(model, TrainerConfig(device=str(device), lr=1e-5), buf, clock)
    out: dict = {}
    try:
        ms = _micro_step(model.config.vocab_size, 4, seq_len)
        tokens = ms.n_tokens()
        w = core.worker

        def micro() -> None:
            w.compute(ms)
            w.commit()

        def update() -> None:
            grad = aggregate([w.contribution()], 4)
            clip_(grad, 1.0)
            core.layout.flat_to_grads_(core.model, grad)
            core.optimizer.step()
            core.optimizer.zero_grad(set_to_none=True)

        w.reset()
        micro()  # warm-up: kernels, autograd buffers
        update()  # warm-up: AdamW state
        out["micro_step_s_per_1k_tokens"] = best(micro, repeats, device) * 1000 / tokens
        out["micro_step_tokens"] = tokens
        out["optimizer_step_s"] = best(update, repeats, device)
        note("micro-step and optimizer step")
        with tempfile.TemporaryDirectory() as tmp:
            pub = FilePublisher(tmp, core.layout, keep=1)
            flat = core.layout.params_to_flat(core.model)
            out["publish_to_cpu_s"] = best(
                lambda: core.layout.params_to_flat(core.model, flat), repeats, device
            )
            versions = iter(range(1, 100))
            out["publish_write_s"] = best(
                lambda: pub.publish(next(versions), flat), repeats, device
            )
        out["checkpoint_state_to_cpu_s"] = best(core.state_dict, repeats, device)
        note("publication")
        if device.type == "cuda":
            offs, ons, freed = [], [], []
            for _ in range(repeats):
                before = memory(device)
                t0 = time.perf_counter()
                core.offload()
                offs.append(time.perf_counter() - t0)
                freed.append((before[0] - memory(device)[0]) / MiB)
                t0 = time.perf_counter()
                core.onload()
                sync(device)
                ons.append(time.perf_counter() - t0)
            out["offload_s"], out["onload_s"] = min(offs), min(ons)
            out["offload_freed_allocated_mib"] = max(freed)
            note("offload / onload")
    finally:
        core.close()
    return out


# -- main -------------------------------------------------------------------------------------
def run(
    dtype_name: str, shape: dict, device: torch.device, args: argparse.Namespace, tmp: Path
) -> dict:
    from tidal.models.llama import LlamaForCausalLM

    dtype = DTYPES[dtype_name]
    weights = tmp / "weights"
    if not weights.exists():  # the level-2 wake's source; read as fp32 and cast on load
        LlamaForCausalLM.random(shape, seed=0).save(weights)
    t0 = time.perf_counter()
    model = LlamaForCausalLM.random(shape, seed=0, dtype=dtype, device=device)
    res = {
        "params": model.num_params(),
        "weights_mib": model.weights_nbytes() / MiB,
        "build_s": time.perf_counter() - t0,
    }
    res.update(asyncio.run(engine_costs(model, weights, device, args.decode_repeats)))
    res.update(prefill_and_kv(model, device, args.repeats))
    del model
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(0)  # the trainer trains the transformers model of the same shape
    trained = HFLlama(HFLlamaConfig(**shape)).to(device=device, dtype=dtype)
    res.update(trainer_costs(trained, device, args.repeats, args.train_seq_len))
    del trained
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def print_table(results: dict[str, dict], title: str) -> None:
    keys = list(next(iter(results.values())))
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        for k in keys:
            print(f"{k:36s}" + "".join(f"{results[d][k]:>14.4g}" for d in results))
        return
    table = Table(title=title)
    table.add_column("figure")
    for d in results:
        table.add_column(d, justify="right")
    for k in keys:
        table.add_row(k, *(f"{results[d][k]:.4g}" for d in results))
    Console().print(table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--repeats", type=int, default=2, help="best of N (decode: see below)")
    ap.add_argument(
        "--decode-repeats",
        type=int,
        default=1,
        help="decode runs per batch size after the warm-up (Python-bound, steady)",
    )
    ap.add_argument("--device", default="cuda", help="cuda[:N]; 'cpu' only smoke-tests this script")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (smoke tests)")
    ap.add_argument("--vocab", type=int, default=None, help="smaller vocabulary (smoke tests)")
    ap.add_argument(
        "--train-seq-len",
        type=int,
        default=1024,
        help="tokens per sequence of the 4-sequence trainer micro-step",
    )
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            f"gpu_costs: torch {torch.__version__} sees no CUDA device; nothing to measure "
            f"(run this on a GPU machine)"
        )
        return 0
    from tidal.models.device import describe_devices, resolve_device
    from tidal.models.llama import SMOLLM2_135M

    device = resolve_device(args.device)
    torch.manual_seed(0)
    shape = dict(SMOLLM2_135M)
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    if args.vocab:
        shape["vocab_size"] = args.vocab
    t0 = time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.dtypes.split(","):
            note(f"{name}: start")
            results[name] = run(name, shape, device, args, Path(tmp))
            note(f"{name}: done")
    where = describe_devices() if device.type == "cuda" else "cpu (smoke test)"
    title = (
        f"SmolLM2-135M-shaped Llama ({shape['num_hidden_layers']} layers, random weights) "
        f"on {where}"
    )
    print_table(results, title)
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "device": where,
                    "torch": torch.__version__,
                    "shape": shape,
                    "decode_new_tokens": NEW_TOKENS,
                    "repeats": args.repeats,
                    "decode_repeats": args.decode_repeats,
                    "wall_s": round(time.perf_counter() - t0, 2),
                    "results": results,
                },
                indent=2,
            )
        )
    print(f"total {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    sys.exit(main())
