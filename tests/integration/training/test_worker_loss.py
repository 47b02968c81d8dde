"""A satellite that dies (SIGKILL) or hangs (SIGSTOP) mid-batch while holding a claim.

Its claimed micro-steps are reclaimed (on disconnect, or when the lease times out), its
completed but undelivered micro-steps are reopened, the core does them itself, and the update
is still identical to the core-alone update over the same batch (invariant 5).
"""

from __future__ import annotations

import os
import signal
import threading
import time

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


@pytest.fixture(scope="module")
def records():
    return make_records(build_model(0), 16, seed=7)


@pytest.fixture(scope="module")
def expected(records):
    core, buf = make_core(trainer_config())
    try:
        for r in records:
            buf.add(r)
        core.train_step(final=False)
        core.train_step(final=True)
        return params(core.model)
    finally:
        core.close()


def holding(core, cell: int, seen: dict, need_done: bool) -> bool:
    """True (and ``seen`` filled) once ``cell`` holds a claim, or, with ``need_done``, once it
    has a completed micro-step whose gradient it has not delivered yet (some worker still holds
    a claim, so the batch has not reached its gather: the window is the batch's whole length,
    not the instant between two of the cell's micro-steps)."""
    h = core.packing.holdings()
    prefix = f"cell{cell}:"
    claimed = sum(w.startswith(prefix) for w in h["claimed"].values())
    done = sum(w.startswith(prefix) for w in h["done"].values())
    if (done and h["claimed"]) if need_done else claimed:
        seen.update(step=h["batch_id"], claimed=claimed, done=done)
        return True
    return False


@pytest.mark.parametrize(("sig", "need_done"), [
    (signal.SIGKILL, False), (signal.SIGKILL, True), (signal.SIGSTOP, False)],
    ids=["killed-holding-a-claim", "killed-with-undelivered-work", "hung"])
def test_lost_satellite_mid_batch_leaves_the_update_unchanged(records, expected, sig, need_done):
    core, buf = make_core(trainer_config(claim_timeout_s=2.0, gather_timeout_s=4.0))
    procs = [spawn_satellite(core, 1), spawn_satellite(core, 2)]
    reports = []

    def gate(chunk: int) -> None:
        if chunk == 1:
            wait_for(lambda: ready(core, 1) and ready(core, 2), 90, "both satellites to join")

    Feeder(buf, records, chunks=[2, 6, 8], gate=gate, pause_s=0.3).start()
    trainer = threading.Thread(
        target=lambda: reports.extend([core.train_step(False), core.train_step(True)]),
        daemon=True)
    trainer.start()
    try:
        seen: dict = {}
        wait_for(lambda: holding(core, 2, seen, need_done), 90, "satellite 2 to hold a claim")
        os.kill(procs[1].pid, sig)
        t_signal = time.monotonic()
        trainer.join(timeout=120)
        assert not trainer.is_alive(), "the core did not finish the burst"
        got = params(core.model)
    finally:
        core.close()
        for p in procs:
            p.kill()
            p.join(timeout=10)
    hit = reports[seen["step"]]
    print(f"{sig.name} in step {hit.step} holding {seen}: reclaimed {hit.reclaimed}, reopened "
          f"{hit.reopened}, micro-steps by cell {hit.micro_steps_by_cell}, recovered in "
          f"{time.monotonic() - t_signal:.1f}s")
    assert hit.reclaimed + hit.reopened >= seen["claimed"] + seen["done"]
    if need_done:
        assert hit.reopened >= seen["done"] >= 1, "completed, undelivered work must be redone"
    if sig == signal.SIGSTOP:
        assert hit.reclaimed >= 1, "a hung worker's claim must be reclaimed by the lease timeout"
    assert 2 not in hit.micro_steps_by_cell, "no gradient of the lost worker may be counted"
    assert 2 not in hit.members and 2 not in reports[-1].members
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-8)
