"""Shared set-up for the streaming-training integration tests: a tiny HF Llama, a fixed batch of
execution records, a core in this process and satellites in spawned processes.

The core's model is drawn in memory from a seed; satellites load an HF directory written with
another seed, so their weights are right only after they pulled the core's snapshot."""

from __future__ import annotations

import multiprocessing as mp
import random
import tempfile
import threading
import time
from functools import cache
from pathlib import Path

import torch

from tidal.clock import WallClock
from tidal.contracts.calls import ExecutionRecord
from tidal.models.hf import create_tiny, tiny_model
from tidal.training.coordinator import CoordinatorConfig
from tidal.training.core import CoreTrainer, TrainerConfig
from tidal.training.loss import target_logprobs
from tidal.training.packing import PackingConfig
from tidal.training.records import single_call_record
from tidal.training.satellite import ModelSpec, SatelliteConfig, run_satellite
from tidal.training.sharded import ShardConfig
from tidal.training.trajectory_buffer import TrajectoryBuffer, TrajectoryBufferConfig

TINY = {"n_layers": 2, "n_heads": 2, "d_model": 64, "d_ff": 128, "max_seq_len": 128}
VOCAB = 512  # the tiny tokenizer's size (create_tiny trains it to exactly this)
GROUP_SIZE = 4


def build_model(seed: int = 0) -> torch.nn.Module:
    return tiny_model("llama", seed, VOCAB, **TINY)


@cache
def tiny_dir() -> Path:
    """An HF directory of the same shape (weights from seed 77), written once per process."""
    out = Path(tempfile.mkdtemp(prefix="tidal-tiny-")) / "model"
    create_tiny(out, seed=77, vocab_size=VOCAB, **TINY)
    return out


def make_records(model: torch.nn.Module, n_groups: int, seed: int = 1) -> list[ExecutionRecord]:
    """Random prompts and outputs; behaviour log-probs = the model's own plus noise, so the
    importance ratio is not 1 and clipping is exercised."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    records = []
    for g in range(n_groups):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(4, 12))]
        for i in range(GROUP_SIZE):
            out = [rng.randrange(1, VOCAB) for _ in range(rng.randint(6, 40))]
            ids = torch.tensor([prompt + out])
            with torch.no_grad():
                lp = target_logprobs(model(ids).logits, ids)[0, len(prompt) - 1 :]
            behav = (lp + 0.3 * torch.randn(lp.shape, generator=gen)).tolist()
            records.append(
                single_call_record(
                    f"g{g}-e{i}",
                    f"g{g}",
                    prompt,
                    out,
                    behav,
                    weight_version=0,
                    reward=float(rng.random() < 0.5) + 0.1 * i,
                )
            )
    return records


def trainer_config(
    normalization: str = "global",
    claim_timeout_s: float = 30.0,
    gather_timeout_s: float = 60.0,
    groups_per_step: int = 8,
    snapshot_transport: str = "link",
) -> TrainerConfig:
    return TrainerConfig(
        optimizer="sgd",
        lr=0.5,
        max_grad_norm=None,
        groups_per_step=groups_per_step,
        normalization=normalization,
        packing=PackingConfig(token_budget=160, claim_timeout_s=claim_timeout_s),
        coordinator=CoordinatorConfig(
            gather_timeout_s=gather_timeout_s, snapshot_transport=snapshot_transport
        ),
    )


def make_core(config: TrainerConfig, seed: int = 0) -> tuple[CoreTrainer, TrajectoryBuffer]:
    clock = WallClock()
    buf = TrajectoryBuffer(TrajectoryBufferConfig(group_size=GROUP_SIZE, max_policy_lag=2), clock)
    return CoreTrainer(build_model(seed), config, buf, clock), buf


def params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def spawn_satellite(
    core: CoreTrainer,
    cell: int,
    delay_s: float = 0.0,
    max_steps: int | None = None,
    shard: ShardConfig | None = None,
) -> mp.Process:
    addr = core.address()
    cfg = SatelliteConfig(
        cell=cell,
        rpc_port=addr["rpc_port"],
        store_port=addr["store_port"],
        authkey=addr["authkey"],
        model=ModelSpec(model_dir=str(tiny_dir())),
        start_delay_s=delay_s,
        max_steps=max_steps,
        timeout_s=60.0,
        shard=shard,
    )
    proc = mp.get_context("spawn").Process(
        target=run_satellite, args=(cfg.model_dump_json(),), daemon=True
    )
    proc.start()
    return proc


def wait_for(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def joined(core: CoreTrainer, cell: int, step: int = 0) -> bool:
    return any(s == step and c == cell for s, c, _ in core.coordinator.join_log)


def ready(core: CoreTrainer, cell: int, step: int = 0) -> bool:
    """Joined ``step`` and holds its snapshot (can claim micro-steps now)."""
    sat = core.coordinator._sats.get(cell)
    return joined(core, cell, step) and sat is not None and sat.version == core.version


class Feeder(threading.Thread):
    """Streams records into the buffer in chunks of ``chunks[i]`` groups; ``gate(i)`` may hold
    chunk i back (e.g. until a satellite joined)."""

    def __init__(
        self,
        buf: TrajectoryBuffer,
        records: list[ExecutionRecord],
        chunks: list[int],
        gate=None,
        pause_s: float = 0.15,
    ) -> None:
        super().__init__(daemon=True)
        assert sum(chunks) * GROUP_SIZE == len(records)
        self.buf, self.records, self.chunks, self.gate, self.pause_s = (
            buf,
            records,
            chunks,
            gate,
            pause_s,
        )

    def run(self) -> None:
        pos = 0
        for i, n in enumerate(self.chunks):
            if self.gate is not None:
                self.gate(i)
            for r in self.records[pos : pos + n * GROUP_SIZE]:
                self.buf.add(r)
            pos += n * GROUP_SIZE
            time.sleep(self.pause_s)
