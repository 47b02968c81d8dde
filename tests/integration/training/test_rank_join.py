"""Rank 0 of a sharded cell waits for its followers in Python, bounded (issue 29, item 7): a
follower that dies before joining ends the wait at once with one line naming
``runtime.fsdp_ranks`` (it used to hold rank 0 in torch's join for the cell's hour-long timeout),
and a signal arriving while followers are still starting is handled at once (SIGTERM in
start-up)."""

from __future__ import annotations

import signal
import time

import psutil
import pytest
import torch
from satellite_harness import build_model

from tidal.errors import TidalError
from tidal.training import cell_ranks
from tidal.training.loss import GRPOLossConfig
from tidal.training.sharded import ShardConfig


def _start(cfg: ShardConfig):
    return cell_ranks.start_cell(
        build_model(0), torch.device("cpu"), cfg, GRPOLossConfig(), 0, None
    )


def test_a_follower_that_dies_before_joining_ends_rank_0s_wait_in_one_line(tmp_path, monkeypatch):
    dies = tmp_path / "dies"
    dies.write_text("#!/bin/sh\nexit 7\n")
    dies.chmod(0o755)
    monkeypatch.setattr(cell_ranks.sys, "executable", str(dies))
    t0 = time.monotonic()
    with pytest.raises(TidalError, match=r"runtime.fsdp_ranks: rank 1 of 2 exited with 7"):
        _start(ShardConfig(ranks=2))
    assert time.monotonic() - t0 < 10


def test_a_signal_while_followers_start_is_handled_at_once(tmp_path, monkeypatch):
    hangs = tmp_path / "hangs"
    hangs.write_text("#!/bin/sh\nexec sleep 60\n")
    hangs.chmod(0o755)
    monkeypatch.setattr(cell_ranks.sys, "executable", str(hangs))

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    prev = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(2)  # what SIGTERM does in `tidal run` (ray_start.trap_sigterm)
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            _start(ShardConfig(ranks=2))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, prev)
    assert time.monotonic() - t0 < 6
    left = [p for p in psutil.Process().children() if str(hangs) in " ".join(p.cmdline())]
    assert left == []  # the follower that was starting is ended
