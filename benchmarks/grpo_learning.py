"""GRPO on the bundled addition task: does mean reward rise within a few minutes on CPU?

Each step: the rollout model (a separate copy, the "engine") samples ``group_size`` completions
for each of ``groups`` problems at weight version v, recording token ids, log-probs and v as
the proxy would; rewards come from ``tidal.training.tasks.reward``; the records go through the
trajectory buffer (max policy lag 1) into ``CoreTrainer.train_step`` (packing, GRPO loss,
aggregation, clipping, AdamW); the core publishes v+1 over shared memory and the rollout model
loads it in place. Greedy accuracy on a fixed held-out set is measured before and after.

Run: ``.venv/bin/python benchmarks/grpo_learning.py --model tiny`` (about 2 minutes) or
``--model smollm2`` (needs ``tidal model fetch smollm2-135m``; about 5 minutes).
Writes ``<out>/<model>_reward.png`` and ``<out>/<model>_metrics.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import torch

from tidal.clock import WallClock
from tidal.contracts.calls import ExecutionRecord
from tidal.models import create_tiny, fetch, load_model, load_training_model
from tidal.training.core import CoreTrainer, TrainerConfig
from tidal.training.flat import ParamLayout
from tidal.training.loss import GRPOLossConfig
from tidal.training.packing import PackingConfig
from tidal.training.records import single_call_record
from tidal.training.tasks import AdditionTask, Problem, reward
from tidal.training.trajectory_buffer import TrajectoryBuffer, TrajectoryBufferConfig
from tidal.training.transport import SharedMemoryTransport, load_into

PRESETS = {
    "tiny": {
        "groups": 16,
        "group_size": 8,
        "max_new": 3,
        "lr": 1e-3,
        "steps": 300,
        "minutes": 3.0,
        "budget": 4096,
        "chat": False,
    },
    "smollm2": {
        "groups": 4,
        "group_size": 6,
        "max_new": 6,
        "lr": 3e-6,
        "steps": 20,
        "minutes": 15.0,
        "budget": 1024,
        "chat": True,
    },
}


@torch.no_grad()
def sample(
    model, prompts: list[list[int]], max_new: int, eos_id: int, gen: torch.Generator | None
) -> tuple[list[list[int]], list[list[float]]]:
    """Batched decoding with per-sequence KV caches; greedy when ``gen`` is None."""
    caches = [model.new_cache() for _ in prompts]
    logits = model.forward_cached([list(p) for p in prompts], caches)
    outs: list[list[int]] = [[] for _ in prompts]
    lps: list[list[float]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    for t in range(max_new):
        logp = torch.log_softmax(logits.float(), dim=-1)
        if gen is None:
            tok = logp.argmax(dim=-1)
        else:
            tok = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)
        still = []
        for j, i in enumerate(active):
            outs[i].append(int(tok[j]))
            lps[i].append(float(logp[j, tok[j]]))
            if int(tok[j]) != eos_id:
                still.append(i)
        if not still or t == max_new - 1:
            break
        logits = model.forward_cached([[outs[i][-1]] for i in still], [caches[i] for i in still])
        active = still
    return outs, lps


def encode(tok, problem: Problem, chat: bool) -> list[int]:
    return tok.apply_chat_template(problem.messages()) if chat else tok.encode(problem.text())


def rollout(
    model,
    tok,
    problems: list[Problem],
    group_size: int,
    version: int,
    step: int,
    chat: bool,
    max_new: int,
    gen,
) -> list[ExecutionRecord]:
    prompts = [encode(tok, p, chat) for p in problems for _ in range(group_size)]
    outs, lps = sample(model, prompts, max_new, tok.eos_id, gen)
    records = []
    for k, (prompt, out, lp) in enumerate(zip(prompts, outs, lps, strict=True)):
        problem = problems[k // group_size]
        r = reward(tok.decode([t for t in out if t != tok.eos_id]), problem.answer)
        records.append(
            single_call_record(
                f"s{step}-e{k}", f"s{step}-g{k // group_size}", prompt, out, lp, version, r
            )
        )
    return records


def greedy_eval(model, tok, problems, chat, max_new) -> tuple[float, float]:
    """(mean reward, accuracy) of greedy answers on held-out problems."""
    outs, _ = sample(model, [encode(tok, p, chat) for p in problems], max_new, tok.eos_id, None)
    rewards = [
        reward(tok.decode([t for t in o if t != tok.eos_id]), p.answer)
        for o, p in zip(outs, problems, strict=True)
    ]
    return sum(rewards) / len(rewards), sum(r == 1.0 for r in rewards) / len(rewards)


def model_dir(name: str, tmp: Path) -> Path:
    if name == "tiny":
        return create_tiny(
            tmp / "tiny", seed=0, n_layers=2, d_model=64, n_heads=4, d_ff=256, max_seq_len=64
        )
    if name == "smollm2":
        return fetch("smollm2-135m")
    return Path(name)


def plot(metrics: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tidal.viz.run_report import moving_average

    steps = [m["step"] for m in metrics["steps"]]
    rewards = [m["mean_reward"] for m in metrics["steps"]]
    k = max(3, len(rewards) // 10)
    smooth = moving_average(rewards, k)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, alpha=0.35, label="mean reward per step (sampled)")
    ax.plot(steps, smooth, label=f"moving average ({k} steps)")
    ax.set_xlabel("optimizer step (= weight version)")
    ax.set_ylabel("mean reward")
    ax.axhline(
        metrics["greedy_reward_before"],
        color="gray",
        ls=":",
        label="held-out greedy reward, before",
    )
    ax.axhline(
        metrics["greedy_reward_after"],
        color="black",
        ls="--",
        label="held-out greedy reward, after",
    )
    ax.set_title(f"GRPO on addition, {metrics['model']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="tiny, smollm2, or a model directory")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--minutes", type=float, help="stop after this much wall time")
    ap.add_argument("--groups", type=int)
    ap.add_argument("--group-size", type=int)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/grpo_learning")
    args = ap.parse_args()
    preset = dict(PRESETS.get(args.model, PRESETS["smollm2"]))
    for key in ("steps", "minutes", "groups", "group_size", "lr"):
        if getattr(args, key) is not None:
            preset[key] = getattr(args, key)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    label = args.model if args.model in PRESETS else Path(args.model).name

    with tempfile.TemporaryDirectory() as tmp:
        mdir = model_dir(args.model, Path(tmp))
        policy = load_training_model(mdir)  # transformers, as the runtime trains it
        engine, tok = load_model(mdir)  # the rollout engine's own copy (built-in KV path)
    policy.train()
    engine.eval()
    clock = WallClock()
    buf = TrajectoryBuffer(
        TrajectoryBufferConfig(group_size=preset["group_size"], max_policy_lag=1), clock
    )
    shm_name = f"tidal-grpo-{os.getpid()}"
    shm = SharedMemoryTransport(shm_name, ParamLayout.of(policy), create=True)
    reader = SharedMemoryTransport(shm_name, ParamLayout.of(engine), create=False)
    cfg = TrainerConfig(
        lr=preset["lr"],
        groups_per_step=preset["groups"],
        max_grad_norm=1.0,
        loss=GRPOLossConfig(),
        packing=PackingConfig(token_budget=preset["budget"]),
    )
    core = CoreTrainer(policy, cfg, buf, clock, publishers=[shm], pad_id=tok.eos_id)
    task = AdditionTask(seed=args.seed)
    held_out = AdditionTask(seed=10_000 + args.seed).sample(64)
    gen = torch.Generator().manual_seed(args.seed)
    chat, max_new = preset["chat"], preset["max_new"]
    metrics = {"model": label, "preset": preset, "steps": []}
    metrics["greedy_reward_before"], metrics["greedy_acc_before"] = greedy_eval(
        engine, tok, held_out, chat, max_new
    )
    print(
        f"{label}: {sum(p.numel() for p in policy.parameters()) / 1e6:.1f}M params, held-out "
        f"greedy reward {metrics['greedy_reward_before']:.3f} "
        f"(accuracy {metrics['greedy_acc_before']:.3f})"
    )
    t0 = time.monotonic()
    try:
        for step in range(preset["steps"]):
            ts = time.monotonic()
            for rec in rollout(
                engine,
                tok,
                task.sample(preset["groups"]),
                preset["group_size"],
                core.version,
                step,
                chat,
                max_new,
                gen,
            ):
                buf.add(rec)
            t_roll = time.monotonic() - ts
            report = core.train_step(final=True)  # publishes v+1 to shared memory
            load_into(engine, reader, min_version=core.version)  # in place, no restart
            metrics["steps"].append(
                {
                    "step": step,
                    "mean_reward": report.mean_reward,
                    "loss": report.loss,
                    "grad_norm": report.grad_norm,
                    "rollout_s": t_roll,
                    "step_s": time.monotonic() - ts,
                }
            )
            if step % 5 == 0 or step == preset["steps"] - 1:
                print(
                    f"step {step:4d} v{core.version:<4d} mean reward {report.mean_reward:.3f} "
                    f"|g| {report.grad_norm:.3f} rollout {t_roll:.1f}s "
                    f"step {time.monotonic() - ts:.1f}s",
                    flush=True,
                )
            if time.monotonic() - t0 > 60 * preset["minutes"]:
                print(f"time budget of {preset['minutes']} min reached")
                break
    finally:
        core.close()
        reader.close()
        shm.close()
    metrics["greedy_reward_after"], metrics["greedy_acc_after"] = greedy_eval(
        engine, tok, held_out, chat, max_new
    )
    metrics["wall_s"] = time.monotonic() - t0
    rewards = [m["mean_reward"] for m in metrics["steps"]]
    k = max(1, min(10, len(rewards) // 4))
    metrics["reward_first"] = sum(rewards[:k]) / k
    metrics["reward_last"] = sum(rewards[-k:]) / k
    (out / f"{label}_metrics.json").write_text(json.dumps(metrics, indent=1))
    plot(metrics, out / f"{label}_reward.png")
    print(
        f"\n{label}: {len(rewards)} steps in {metrics['wall_s'] / 60:.1f} min; mean sampled "
        f"reward first {k} steps {metrics['reward_first']:.3f} -> last {k} steps "
        f"{metrics['reward_last']:.3f}; held-out greedy reward "
        f"{metrics['greedy_reward_before']:.3f} -> {metrics['greedy_reward_after']:.3f} "
        f"(accuracy {metrics['greedy_acc_before']:.3f} -> {metrics['greedy_acc_after']:.3f}); "
        f"curve: {out / f'{label}_reward.png'}"
    )


if __name__ == "__main__":
    main()
