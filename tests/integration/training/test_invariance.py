"""Invariant 5: the update with satellites equals the core-only update over the same batch.

The core runs in this process; satellites are spawned processes that join step 0 at different
moments (satellite 2 is started only after satellite 1 joined), pull the snapshot over their
link, claim micro-steps, deliver gradients, receive the non-final update over the prefix group
and train step 1 too. Parameters after both updates must match the core-alone run to 1e-5
relative tolerance in float32; with the naive per-worker normalisation they must not.
"""

from __future__ import annotations

import os

import pytest
import torch
from satellite_harness import (
    Feeder,
    build_model,
    make_core,
    make_records,
    params,
    ready,
    spawn_satellite,
    trainer_config,
    wait_for,
)

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
torch.set_num_threads(1)

N_GROUPS = 16  # two steps of 8 groups


@pytest.fixture(scope="module")
def records():
    return make_records(build_model(0), N_GROUPS)


def core_alone(records, normalization="global"):
    core, buf = make_core(trainer_config(normalization))
    try:
        for r in records:
            buf.add(r)
        reports = [core.train_step(final=False), core.train_step(final=True)]
        return params(core.model), reports
    finally:
        core.close()


def with_satellites(records, normalization="global", snapshot_transport="link"):
    core, buf = make_core(trainer_config(normalization, snapshot_transport=snapshot_transport))
    procs = [spawn_satellite(core, 1)]

    def gate(chunk: int) -> None:
        if chunk == 1:
            wait_for(lambda: ready(core, 1), 90, "satellite 1 to join step 0")
            procs.append(spawn_satellite(core, 2))
        if chunk == 2:
            wait_for(lambda: ready(core, 2), 90, "satellite 2 to join step 0")

    # Step 0: 2 groups, satellite 1 joins, 2 groups, satellite 2 joins, 4 groups; step 1: 8.
    feeder = Feeder(buf, records, chunks=[2, 2, 4, 4, 4], gate=gate)
    try:
        feeder.start()
        reports = [core.train_step(final=False), core.train_step(final=True)]
        join_times = {c: t for s, c, t in core.coordinator.join_log if s == 0}
        return params(core.model), reports, join_times
    finally:
        core.close()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


# float32 relative tolerance; the absolute floor (torch's default) only matters for parameters
# that are exactly zero before the update and move by ~1e-12 (rows of unseen tokens).
RTOL, ATOL = 1e-5, 1e-8


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest elementwise relative difference over parameters not within ATOL of zero."""
    big = b.abs() > ATOL / RTOL
    return float(((a - b).abs()[big] / b.abs()[big]).max())


@pytest.fixture(scope="module")
def alone(records):
    return core_alone(records)


@pytest.mark.parametrize("snapshot_transport", ["link", "shm"])
def test_satellites_joining_mid_step_give_the_core_alone_update(records, alone, snapshot_transport):
    expected, alone = alone
    got, reports, join_times = with_satellites(records, snapshot_transport=snapshot_transport)
    assert join_times[1] < join_times[2], "satellites must join at different moments, in order"
    for r, a in zip(reports, alone, strict=True):
        assert r.n_executions == a.n_executions == 32
        assert r.n_tokens == a.n_tokens
    # Which cell got how much is timing; that each satellite contributed is required.
    by_cell = [r.micro_steps_by_cell for r in reports]
    assert all(sum(c.get(cell, 0) for c in by_cell) > 0 for cell in (1, 2)), by_cell
    assert set(reports[0].members) == {1, 2}
    assert set(reports[1].members) == {1, 2}
    before = params(build_model(0))
    assert not torch.allclose(expected, before), "the update must change the parameters"
    rel = max_rel_diff(got, expected)
    print(
        f"[{snapshot_transport}] max relative parameter difference: {rel:.3g}; by cell "
        f"{[r.micro_steps_by_cell for r in reports]}"
    )
    assert torch.allclose(got, expected, rtol=RTOL, atol=ATOL), rel


def test_naive_per_worker_normalisation_is_caught(records, alone):
    expected, _ = alone
    got, reports, _ = with_satellites(records, "local_mean")
    assert sum(r.micro_steps_by_cell.get(1, 0) for r in reports) > 0
    print(f"per-worker normalisation: max relative difference {max_rel_diff(got, expected):.3g}")
    assert not torch.allclose(got, expected, rtol=RTOL, atol=ATOL), (
        "the invariance check failed to detect per-worker normalisation"
    )
