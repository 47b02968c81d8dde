"""``summary.json``'s ``device_peak_mb``: each GPU trainer's peak over the run and each GPU
engine's, from the figures the parts report (``tests/gpu/test_cuda.py`` checks the parts report
torch's allocator peak on CUDA); empty on the CPU, where the parts report None."""

from __future__ import annotations

import torch

from tidal.contracts.run_files import MetricsLine, Summary, check
from tidal.models.device import device_peak_mb
from tidal.runtime.outputs import device_peaks
from tidal.training.aggregate import Contribution
from tidal.training.worker import GradientWorker


def test_a_run_takes_each_trainers_largest_peak_and_each_engines():
    metrics = [
        {"device_peak_mb": {"0": 900.0, "1": 700.5}},
        {},
        {"device_peak_mb": {"0": 950.0}},
        {"device_peak_mb": {"1": 650.0}},
    ]
    engines = [
        {"name": "c0", "device_peak_mb": 1200.0},
        {"name": "s0", "device_peak_mb": None},
        {"name": "c1"},
    ]
    out = device_peaks(metrics, engines)
    assert out == {"engine-c0": 1200.0, "trainer-c0": 950.0, "trainer-c1": 700.5}
    check(Summary, {"device_peak_mb": out}, "summary.json")
    check(MetricsLine, {**_line(), "device_peak_mb": {"0": 1.5}}, "metrics.jsonl:1")


def test_the_cpu_reports_no_device_peak():
    assert device_peak_mb("cpu") is None and device_peak_mb(torch.device("cpu")) is None
    assert device_peaks([{}, {"micro_steps_by_cell": {"0": 2}}], [{"name": "s0"}]) == {}
    model = torch.nn.Linear(3, 2)
    from tidal.training.loss import GRPOLossConfig

    worker = GradientWorker(0, model, GRPOLossConfig())
    assert worker.counts()["device_peak_mb"] is None
    assert worker.contribution().device_peak_mb is None
    assert Contribution(1, torch.zeros(1), 1, 1, 1, 0.0).device_peak_mb is None


def _line() -> dict:
    return {
        "t": 0.0,
        "burst": 0,
        "step": 0,
        "version": 0,
        "mean_reward": 0.0,
        "loss": 0.0,
        "grad_norm": 0.0,
        "n_groups": 1,
        "n_tokens": 1,
        "max_staleness": 0,
        "step_s": 0.0,
        "wait_s": 0.0,
        "waterlevel": 0,
        "ready_groups": 0,
        "roles": ["training"],
        "training_cells": 1,
    }
