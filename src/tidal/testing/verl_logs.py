"""Synthetic verl metrics logs with known parameters (tests, the README's example log).

In: the parameters a ``tidal.sim.from_verl`` fit should recover (response-length lognormal,
engine throughput per GPU and per-sequence cap, training speed, sync time, GPUs, batch) and a
seed. Out: rows of verl's own metric keys, one per step, computed as verl computes them from a
batch (``response_length/{mean,max,min,clip_ratio}`` over drawn lengths, ``perf/*``), and the
log written in verl's file-logger JSONL, console or CSV format. For tests and docs only.
"""

from __future__ import annotations

import csv
import json
import math
import random
from pathlib import Path


def verl_rows(
    steps: int = 40,
    samples: int = 128,
    gpus: int = 16,
    median: float = 3000.0,
    sigma: float = 0.6,
    cap: float = 16384.0,
    prompt: int = 400,
    tok_s_per_gpu: float = 900.0,
    seq_cap: float = 60.0,
    train_tok_s_per_gpu: float = 2500.0,
    sync_s: float = 4.0,
    seed: int = 0,
) -> list[dict[str, float]]:
    """One row per step: lengths drawn from the capped lognormal; ``timing_s/gen = W / (T G) +
    M / C``; training at ``train_tok_s_per_gpu`` on all GPUs (split 1:4:1 between old-log-prob,
    update and reference passes)."""
    rng = random.Random(seed)
    rows = []
    for step in range(1, steps + 1):
        lens = [
            min(cap, max(1.0, round(median * math.exp(sigma * rng.gauss(0, 1)))))
            for _ in range(samples)
        ]
        mean = sum(lens) / samples
        tokens = samples * (prompt + mean)
        gen = samples * mean / (tok_s_per_gpu * gpus) + max(lens) / seq_cap
        train = tokens / (train_tok_s_per_gpu * gpus)
        step_s = gen + train + sync_s + 1.0
        rows.append(
            {
                "training/global_step": step,
                "timing_s/gen": gen,
                "timing_s/old_log_prob": train / 6,
                "timing_s/update_actor": train * 4 / 6,
                "timing_s/ref": train / 6,
                "timing_s/update_weights": sync_s,
                "timing_s/step": step_s,
                "response_length/mean": mean,
                "response_length/max": max(lens),
                "response_length/min": min(lens),
                "response_length/clip_ratio": sum(x >= cap for x in lens) / samples,
                "prompt_length/mean": float(prompt),
                "perf/total_num_tokens": tokens,
                "perf/time_per_step": step_s,
                "perf/throughput": tokens / (step_s * gpus),
                "critic/score/mean": rng.random(),
            }
        )
    return rows


def write_verl_log(path: str | Path, rows: list[dict[str, float]], fmt: str = "jsonl") -> Path:
    """``jsonl``: verl's file logger (``{"step", "data"}``); ``console``: its console logger;
    ``csv``: one column per key."""
    p = Path(path)
    with open(p, "w", newline="") as fh:
        if fmt == "jsonl":
            for i, r in enumerate(rows, start=1):
                fh.write(json.dumps({"step": i, "data": r}) + "\n")
        elif fmt == "console":
            for i, r in enumerate(rows, start=1):
                fh.write(" - ".join([f"step:{i}", *(f"{k}:{v!r}" for k, v in r.items())]) + "\n")
        elif fmt == "csv":
            w = csv.DictWriter(fh, fieldnames=["step", *rows[0]])
            w.writeheader()
            for i, r in enumerate(rows, start=1):
                w.writerow({"step": i, **r})
        else:
            raise ValueError(f"unknown format {fmt!r}")
    return p
