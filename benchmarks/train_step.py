"""Trainer micro-step: the plain trainer against HF + FSDP2 at 1 and 2 ranks, side by side.

Each variant runs in a fresh process (so peak memory is its own): build the transformers model
(``--model``: ``tiny`` = a tiny HF Llama written to a temporary directory, or an HF directory
such as ``~/.cache/tidal/models/smollm2-135m-hf``), one micro-step of ``--seqs`` sequences of
``--seq-len`` tokens (the first 64 of each are prompt, the rest trainable), one warm-up, then
``--repeats`` timed micro-steps (forward + backward + gradient into the sum, committed):
- ``plain``: ``GradientWorker`` on the unsharded model (the trainer before FSDP2);
- ``fsdp1`` / ``fsdp2``: ``ShardedWorker`` on a cell of 1 / 2 ranks (gloo on the CPU, NCCL on
  CUDA with ``--device cuda``), each micro-step split by rows over the ranks.
Prints trainable tokens/s of the micro-step (best of the repeats) and the peak memory of every
rank: resident set high-water mark (``VmHWM``; includes Python, torch and transformers, about
0.5 GiB) on the CPU, ``max_memory_allocated`` on CUDA (rank 0 only). It then times the weight
publication of the sharded cell (full parameters gathered one at a time into a streamed
safetensors file) against a plain ``memcpy`` of the same bytes.

Run: ``python benchmarks/train_step.py`` (about a minute on 2 busy cores with the tiny model).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from gpu_costs import _micro_step  # one synthetic micro-step for both benchmarks

VARIANTS = ("plain", "fsdp1", "fsdp2")


def vm_hwm_mib(pid: str | int = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def one(variant: str, model_dir: str, args: argparse.Namespace) -> dict:
    """Runs in its own process: the figures of one variant."""
    from tidal.models import load_training_model
    from tidal.training.cell_ranks import OptimizerSpec, start_cell, stop_cell
    from tidal.training.loss import GRPOLossConfig
    from tidal.training.sharded import ShardConfig
    from tidal.training.worker import GradientWorker, ShardedWorker

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = load_training_model(model_dir)
    ms = _micro_step(model.config.vocab_size, args.seqs, args.seq_len)
    tokens = sum(sum(s.trainable) for s in ms.sequences)
    cell, procs = None, []
    if variant == "plain":
        worker = GradientWorker(0, model.to(device), GRPOLossConfig())
    else:
        ranks = int(variant[-1])
        cell, procs = start_cell(
            model,
            device,
            ShardConfig(ranks=ranks),
            GRPOLossConfig(),
            0,
            OptimizerSpec("adamw", 1e-5, 0.0),
        )
        worker = ShardedWorker(0, cell)
    times = []
    for i in range(args.repeats + 1):
        t0 = time.perf_counter()
        worker.compute(ms)
        worker.commit()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first is the warm-up
            times.append(time.perf_counter() - t0)
    out = {
        "variant": variant,
        "tok_s": tokens / min(times),
        "tokens": tokens,
        "peak_mib": [vm_hwm_mib()] + [vm_hwm_mib(p.pid) for p in procs],
    }
    if device.type == "cuda":
        out["peak_mib"] = [torch.cuda.max_memory_allocated(device) / 2**20]
    if cell is not None:
        out.update(publication(cell, args))
        stop_cell(cell, procs)
    return out


def publication(cell, args: argparse.Namespace) -> dict:
    """Streamed publication of the gathered parameters vs memcpy of the same bytes."""
    from tidal.training.transport import FilePublisher

    with tempfile.TemporaryDirectory() as tmp:
        pub = FilePublisher(tmp, cell.full_layout, keep=1)
        best = float("inf")
        for version in range(1, args.repeats + 1):
            t0 = time.perf_counter()
            pub.publish_stream(version, cell.stream_params())
            best = min(best, time.perf_counter() - t0)
    nbytes = cell.full_layout.nbytes
    src = torch.empty(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    dst.copy_(src)
    memcpy_s = time.perf_counter() - t0
    return {
        "publish_gb_s": nbytes / best / 1e9,
        "memcpy_gb_s": nbytes / memcpy_s / 1e9,
        "weights_mib": nbytes / 2**20,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.model, args)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir == "tiny":
            from tidal.models import create_tiny

            model_dir = str(
                create_tiny(
                    Path(tmp) / "tiny", seed=0, n_layers=4, d_model=256, n_heads=4, max_seq_len=1024
                )
            )
        rows = []
        for variant in VARIANTS:
            cmd = [
                sys.executable,
                __file__,
                "--one",
                variant,
                "--model",
                model_dir,
                "--seqs",
                str(args.seqs),
                "--seq-len",
                str(args.seq_len),
                "--repeats",
                str(args.repeats),
                "--threads",
                str(args.threads),
                "--device",
                args.device,
            ]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            if done.returncode:
                sys.exit(f"{variant} failed:\n{done.stderr[-3000:]}")
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    base = rows[0]["tok_s"]
    print(
        f"model {args.model}, micro-step of {args.seqs} x {args.seq_len} tokens "
        f"({rows[0]['tokens']} trainable), {args.threads} thread(s) per rank, {args.device}"
    )
    print(f"{'variant':<8} {'trainable tok/s':>16} {'vs plain':>9}  peak MiB per rank")
    for r in rows:
        peaks = ", ".join(f"{m:.0f}" for m in r["peak_mib"])
        print(f"{r['variant']:<8} {r['tok_s']:>16.0f} {r['tok_s'] / base:>8.2f}x  {peaks}")
    for r in rows[1:]:
        print(
            f"{r['variant']}: publication of {r['weights_mib']:.1f} MiB streamed at "
            f"{r['publish_gb_s']:.2f} GB/s (memcpy {r['memcpy_gb_s']:.2f} GB/s, ratio "
            f"{r['publish_gb_s'] / r['memcpy_gb_s']:.3f})"
        )


if __name__ == "__main__":
    main()
