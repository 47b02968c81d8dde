"""The GPU check's built-in engine steps, on the big model (the Qwen2.5-7B shape, random weights
made on the device): each takes a ``Ctx`` and fills ``Figures``.

- ``engine_vs_cpu``: greedy tokens and log-probs of the engine on the device against the same
  engine and weights on the CPU (float32 both sides: tokens agree up to a near tie of the CPU
  logits, log-probs to float32 kernel noise);
- ``decode``: ``Engine.generate`` tokens/s in bf16 at each batch size, beside
  ``tidal.sim.perf``'s prediction for this GPU and shape;
- ``sleep_wake``: ``Engine.sleep`` level 1 (into pinned host buffers kept across sleeps: twice,
  the second reusing them) and 2 (drop; wake reads the weights' file) and ``wake_up``:
  seconds, GPU memory before and after (torch and ``nvidia-smi``), same greedy tokens after.
"""

from __future__ import annotations

import asyncio
import time

import torch
from kit import TOKENIZER, Figures, MiB, Skip, engine_model, free_bytes, memory, sim_engine, sync

LP_ATOL = 2e-3  # float32 log-probs: CPU and cuBLAS / SDPA kernels differ by ~1e-5
TIE = 1e-3  # a greedy split is tolerated only where the CPU's two best logits are this close


def prompts(n: int, vocab: int, length) -> list[list[int]]:
    return [[(97 * i + 13 * j) % (vocab - 10) + 10 for j in range(length(i))] for i in range(n)]


async def greedy(engine, batch: list[list[int]], n: int, tag: str, temperature: float = 0.0):
    """(tokens, log-probs) of each prompt, all submitted at once (one continuous batch)."""
    from tidal.serving.protocol import GenerateRequest, SamplingParams

    async def one(i: int, p: list[int]):
        req = GenerateRequest(
            f"{tag}{i}", p, SamplingParams(max_tokens=n, temperature=temperature, ignore_eos=True)
        )
        chunks = [c async for c in engine.generate(req)]
        return ([t for c in chunks for t in c.token_ids], [lp for c in chunks for lp in c.logprobs])

    return await asyncio.gather(*[one(i, p) for i, p in enumerate(batch)])


def new_engine(model, device: torch.device, max_batch: int, weights_dir="/nonexistent"):
    from tidal.serving.engine import Engine, EngineConfig

    return Engine(
        model,
        TOKENIZER,
        weights_dir,
        EngineConfig(name="check", device=str(device), max_batch=max_batch, seed=0),
    )


def run_greedy(model, device: torch.device, batch: list[list[int]], n: int):
    async def main():
        engine = new_engine(model, device, len(batch))
        await engine.start()
        try:
            return await greedy(engine, batch, n, "g")
        finally:
            await engine.stop()

    return asyncio.run(main())


def engine_vs_cpu(ctx, figs: Figures) -> None:
    from tidal.models.llama import LlamaConfig, LlamaForCausalLM

    s = ctx.sizes
    dev = engine_model(ctx.big, ctx.device, torch.float32, seed=0)
    batch = prompts(s.compare_prompts, dev.vocab_size, lambda i: 4 + 5 * i)
    t0 = time.perf_counter()
    got = run_greedy(dev, ctx.device, batch, s.compare_tokens)
    figs.add("device engine (fp32) greedy", time.perf_counter() - t0, "s")
    with torch.device("meta"):
        cpu = LlamaForCausalLM(LlamaConfig.model_validate(ctx.big))
    cpu.materialize("cpu")
    cpu.load_weights(dict(dev.named_parameters()))  # the same values, copied to the CPU
    cpu.eval()
    del dev
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    ref = run_greedy(cpu, torch.device("cpu"), batch, s.compare_tokens)
    figs.add("CPU engine (fp32) greedy", time.perf_counter() - t0, "s")
    same, lp_err, splits = 0, 0.0, []
    for p, (rt, rl), (gt, gl) in zip(batch, ref, got, strict=True):
        n = next((i for i, (a, b) in enumerate(zip(rt, gt, strict=True)) if a != b), len(rt))
        same += n == len(rt)
        if n < len(rt):
            with torch.no_grad():
                top = cpu(torch.tensor([p + rt[:n]]))[0, -1].float().topk(2).values
            gap = float(top[0] - top[1])
            splits.append(n)
            figs.check(gap < TIE, f"tokens split at {n} where the CPU's top-2 gap is {gap:.3g}")
        if n:
            lp_err = max(lp_err, max(abs(a - b) for a, b in zip(rl[:n], gl[:n], strict=True)))
    figs.add(
        "sequences with equal greedy tokens",
        f"{same}/{len(batch)}",
        note=f"{s.compare_tokens} tokens each" + (f"; splits at {splits}" if splits else ""),
    )
    figs.add("max abs log-prob difference", lp_err, "nats", note=f"bound {LP_ATOL}")
    figs.check(lp_err <= LP_ATOL, f"log-probs differ by {lp_err:.3g} > {LP_ATOL}")


async def _decode_s(engine, batch: int, prompt_tokens: int, new_tokens: int, tag: str) -> float:
    vocab = engine.model.vocab_size
    t0 = time.perf_counter()
    out = await greedy(
        engine, prompts(batch, vocab, lambda i: prompt_tokens), new_tokens, tag, temperature=1.0
    )
    dt = time.perf_counter() - t0
    made = sum(len(t) for t, _ in out)
    if made != batch * new_tokens:
        raise RuntimeError(f"decode at batch {batch}: {made} tokens, {batch * new_tokens} asked")
    return dt


def decode(ctx, figs: Figures) -> None:
    s = ctx.sizes
    model = engine_model(ctx.big, ctx.device, torch.bfloat16, seed=0)
    figs.add(
        "weights (bf16)",
        model.weights_nbytes() / 2**30,
        "GiB",
        note=f"{model.num_params() / 1e9:.2f} B parameters",
    )
    sim, _ = sim_engine(ctx.big, ctx.gpu, ctx.tmp)
    ctx_per_seq = s.prompt_tokens + s.new_tokens / 2

    async def main():
        engine = new_engine(model, ctx.device, max(s.decode_batches))
        await engine.start()
        try:
            await _decode_s(engine, 8, s.prompt_tokens, 4, "warm")
            for b in s.decode_batches:
                dt = await _decode_s(engine, b, s.prompt_tokens, s.new_tokens, f"d{b}-")
                figs.add(
                    f"decode b={b}",
                    b * s.new_tokens / dt,
                    "tok/s",
                    sim=sim.throughput_tok_s(b, ctx_per_seq),
                    note=f"{1000 * dt / s.new_tokens:.1f} ms/step incl. prefill; sim for {ctx.gpu}",
                )
        finally:
            await engine.stop()

    asyncio.run(main())


def sleep_wake(ctx, figs: Figures) -> None:
    from safetensors.torch import save_file

    model = engine_model(ctx.big, ctx.device, torch.bfloat16, seed=0)
    weights = model.weights_nbytes()
    need = 2 * weights + 2**30  # the level-2 source written here, the level-1 spill in /tmp
    if free_bytes(ctx.tmp) < need:
        raise Skip(
            f"{need / 2**30:.0f} GiB of disk needed under {ctx.tmp}, "
            f"{free_bytes(ctx.tmp) / 2**30:.0f} GiB free"
        )
    source = ctx.tmp / "weights"
    source.mkdir()
    t0 = time.perf_counter()
    save_file(
        {k: v.detach().cpu() for k, v in model.named_parameters()},
        str(source / "model.safetensors"),
    )
    figs.add(
        "weights written (wake level 2's source)",
        time.perf_counter() - t0,
        "s",
        note=f"{weights / 2**30:.1f} GiB bf16",
    )
    batch = prompts(2, model.vocab_size, lambda i: 5 + 4 * i)

    async def main():
        engine = new_engine(model, ctx.device, 4, source)
        await engine.start()
        try:
            first = await greedy(engine, batch, 8, "a")
            # level 1 twice: the first sleep allocates and pins its host buffers, the second
            # reuses them (what every later move costs)
            for level, tag in ((1, ""), (1, " again"), (2, "")):
                await _sleep_wake(engine, level, figs, ctx.device, weights, tag)
                again = await greedy(engine, batch, 8, f"b{level}{tag.strip()}")
                figs.check(
                    [t for t, _ in again] == [t for t, _ in first],
                    f"level {level}{tag}: greedy tokens changed across sleep and wake",
                )
        finally:
            await engine.stop()

    asyncio.run(main())


async def _sleep_wake(
    engine, level: int, figs: Figures, device: torch.device, weights: int, tag: str = ""
) -> None:
    awake = memory(device)
    t0 = time.perf_counter()
    await engine.sleep(level)
    sync(device)
    took = time.perf_counter() - t0
    pinned = engine._stash.pinned_bytes if level == 1 else 0
    figs.add(
        f"sleep level {level}{tag} (rollout -> training)",
        took,
        "s",
        note=f"{weights / took / 1e9:.1f} GB/s"
        + (f", {pinned / 2**30:.1f} GiB pinned host buffers" if pinned else ""),
    )
    asleep = memory(device)
    t0 = time.perf_counter()
    await engine.wake_up()
    sync(device)
    took = time.perf_counter() - t0
    figs.add(
        f"wake level {level}{tag} (training -> rollout)",
        took,
        "s",
        note=f"{weights / took / 1e9:.1f} GB/s",
    )
    if tag:
        return
    if device.type != "cuda":
        figs.add(f"level {level} GPU memory freed", "n/a", note="no GPU memory on the CPU")
        return
    freed = awake["allocated_mib"] - asleep["allocated_mib"]
    figs.add(
        f"level {level} allocated freed",
        freed / 1024,
        "GiB",
        note=f"{awake['allocated_mib'] / 1024:.1f} -> {asleep['allocated_mib'] / 1024:.1f}",
    )
    figs.add(
        f"level {level} reserved freed",
        (awake["reserved_mib"] - asleep["reserved_mib"]) / 1024,
        "GiB",
    )
    if awake["smi_mib"] is not None and asleep["smi_mib"] is not None:
        figs.add(
            f"level {level} nvidia-smi used",
            f"{awake['smi_mib']:.0f} -> {asleep['smi_mib']:.0f}",
            "MiB",
        )
    figs.check(
        freed * MiB >= 0.95 * weights,
        f"level {level}: sleep freed {freed:.0f} MiB of {weights / MiB:.0f} MiB weights",
    )
