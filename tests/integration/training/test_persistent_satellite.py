"""A satellite lives for the run (issue 25): one process joins and leaves training 20 times while
the core trains without pause; each leave parks it (model and link group kept), each return
pulls only a version it does not hold. No loss, no restart, no warning, every update applied.

The join/leave is what the runtime's actuator does (``Coordinator.deactivate`` +
``wait_parked``, then ``activate``); the core trains step after step on a stream of fresh
groups meanwhile, alternating broadcast (non-final) and final updates."""

from __future__ import annotations

import logging
import random
import threading
import time

from satellite_harness import (
    GROUP_SIZE,
    VOCAB,
    make_core,
    spawn_satellite,
    trainer_config,
    wait_for,
)

from tidal.training.records import single_call_record

CYCLES = 20


class Stream(threading.Thread):
    """Keeps two groups of the core's current version ready (cheap random records)."""

    def __init__(self, core, buf) -> None:
        super().__init__(daemon=True)
        self.core, self.buf, self.stop = core, buf, threading.Event()
        self.rng, self.n = random.Random(3), 0

    def run(self) -> None:
        while not self.stop.is_set():
            if len(self.buf) < 2 * GROUP_SIZE:
                g, self.n = f"s{self.n}", self.n + 1
                prompt = [self.rng.randrange(1, VOCAB) for _ in range(6)]
                for i in range(GROUP_SIZE):
                    out = [self.rng.randrange(1, VOCAB) for _ in range(self.rng.randint(20, 40))]
                    self.buf.add(
                        single_call_record(
                            f"{g}-e{i}",
                            g,
                            prompt,
                            out,
                            [-6.0] * len(out),
                            self.core.version,
                            reward=float(i % 2),
                        )
                    )
            time.sleep(0.01)


class Trainer(threading.Thread):
    def __init__(self, core) -> None:
        super().__init__(daemon=True)
        self.core, self.stop, self.reports, self.error = core, threading.Event(), [], None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.reports.append(self.core.train_step(final=len(self.reports) % 2 == 1))
        except Exception as exc:  # surfaced by the test
            self.error = exc


def test_one_satellite_process_joins_and_leaves_20_times_under_load(caplog):
    core, buf = make_core(trainer_config(groups_per_step=2))
    coord = core.coordinator
    stream, trainer = Stream(core, buf), Trainer(core)
    stream.start()
    proc = spawn_satellite(core, 1)
    try:
        wait_for(lambda: coord.registered() == [1], 60, "the satellite's hello")
        incarnation = coord._sats[1].incarnation
        trainer.start()
        versions_joined = 0
        with caplog.at_level(logging.INFO, logger="tidal.training"):
            t0 = time.monotonic()
            for cycle in range(CYCLES):
                n_joins = len(coord.join_log)
                coord.activate(1)
                wait_for(
                    lambda n=n_joins: any(c == 1 for _, c, _ in coord.join_log[n:]),
                    30,
                    f"cycle {cycle}: the satellite joined a step",
                )
                versions_joined += 1
                time.sleep(0.05 * (cycle % 4))  # leave at various points of a step
                coord.deactivate(1)
                assert coord.wait_parked(1, 30), f"cycle {cycle}: not parked"
                assert trainer.error is None, trainer.error
            took = time.monotonic() - t0
        trainer.stop.set()
        trainer.join(60)
        assert trainer.error is None, trainer.error
    finally:
        stream.stop.set()
        core.close()  # shutdown: the parked satellite says bye and ends
        proc.join(30)
    assert proc.exitcode == 0
    sat = coord._sats[1]
    assert sat.incarnation == incarnation and not sat.lost  # the same process throughout
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == []
    joins = [c for _, c, _ in coord.join_log]
    assert joins.count(1) >= CYCLES
    reports = [r for r in trainer.reports if r is not None]
    assert core.version == len(reports)  # every step applied its update
    assert sum(r.micro_steps_by_cell.get(1, 0) for r in reports) > 0  # it did train
    left = sum("left step" in r.getMessage() for r in caplog.records)
    print(
        f"{CYCLES} cycles in {took:.1f} s, {len(reports)} steps, {versions_joined} joins, "
        f"{left} left mid-step after delivering"
    )
