"""Invariant 5 with FSDP2 cells: a core of 2 ranks alone against the same core plus a satellite
of 2 ranks, or of 1 rank (cells of unequal size), that joins in the middle of step 0 (CPU,
gloo). Every cell shards the transformers model over its own ranks and splits each micro-step by
rows; the satellite delivers its gathered gradient sum and the core reduces it into its shards.
The parameters after a non-final and a final update must agree to 1e-4 relative; the naive
per-worker normalisation through the same sharded system must not."""

from __future__ import annotations

import os

import pytest
import torch
from satellite_harness import (
    Feeder,
    build_model,
    make_core,
    make_records,
    ready,
    spawn_satellite,
    trainer_config,
    wait_for,
)

from tidal.training.flat import ParamLayout
from tidal.training.sharded import ShardConfig

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
torch.set_num_threads(1)

N_GROUPS = 12  # step 0: 6 groups (the satellite joins after 2), step 1: 6
TWO = ShardConfig(ranks=2)
RTOL, ATOL = 1e-4, 1e-8


def run(records, normalization: str, satellite: bool, sat_shard: ShardConfig = TWO):
    cfg = trainer_config(normalization, groups_per_step=6).model_copy(update={"shard": TWO})
    core, buf = make_core(cfg)
    procs = []

    def gate(chunk: int) -> None:
        if chunk == 1 and satellite:
            procs.append(spawn_satellite(core, 1, shard=sat_shard))
            wait_for(lambda: ready(core, 1), 120, "the satellite to join step 0")

    try:
        Feeder(buf, records, chunks=[2, 4, 6], gate=gate, pause_s=0.05).start()
        reports = [core.train_step(final=False), core.train_step(final=True)]
        return core.full_params(), reports
    finally:
        core.close()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    big = b.abs() > ATOL / RTOL
    return float(((a - b).abs()[big] / b.abs()[big]).max())


@pytest.fixture(scope="module")
def records():
    return make_records(build_model(0), N_GROUPS)


@pytest.fixture(scope="module")
def alone(records):
    return run(records, "global", satellite=False)


@pytest.mark.slow
def test_two_rank_satellite_joining_mid_step_gives_the_two_rank_core_alone_update(records, alone):
    expected, alone_reports = alone
    got, reports = run(records, "global", satellite=True)
    for r, a in zip(reports, alone_reports, strict=True):
        assert r.n_executions == a.n_executions == 24 and r.n_tokens == a.n_tokens
    assert sum(r.micro_steps_by_cell.get(1, 0) for r in reports) > 0, reports
    before = build_model(0)
    assert not torch.allclose(expected, ParamLayout.of(before).params_to_flat(before)), (
        "the update must change the parameters"
    )
    rel = max_rel_diff(got, expected)
    print(
        f"[fsdp2 2+2 ranks] max relative parameter difference: {rel:.3g}; by cell "
        f"{[r.micro_steps_by_cell for r in reports]}"
    )
    assert rel < RTOL, rel


@pytest.mark.slow
def test_cells_of_unequal_size_one_rank_satellite_gives_the_two_rank_core_alone_update(
    records, alone
):
    """A satellite's rank count is its own: it pulls and delivers full flat vectors, which
    each cell slices into its own shards."""
    expected, _ = alone
    got, reports = run(records, "global", satellite=True, sat_shard=ShardConfig(ranks=1))
    assert sum(r.micro_steps_by_cell.get(1, 0) for r in reports) > 0, reports
    rel = max_rel_diff(got, expected)
    print(
        f"[fsdp2 2-rank core + 1-rank satellite] max relative parameter difference: "
        f"{rel:.3g}; by cell {[r.micro_steps_by_cell for r in reports]}"
    )
    assert rel < RTOL, rel


@pytest.mark.slow
def test_per_worker_normalisation_is_caught_through_sharded_cells(records, alone):
    expected, _ = alone
    got, reports = run(records, "local_mean", satellite=True)
    assert sum(r.micro_steps_by_cell.get(1, 0) for r in reports) > 0
    rel = max_rel_diff(got, expected)
    print(f"[fsdp2 2+2 ranks] per-worker normalisation: max relative difference {rel:.3g}")
    assert rel > 1e-2, "the invariance check failed to detect per-worker normalisation"
