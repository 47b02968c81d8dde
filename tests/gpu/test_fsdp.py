"""An FSDP2 step on the GPU (bf16 compute, fp32 master weights, optimizer state and gradient
reduction) against the fp32 FSDP2 step on the CPU, from the same weights and batch.

Skipped where torch sees no CUDA device; ``TIDAL_TEST_DEVICE=cpu`` dry-runs it with the bf16
side on the CPU too. Run: ``python -m pytest tests/gpu/test_fsdp.py -v``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

DEVICE = os.environ.get("TIDAL_TEST_DEVICE", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE.startswith("cuda") and not torch.cuda.is_available(), reason="no CUDA device"
    ),
]
sys.path.insert(0, str(Path(__file__).parents[1] / "integration" / "training"))
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def one_step(records, device: str, precision: str):
    from satellite_harness import make_core, trainer_config

    from tidal.training.sharded import ShardConfig

    # SGD: the update is the gradient itself (AdamW's first step would be lr * sign(g))
    cfg = trainer_config(groups_per_step=4).model_copy(
        update={"device": device, "shard": ShardConfig(ranks=1, mixed_precision=precision)}
    )
    core, buf = make_core(cfg)
    try:
        for r in records:
            buf.add(r)
        report = core.train_step(final=True)
        return core.full_params(), report
    finally:
        core.close()


def test_fsdp2_bf16_step_on_the_gpu_matches_the_fp32_cpu_step():
    from satellite_harness import build_model, make_records

    from tidal.training.flat import ParamLayout

    records = make_records(build_model(0), 4, seed=11)
    start = ParamLayout.of(build_model(0)).params_to_flat(build_model(0))
    cpu, cpu_report = one_step(records, "cpu", "fp32")
    gpu, gpu_report = one_step(records, DEVICE, "bf16")
    assert gpu_report.n_tokens == cpu_report.n_tokens
    assert gpu_report.grad_norm == pytest.approx(cpu_report.grad_norm, rel=5e-2)
    assert gpu_report.loss == pytest.approx(cpu_report.loss, abs=2e-2)
    # the update, as one vector: bf16 compute moves it by a few percent at most
    rel = float((gpu - cpu).norm() / (cpu - start).norm())
    print(f"FSDP2 bf16 ({DEVICE}) vs fp32 (CPU) update: relative difference {rel:.3g}")
    assert rel < 0.1
