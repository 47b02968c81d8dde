"""Peak resident memory of the core trainer's process and of one satellite process over a few
steps, on a SmolLM2-shaped random model (576 wide, a 49,152 vocabulary, ``--layers`` deep),
micro-steps of ``--token-budget`` tokens, AdamW; the satellite claims half of each step. Prints
per step the micro-steps by cell and the loss, then both peaks (MB).

    .venv/bin/python benchmarks/trainer_memory.py                # 4 layers: 43M parameters
    .venv/bin/python benchmarks/trainer_memory.py --layers 30    # SmolLM2-135M's shape
    .venv/bin/python benchmarks/trainer_memory.py --fsdp         # one-rank FSDP2 cells
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import resource
import tempfile
import threading
import time

import psutil
import torch

from tidal import malloc
from tidal.clock import WallClock
from tidal.models.hf import tiny_model
from tidal.training.core import CoreTrainer, TrainerConfig
from tidal.training.packing import PackingConfig
from tidal.training.records import single_call_record
from tidal.training.satellite import ModelSpec, SatelliteConfig, run_satellite
from tidal.training.sharded import ShardConfig
from tidal.training.trajectory_buffer import TrajectoryBuffer, TrajectoryBufferConfig

VOCAB, GROUP = 49152, 4


def build(seed: int, layers: int) -> torch.nn.Module:
    return tiny_model(
        "llama", seed, VOCAB, n_layers=layers, n_heads=8, d_model=576, d_ff=1536, max_seq_len=512
    )


class PeakRss(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.proc, self.peak_mb, self.stop = psutil.Process(pid), 0.0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.peak_mb = max(self.peak_mb, self.proc.memory_info().rss / 2**20)
            except psutil.Error:
                return
            self.stop.wait(0.05)


def feed(buf: TrajectoryBuffer, rng: random.Random, step: int, version: int, groups: int) -> None:
    for g in range(groups):
        prompt = [rng.randrange(1, VOCAB) for _ in range(40)]
        for i in range(GROUP):
            out = [rng.randrange(1, VOCAB) for _ in range(200)]
            buf.add(
                single_call_record(
                    f"s{step}g{g}e{i}",
                    f"s{step}g{g}",
                    prompt,
                    out,
                    [-8.0] * len(out),
                    version,
                    reward=float(i % 2),
                )
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--token-budget", type=int, default=1024)
    ap.add_argument(
        "--fsdp",
        action="store_true",
        help="both trainers as one-rank FSDP2 cells (what a CPU run does: runtime.fsdp auto)",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    model_dir = tempfile.mkdtemp(prefix="tidal-trainer-memory-") + "/model"
    build(7, args.layers).save_pretrained(model_dir)
    clock = WallClock()
    buf = TrajectoryBuffer(TrajectoryBufferConfig(group_size=GROUP, max_policy_lag=4), clock)
    shard = ShardConfig() if args.fsdp else None
    config = TrainerConfig(
        groups_per_step=4, shard=shard, packing=PackingConfig(token_budget=args.token_budget)
    )
    core = CoreTrainer(build(0, args.layers), config, buf, clock)
    print(f"{sum(p.numel() for p in core.model.parameters()) / 1e6:.1f}M parameters")
    a = core.address()
    cfg = SatelliteConfig(
        cell=1,
        rpc_port=a["rpc_port"],
        store_port=a["store_port"],
        authkey=a["authkey"],
        model=ModelSpec(model_dir=model_dir),
        timeout_s=300,
        shard=shard,
    )
    sat = mp.get_context("spawn").Process(
        target=run_satellite, args=(cfg.model_dump_json(),), daemon=True
    )
    sat.start()
    deadline = time.monotonic() + 300
    while core.coordinator.registered() != [1]:
        if time.monotonic() > deadline or not sat.is_alive():
            raise SystemExit("the satellite did not connect")
        time.sleep(0.1)
    peak = PeakRss(sat.pid)
    peak.start()
    rng = random.Random(0)
    try:
        for step in range(args.steps):
            feed(buf, rng, step, core.version, 4)
            r = core.train_step(final=False)
            print(f"step {step}: micro-steps by cell {r.micro_steps_by_cell}, loss {r.loss:.4f}")
    finally:
        peak.stop.set()
        core.close()
        sat.terminate()
    core_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"satellite peak RSS {peak.peak_mb:.0f} MB; core process peak RSS {core_mb:.0f} MB")


if __name__ == "__main__":
    malloc.tune()  # as every tidal process does ($TIDAL_MALLOC_MMAP_THRESHOLD=off: glibc's own)
    main()
