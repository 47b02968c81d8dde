"""GRPO on the multi-turn workspace task through the real serving path: does reward rise?

Each burst: ``groups * updates_per_burst`` workspace tasks (``group_size`` executions each, one
seed per group; the built-in ``workspace`` source run by the ``chat`` agent kind, as
``configs/quickstart.yaml``) run concurrently in the harness pool, which talks to a real
built-in engine process through a real proxy process (every call's tokens, log-probs and weight
versions are recorded there); the proxy's records become ``ExecutionRecord`` objects
(``tidal.training.records.record_from_proxy``) in the trajectory buffer; ``CoreTrainer`` takes
``updates_per_burst`` GRPO steps of ``groups`` groups each, publishes the last version with a
``FilePublisher``, and the engine loads it in place (``/update_weights``) before the next burst.
This is the quickstart's data path without Ray and without role switches.

Run: ``.venv/bin/python benchmarks/workspace_learning.py --seed 0`` (SmolLM2-135M-Instruct,
needs ``tidal model fetch smollm2-135m``). ``--bursts 0 --baseline 32`` only measures the
untrained model (reward distribution and sample transcripts). ``--speed`` measures the engine's
decode throughput at batch 1/4/8 and its prefill cost. Writes
``<out>/workspace_<label>_metrics.json`` and ``<out>/workspace_<label>_reward.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import resource
import secrets
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

from tidal.agents import HarnessPool, PoolConfig
from tidal.agents.workload import AgentJob, Workload
from tidal.clock import WallClock
from tidal.config import RunConfig, validate_model
from tidal.models import fetch, load_model
from tidal.serving.launch import start_engine, start_proxy
from tidal.training.core import CoreTrainer, TrainerConfig
from tidal.training.flat import ParamLayout
from tidal.training.packing import PackingConfig
from tidal.training.records import record_from_proxy
from tidal.training.trajectory_buffer import TrajectoryBuffer, TrajectoryBufferConfig
from tidal.training.transport import FilePublisher


def workspace_jobs(median_s: float, max_turns: int):
    """``seed -> AgentJob`` of the built-in workspace source (tool latency median ``median_s``)."""
    workload = Workload(
        validate_model(
            RunConfig,
            {
                "task": {
                    "source": {"kind": "workspace", "tool_latency_s": median_s},
                    "max_turns": max_turns,
                }
            },
        )
    )

    def job(seed: int) -> AgentJob:
        return workload.job(0, 0, seed)

    return job


async def run_executions(
    pool: HarnessPool, admin: httpx.AsyncClient, tasks: list[tuple[str, object]]
) -> tuple[list, list]:
    closed = await pool.run(tasks)
    records = []
    for c in closed:
        resp = await admin.get(f"/tidal/executions/{c.execution_id}/records")
        resp.raise_for_status()
        records.append(
            record_from_proxy(
                c.execution_id,
                c.group_id,
                resp.json()["calls"],
                c.outcome.reward or 0.0,
                c.outcome.reason,
            )
        )
    return [c.outcome for c in closed], records


def cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system, all threads) of a child process, or of this process."""
    if pid is None:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def describe(results: list) -> dict:
    rewards = [r.reward or 0.0 for r in results]
    hist: dict[str, int] = {}
    for x in rewards:
        hist[f"{x:.2f}"] = hist.get(f"{x:.2f}", 0) + 1
    return {
        "n": len(rewards),
        "mean_reward": sum(rewards) / len(rewards),
        "solved": sum(x == 1.0 for x in rewards) / len(rewards),
        "mean_turns": sum(r.turns for r in results) / len(results),  # Outcome.turns
        "reasons": sorted({str(r.reason) for r in results}),
        "histogram": dict(sorted(hist.items())),
    }


async def speed(engine_url: str, tok, pid: int, max_new: int = 64) -> dict:
    """Decode tokens/s at batch 1, 4, 8 (ignore_eos) and prefill cost (s per prompt token),
    in wall time and per CPU-second of the engine process (one thread)."""
    out: dict = {}
    prompt = tok.apply_chat_template([{"role": "user", "content": "Tell me about the sea."}])
    async with httpx.AsyncClient(base_url=engine_url, timeout=600) as c:

        async def one(n_tokens: int, prompt_ids: list[int]) -> None:
            r = await c.post(
                "/v1/completions",
                json={
                    "prompt": prompt_ids,
                    "max_tokens": n_tokens,
                    "ignore_eos": True,
                    "temperature": 1.0,
                },
            )
            r.raise_for_status()

        await one(4, prompt)  # warm-up
        for batch in (1, 4, 8):
            t0, c0 = time.perf_counter(), cpu_s(pid)
            await asyncio.gather(*[one(max_new, prompt) for _ in range(batch)])
            dt, dc = time.perf_counter() - t0, cpu_s(pid) - c0
            out[f"decode_tok_s_batch{batch}"] = round(batch * max_new / dt, 1)
            out[f"decode_tok_per_cpu_s_batch{batch}"] = round(batch * max_new / max(dc, 1e-3), 1)
        # prefill: a long prompt with 1 new token minus a short prompt with 1 new token
        long_prompt = (prompt * 40)[:1000]
        times, cpus = {}, {}
        for name, ids in (("short", prompt[:20]), ("long", long_prompt)):
            t0, c0 = time.perf_counter(), cpu_s(pid)
            await one(1, ids)
            times[name], cpus[name] = time.perf_counter() - t0, cpu_s(pid) - c0
        out["prefill_s_per_1000_tokens"] = round(
            (times["long"] - times["short"]) * 1000 / (len(long_prompt) - 20), 3
        )
        out["prefill_cpu_s_per_1000_tokens"] = round(
            (cpus["long"] - cpus["short"]) * 1000 / (len(long_prompt) - 20), 3
        )
    return out


def plot(metrics: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tidal.viz.run_report import moving_average

    steps = [m["step"] for m in metrics["steps"]]
    rewards = [m["mean_reward"] for m in metrics["steps"]]
    k = max(2, len(rewards) // 6)
    smooth = moving_average(rewards, k)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, "o-", alpha=0.4, label="mean reward of the step's groups")
    ax.plot(steps, smooth, label=f"moving average ({k} steps)")
    if metrics.get("baseline"):
        ax.axhline(
            metrics["baseline"]["mean_reward"],
            color="gray",
            ls=":",
            label="untrained model, mean reward",
        )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward")
    ax.set_title(f"GRPO on the workspace task, {metrics['model']}, seed {metrics['seed']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main_async(args, out: Path) -> dict:
    mdir = fetch("smollm2-135m") if args.model == "smollm2" else Path(args.model)
    label = f"{'smollm2' if args.model == 'smollm2' else Path(args.model).name}{args.label}"
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    token = secrets.token_hex(8)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    engine = start_engine(
        mdir,
        name="smollm2",
        max_batch=args.engine_max_batch,
        log_path=logs / f"engine-{label}-{args.seed}.log",
    )
    proxy = None
    metrics: dict = {"model": label, "seed": args.seed, "settings": vars(args), "steps": []}
    t_start = time.monotonic()
    try:
        engine.wait_healthy(300)
        proxy = start_proxy(
            [engine.url],
            [],
            token,
            cap=args.concurrency,
            log_path=logs / f"proxy-{label}-{args.seed}.log",
        ).wait_healthy(60)
        metrics["startup_s"] = round(time.monotonic() - t_start, 1)
        model, tok = load_model(mdir)
        if args.speed:
            metrics["speed"] = await speed(engine.url, tok, engine.proc.pid)
            print("engine speed:", metrics["speed"], flush=True)
        admin = httpx.AsyncClient(
            base_url=proxy.url, timeout=600, headers={"Authorization": f"Bearer {token}"}
        )
        eng = httpx.AsyncClient(base_url=engine.url, timeout=600)
        pool_cfg = PoolConfig(
            proxy_url=proxy.url,
            max_concurrent=args.concurrency,
            max_turns=args.max_turns,
            max_tokens_per_turn=args.max_tokens,
            temperature=args.temperature,
            timeout_s=args.execution_timeout,
            token=token,
        )
        with tempfile.TemporaryDirectory() as tmp:
            pool = HarnessPool(pool_cfg, Path(tmp) / "ws")
            mk = workspace_jobs(args.latency_median, args.max_turns)
            if args.baseline:
                t0 = time.monotonic()
                tasks = [
                    (f"base-{i}", mk(10_000_000 + args.seed * 1000 + i))
                    for i in range(args.baseline)
                ]
                results, records = await run_executions(pool, admin, tasks)
                base = describe(results)
                base["wall_s"] = round(time.monotonic() - t0, 1)
                base["output_tokens"] = sum(
                    len(c.output_token_ids) for rec in records for c in rec.calls
                )
                base["transcripts"] = [
                    {
                        "reward": r.reward,
                        "turns": r.turns,
                        "transcript": [t.model_dump() for t in r.transcript],
                    }
                    for r in results[:8]
                ]
                metrics["baseline"] = base
                print(
                    f"baseline over {base['n']} executions: mean reward "
                    f"{base['mean_reward']:.3f}, solved {base['solved']:.2f}, histogram "
                    f"{base['histogram']}, mean turns {base['mean_turns']:.1f}, "
                    f"{base['wall_s']} s",
                    flush=True,
                )
                for t in base["transcripts"][: args.show]:
                    print(json.dumps(t, indent=1)[:1500])
            if args.bursts:
                metrics.update(
                    await train(
                        args, model, tok, pool, admin, eng, mk, Path(tmp), metrics, engine.proc.pid
                    )
                )
        await admin.aclose()
        await eng.aclose()
    finally:
        if proxy is not None:
            proxy.stop()
        engine.stop()
    metrics["wall_s"] = round(time.monotonic() - t_start, 1)
    return metrics


async def train(
    args, model, tok, pool, admin, eng, mk, tmp: Path, metrics: dict, engine_pid: int
) -> dict:
    model.train()
    clock = WallClock()
    buf = TrajectoryBuffer(
        TrajectoryBufferConfig(group_size=args.group_size, max_policy_lag=args.updates_per_burst),
        clock,
    )
    publisher = FilePublisher(tmp / "weights", ParamLayout.of(model), keep=2)
    core = CoreTrainer(
        model,
        TrainerConfig(
            lr=args.lr,
            groups_per_step=args.groups,
            max_grad_norm=1.0,
            step_data_timeout_s=60,
            packing=PackingConfig(token_budget=args.token_budget),
        ),
        buf,
        clock,
        publishers=[publisher],
        pad_id=tok.eos_id,
    )
    t0 = time.monotonic()
    step = 0
    rollout_rewards: list[float] = []
    try:
        for b in range(args.bursts):
            tb, eng_c0 = time.monotonic(), cpu_s(engine_pid)
            n_groups = args.groups * args.updates_per_burst
            tasks = [
                (f"b{b}-g{g}", mk(args.seed * 1_000_003 + b * 1000 + g))
                for g in range(n_groups)
                for _ in range(args.group_size)
            ]
            results, records = await run_executions(pool, admin, tasks)
            for rec in records:
                buf.add(rec)
            t_roll = time.monotonic() - tb
            roll_cpu = cpu_s(engine_pid) - eng_c0
            stats = describe(results)
            rollout_rewards.append(stats["mean_reward"])
            if b == 0 and "baseline" not in metrics:  # the untrained model's first burst
                metrics["baseline"] = {
                    **stats,
                    "from": "burst 0 (weights v0)",
                    "transcripts": [
                        {"reward": r.reward, "transcript": [t.model_dump() for t in r.transcript]}
                        for r in results[:: len(results) // 8]
                    ],
                }
                print(
                    f"burst 0 (untrained): mean reward {stats['mean_reward']:.3f}, histogram "
                    f"{stats['histogram']}",
                    flush=True,
                )
            out_tokens = sum(len(c.output_token_ids) for rec in records for c in rec.calls)
            for u in range(args.updates_per_burst):
                ts, tc0 = time.monotonic(), cpu_s()
                final = u == args.updates_per_burst - 1
                report = await asyncio.to_thread(core.train_step, final)
                t_train, train_cpu = time.monotonic() - ts, cpu_s() - tc0
                t_load = 0.0
                if final:
                    tl = time.monotonic()
                    resp = await eng.post(
                        "/update_weights",
                        json={
                            "path": publisher.path(core.version),
                            "weight_version": f"v{core.version}",
                        },
                    )
                    resp.raise_for_status()
                    t_load = time.monotonic() - tl
                line = {
                    "step": step,
                    "burst": b,
                    "version": core.version,
                    "mean_reward": report.mean_reward,
                    "loss": report.loss,
                    "grad_norm": report.grad_norm,
                    "n_tokens": report.n_tokens,
                    "train_s": round(t_train, 2),
                    "train_cpu_s": round(train_cpu, 1),
                    "load_s": round(t_load, 2),
                    "rollout_engine_cpu_s": round(roll_cpu, 1) if u == 0 else 0.0,
                    "rollout_s": round(t_roll, 2) if u == 0 else 0.0,
                    "burst_solved": stats["solved"],
                    "burst_turns": stats["mean_turns"],
                    "burst_output_tokens": out_tokens if u == 0 else 0,
                    "elapsed_s": round(time.monotonic() - t0, 1),
                }
                metrics["steps"].append(line)
                print(
                    f"burst {b:3d} step {step:3d} v{core.version:<3d} reward "
                    f"{report.mean_reward:.3f} (solved {stats['solved']:.2f}, turns "
                    f"{stats['mean_turns']:.1f}) |g| {report.grad_norm:.3f} train "
                    f"{report.n_tokens} tok {t_train:.1f}s rollout {t_roll:.1f}s "
                    f"({out_tokens} out tok) elapsed {time.monotonic() - t0:.0f}s",
                    flush=True,
                )
                step += 1
            if time.monotonic() - t0 > 60 * args.minutes:
                print(f"time budget of {args.minutes} min reached after burst {b}")
                break
    finally:
        buf.close()
        core.close()
    rewards = [m["mean_reward"] for m in metrics["steps"]]
    q = max(1, len(rewards) // 4)
    return {
        "train_wall_s": round(time.monotonic() - t0, 1),
        "n_steps": len(rewards),
        "reward_first_quarter": sum(rewards[:q]) / q,
        "reward_last_quarter": sum(rewards[-q:]) / q,
        "mean_train_s": statistics.mean(m["train_s"] for m in metrics["steps"]),
        "mean_rollout_s_per_burst": statistics.mean(
            m["rollout_s"] for m in metrics["steps"] if m["rollout_s"]
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="smollm2, or a model directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bursts", type=int, default=12)
    ap.add_argument(
        "--minutes",
        type=float,
        default=8.0,
        help="stop after the burst that crosses this much training wall time",
    )
    ap.add_argument("--groups", type=int, default=4, help="groups per optimizer step")
    ap.add_argument("--group-size", type=int, default=6)
    ap.add_argument("--updates-per-burst", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens per model call")
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=3e-6)
    ap.add_argument("--token-budget", type=int, default=2048)
    ap.add_argument("--latency-median", type=float, default=0.15, help="tool latency median, s")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--engine-max-batch", type=int, default=32)
    ap.add_argument("--execution-timeout", type=float, default=300.0)
    ap.add_argument("--threads", type=int, default=2, help="trainer torch threads")
    ap.add_argument("--baseline", type=int, default=0, help="executions of the untrained model")
    ap.add_argument("--show", type=int, default=4, help="baseline transcripts to print")
    ap.add_argument("--speed", action="store_true", help="measure engine decode/prefill speed")
    ap.add_argument("--label", default="", help="suffix of the output file names")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    metrics = asyncio.run(main_async(args, out))
    name = f"workspace_{metrics['model']}"
    if args.bursts:
        name += "" if args.seed == 0 else f"_seed{args.seed}"
    else:
        name += "_baseline"
    (out / f"{name}_metrics.json").write_text(json.dumps(metrics, indent=1))
    if metrics["steps"]:
        plot(metrics, out / f"{name}_reward.png")
        print(
            f"\n{metrics['model']} seed {args.seed}: {metrics['n_steps']} steps in "
            f"{metrics['train_wall_s'] / 60:.1f} min of training ({metrics['wall_s'] / 60:.1f} "
            f"min in all); mean reward first quarter {metrics['reward_first_quarter']:.3f} -> "
            f"last quarter {metrics['reward_last_quarter']:.3f}; "
            f"{out / f'{name}_reward.png'}"
        )


if __name__ == "__main__":
    main()
