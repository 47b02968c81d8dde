"""The GPU check's trainer steps: tidal's ``CoreTrainer`` on the device, fed execution records
through its trajectory buffer (``train_step``, the path a run takes).

- ``trainer_precision``: one SGD step of the SmolLM2-135M-shaped transformers model, FSDP2 in
  bf16 (one rank) against the plain module in float32, from the same weights and records: the
  relative difference of the two updates;
- ``trainer_offload``: one AdamW step of the Qwen2.5-7B-shaped model in bf16 (as many layers as
  fit the plain trainer in a share of the GPU), its peak memory, then ``offload`` / ``onload``
  seconds and bytes, the values restored exactly;
- ``weight_update``: a hybrid cell on one GPU: the core publishes the 7B-shaped model the way a
  run does (``FilePublisher``: a safetensors file) and the built-in engine on the same GPU loads
  it (``Engine.update_weights``), beside a plain device-to-device copy of the same tensors;
- ``fsdp_two_ranks``: FSDP2 over two NCCL ranks, which needs a GPU per rank.
"""

from __future__ import annotations

import asyncio
import random
import time

import torch
from kit import (
    TRAINER_BYTES_PER_PARAM,
    Figures,
    GiB,
    Skip,
    engine_model,
    free_bytes,
    memory,
    mid_shape,
    params_of,
    sync,
    trainer_model,
    with_layers,
)

GROUP_SIZE = 4
MAX_REL_UPDATE_DIFF = 0.1  # bf16 compute moves an update by a few percent at most


def records(vocab: int, groups: int, out_tokens: int, seed: int = 1) -> list:
    """Random prompts and outputs; behaviour log-probs near a uniform model's."""
    from tidal.training.records import single_call_record

    rng = random.Random(seed)
    uniform = -float(torch.log(torch.tensor(float(vocab))))
    out = []
    for g in range(groups):
        prompt = [rng.randrange(10, vocab) for _ in range(32)]
        for i in range(GROUP_SIZE):
            ids = [rng.randrange(10, vocab) for _ in range(out_tokens)]
            lps = [uniform + rng.uniform(-0.3, 0.3) for _ in ids]
            out.append(
                single_call_record(
                    f"g{g}-e{i}",
                    f"g{g}",
                    prompt,
                    ids,
                    lps,
                    weight_version=0,
                    reward=float(i % 2) + 0.1 * g,
                )
            )
    return out


def core_trainer(
    model, device: torch.device, optimizer: str, recs: list, shard=None, publishers=None
):
    from tidal.clock import WallClock
    from tidal.training.core import CoreTrainer, TrainerConfig
    from tidal.training.packing import PackingConfig
    from tidal.training.trajectory_buffer import TrajectoryBuffer, TrajectoryBufferConfig

    clock = WallClock()
    buf = TrajectoryBuffer(TrajectoryBufferConfig(group_size=GROUP_SIZE), clock)
    lr = 0.5 if optimizer == "sgd" else 1e-5
    cfg = TrainerConfig(
        device=str(device),
        optimizer=optimizer,
        lr=lr,
        max_grad_norm=None,
        groups_per_step=max(1, len(recs) // GROUP_SIZE),
        packing=PackingConfig(token_budget=4096),
        shard=shard,
    )
    core = CoreTrainer(model, cfg, buf, clock, publishers=publishers)
    for r in recs:
        buf.add(r)
    return core


def _one_step(ctx, start, recs, shard) -> tuple[torch.Tensor, object, float]:
    model = trainer_model(mid_shape(ctx.sizes), torch.device("cpu"), torch.float32, seed=0)
    from tidal.training.flat import ParamLayout

    ParamLayout.of(model).flat_to_params_(model, start)
    core = core_trainer(model, ctx.device, "sgd", recs, shard)
    try:
        t0 = time.perf_counter()
        report = core.train_step(final=False)
        sync(ctx.device)
        return core.full_params(), report, time.perf_counter() - t0
    finally:
        core.close()


def _precision(ctx, figs: Figures, ranks: int) -> None:
    from tidal.training.flat import ParamLayout
    from tidal.training.sharded import ShardConfig

    shape = mid_shape(ctx.sizes)
    recs = records(shape["vocab_size"], ctx.sizes.train_groups, ctx.sizes.train_output_tokens)
    base = trainer_model(shape, torch.device("cpu"), torch.float32, seed=0)
    start = ParamLayout.of(base).params_to_flat(base)
    fp32, r32, s32 = _one_step(ctx, start, recs, None)
    bf16, r16, s16 = _one_step(ctx, start, recs, ShardConfig(ranks=ranks, mixed_precision="bf16"))
    rel = float((bf16 - fp32).norm() / (fp32 - start).norm())
    figs.add("fp32 step (plain module)", s32, "s", note=f"{r32.n_tokens} tokens")
    figs.add(f"bf16 step (FSDP2, {ranks} rank{'s' * (ranks > 1)})", s16, "s")
    figs.add("update relative difference", rel, note=f"bound {MAX_REL_UPDATE_DIFF}")
    figs.add("grad-norm relative difference", abs(r16.grad_norm / r32.grad_norm - 1))
    figs.add("loss difference", abs(r16.loss - r32.loss))
    figs.check(rel < MAX_REL_UPDATE_DIFF, f"bf16 update differs by {rel:.3g} (relative)")


def trainer_precision(ctx, figs: Figures) -> None:
    _precision(ctx, figs, 1)


def fsdp_two_ranks(ctx, figs: Figures) -> None:
    n = torch.cuda.device_count() if ctx.device.type == "cuda" else 0
    if n < 2:
        raise Skip(
            f"FSDP2 over NCCL ranks needs one GPU per rank: {n} GPU(s) here "
            "(tidal refuses shard.ranks beyond the GPUs it sees)"
        )
    _precision(ctx, figs, 2)


def _trainer_layers(ctx) -> tuple[dict, int]:
    """The big shape with as many layers as the plain bf16 AdamW trainer fits in its share."""
    shape = ctx.big
    if ctx.device.type != "cuda":
        return shape, shape["num_hidden_layers"]
    budget = torch.cuda.get_device_properties(ctx.device).total_memory
    budget *= ctx.sizes.trainer_memory_share
    fixed = params_of(with_layers(shape, 0))
    per_layer = params_of(with_layers(shape, 1)) - fixed
    fits = int((budget / TRAINER_BYTES_PER_PARAM - fixed) // per_layer)
    layers = min(shape["num_hidden_layers"], fits)
    if layers < 1:
        raise Skip(f"not one layer of the big shape fits {budget / GiB:.0f} GiB")
    return with_layers(shape, layers), layers


def trainer_offload(ctx, figs: Figures) -> None:
    from tidal.sim.profiles import load_gpu

    full = params_of(ctx.big)
    figs.add(
        f"{ctx.big['num_hidden_layers']}-layer model in the plain bf16 trainer",
        full * TRAINER_BYTES_PER_PARAM / GiB,
        "GiB",
        note=f"{TRAINER_BYTES_PER_PARAM} B/parameter (weights, grads, 3 fp32 vectors, AdamW)",
    )
    shape, layers = _trainer_layers(ctx)
    model = trainer_model(shape, ctx.device, torch.bfloat16, seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    figs.add("trainer layers (of the big shape)", layers, note=f"{n_params / 1e9:.2f} B params")
    recs = records(shape["vocab_size"], ctx.sizes.train_groups, ctx.sizes.train_output_tokens)
    core = core_trainer(model, ctx.device, "adamw", recs)
    try:
        if ctx.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(ctx.device)
        t0 = time.perf_counter()
        report = core.train_step(final=False)
        sync(ctx.device)
        step_s = time.perf_counter() - t0
        figs.add(
            "AdamW step (bf16)",
            step_s,
            "s",
            note=f"{report.n_tokens} trainable tokens; "
            f"compute {report.compute_s:.2f} s, update {report.update_s:.2f} s",
        )
        if ctx.device.type != "cuda":
            figs.add("offload / onload", "n/a", note="a no-op on the CPU")
            return
        figs.add(
            "peak allocated in the step", torch.cuda.max_memory_allocated(ctx.device) / GiB, "GiB"
        )
        _offload_onload(core, ctx, figs, load_gpu(ctx.gpu).host_gb_s)
    finally:
        core.close()


def _offload_onload(core, ctx, figs: Figures, host_gb_s: float) -> None:
    state = [*core.model.parameters()] + [
        v
        for st in core.optimizer.state.values()
        for k, v in st.items()
        if isinstance(v, torch.Tensor) and k != "step"
    ]
    held = sum(t.numel() * t.element_size() for t in state)
    sums = [float(t.float().sum()) for t in state[:: max(1, len(state) // 16)]]
    before = memory(ctx.device)
    t0 = time.perf_counter()
    core.offload()
    off_s = time.perf_counter() - t0
    after = memory(ctx.device)
    t0 = time.perf_counter()
    core.onload()
    sync(ctx.device)
    on_s = time.perf_counter() - t0
    figs.add("weights + AdamW state held", held / GiB, "GiB")
    figs.add(
        "offload (training -> rollout; pins host buffers)",
        off_s,
        "s",
        note=f"{held / off_s / 1e9:.1f} GB/s; host link {host_gb_s:.0f} GB/s in hardware.yaml",
    )
    figs.add("onload (rollout -> training)", on_s, "s", note=f"{held / on_s / 1e9:.1f} GB/s")
    freed = (before["allocated_mib"] - after["allocated_mib"]) / 1024
    figs.add(
        "offload freed (allocated)",
        freed,
        "GiB",
        note=f"nvidia-smi {before['smi_mib']} -> {after['smi_mib']} MiB",
    )
    # the second round trip: the host buffers the first offload pinned are reused
    t0 = time.perf_counter()
    core.offload()
    again_off_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    core.onload()
    sync(ctx.device)
    again_on_s = time.perf_counter() - t0
    figs.add(
        "offload again (buffers pinned)",
        again_off_s,
        "s",
        note=f"{held / again_off_s / 1e9:.1f} GB/s",
    )
    figs.add("onload again", again_on_s, "s", note=f"{held / again_on_s / 1e9:.1f} GB/s")
    state = [*core.model.parameters()] + [
        v
        for st in core.optimizer.state.values()
        for k, v in st.items()
        if isinstance(v, torch.Tensor) and k != "step"
    ]
    again = [float(t.float().sum()) for t in state[:: max(1, len(state) // 16)]]
    figs.check(again == sums, "offload + onload changed the trainer's state")
    figs.check(freed * GiB >= 0.9 * held, f"offload freed {freed:.1f} GiB of {held / GiB:.1f}")


def weight_update(ctx, figs: Figures) -> None:
    from engine_steps import new_engine

    from tidal.training.flat import ParamLayout
    from tidal.training.transport import FilePublisher

    engine_m = engine_model(ctx.big, ctx.device, torch.bfloat16, seed=0)
    nbytes = engine_m.weights_nbytes()
    file_bytes = 2 * nbytes  # published as float32
    if free_bytes(ctx.tmp) < file_bytes + GiB:
        raise Skip(
            f"the float32 file needs {file_bytes / GiB:.0f} GiB under {ctx.tmp}, "
            f"{free_bytes(ctx.tmp) / GiB:.0f} GiB free"
        )
    trained = trainer_model(ctx.big, ctx.device, torch.bfloat16, seed=1)
    pub = FilePublisher(ctx.tmp / "published", ParamLayout.of(trained), keep=1)
    core = core_trainer(trained, ctx.device, "sgd", [], publishers=[pub])
    engine = new_engine(engine_m, ctx.device, 4)
    try:
        core.version = 1
        t0 = time.perf_counter()
        core.publish()
        pub_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        asyncio.run(engine.update_weights(pub.path(1), "v1"))
        sync(ctx.device)
        load_s = time.perf_counter() - t0
        own = dict(trained.named_parameters())
        figs.check(
            all(torch.equal(p, own[n]) for n, p in engine_m.named_parameters()),
            "the engine's weights differ from the trainer's after the update",
        )
        total = pub_s + load_s
        figs.add(
            "tidal: publish (FilePublisher, fp32 file)",
            pub_s,
            "s",
            note=f"{file_bytes / GiB:.1f} GiB file",
        )
        figs.add("tidal: engine load (update_weights)", load_s, "s")
        figs.add(
            "tidal: trainer -> engine",
            nbytes / total / 1e9,
            "GB/s",
            note=f"{nbytes / GiB:.1f} GiB bf16 weights in {total:.2f} s",
        )
        d2d_s = min(_copy_s(engine_m, own, ctx.device) for _ in range(2))
        figs.add(
            "plain device-to-device copy",
            nbytes / d2d_s / 1e9,
            "GB/s",
            note=f"{d2d_s * 1000:.1f} ms; tidal's path takes {total / d2d_s:.0f}x",
        )
    finally:
        core.close()


def _copy_s(engine_m, own: dict, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        for n, p in engine_m.named_parameters():
            p.copy_(own[n])
    sync(device)
    return time.perf_counter() - t0
