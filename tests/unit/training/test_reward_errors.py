"""Issue 38 (4, 5): one bad reward never stops or stalls the run. The rule
(``tidal.control.ledger``): a ``reward_error`` member (no reward, never a stand-in 0.0) settles
unscored; its group trains on its scored members (advantages over those only) and is dropped
and counted when fewer than 2 are scored. Advantages are scale-free: a finite reward of 1e308
gives finite advantages. A step whose groups cannot come goes on with what there is, or stops
with one line; a wait without progress ends at ``runtime.step_data_timeout_s``."""

from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from tidal.clock import ManualClock, WallClock
from tidal.contracts import ExecutionRecord
from tidal.control.ledger import Ledger
from tidal.errors import LedgerError, TimeoutExpired
from tidal.runtime.cell import RuntimeFailure
from tidal.training.records import single_call_record
from tidal.training.trajectory_buffer import (
    TrajectoryBuffer,
    TrajectoryBufferConfig,
    group_advantages,
)
from tidal.types import CloseReason

ERR = CloseReason.REWARD_ERROR


def _rec(eid: str, gid: str, reward: float | None) -> ExecutionRecord:
    r = single_call_record(eid, gid, [1, 2], [7, 7], [-1.0, -1.0], 0, 0.0)
    if reward is None:
        return ExecutionRecord(
            execution_id=eid, group_id=gid, calls=r.calls, reward=None, reason=ERR
        )
    return ExecutionRecord(execution_id=eid, group_id=gid, calls=r.calls, reward=reward)


def _ledger_group(lg: Ledger, gid: str, rewards: list[float | None]) -> None:
    for k in range(len(rewards)):
        lg.dispatch(f"{gid}-e{k}", gid, len(rewards))
    for k, r in enumerate(rewards):
        lg.launch(f"{gid}-e{k}")
        lg.close(f"{gid}-e{k}", ERR if r is None else CloseReason.COMPLETED, r)


def test_a_group_with_a_reward_error_member_trains_on_its_scored_members():
    lg = Ledger()
    _ledger_group(lg, "g0", [1.0, None, 0.0, 1.0])
    assert lg.ready_group_ids() == ["g0"] and lg.groups_dropped == 0
    lg.assign(["g0"])  # main: "assigned to a batch before it is ready" (exit 3)
    assert lg.close_reasons[ERR] == 1
    lg.check()


def test_a_group_with_fewer_than_two_scored_members_is_dropped_and_counted():
    lg = Ledger()
    _ledger_group(lg, "g0", [None, 1.0, None, None])
    _ledger_group(lg, "g1", [None, None])
    assert lg.ready_group_ids() == [] and lg.groups_dropped == 2
    with pytest.raises(LedgerError, match="dropped"):
        lg.assign(["g0"])
    lg.check()


def test_a_reward_error_close_carries_no_reward():
    lg = Ledger()
    lg.dispatch("e", "g", 1)
    with pytest.raises(LedgerError, match="reward_error with a reward"):
        lg.close("e", ERR, 0.0)


def test_a_record_has_a_reward_exactly_when_it_was_scored():
    calls = _rec("e", "g", 1.0).calls
    for reward, reason in ((None, CloseReason.COMPLETED), (0.0, ERR), (math.nan, "completed")):
        with pytest.raises(ValidationError):
            ExecutionRecord(
                execution_id="e", group_id="g", calls=calls, reward=reward, reason=reason
            )


def test_the_buffer_applies_the_same_rule():
    buf = TrajectoryBuffer(TrajectoryBufferConfig(group_size=4), ManualClock())
    for k, r in enumerate([1.0, None, 0.0, 1.0]):
        buf.add(_rec(f"g0-e{k}", "g0", r))
    for k, r in enumerate([None, 1.0, None, None]):
        buf.add(_rec(f"g1-e{k}", "g1", r))
    (g,) = buf.take(2, version=0)
    assert g.group_id == "g0" and [r.execution_id for r in g.records] == ["g0-e0", "g0-e2", "g0-e3"]
    assert g.advantages == pytest.approx(group_advantages([1.0, 0.0, 1.0]))
    assert [r.execution_id for r in g.unscored] == ["g0-e1"]
    assert g.mean_reward() == pytest.approx(2 / 3)
    assert buf.stats.groups_dropped_reward == 1 and buf.stats.records_unscored == 4


def test_an_unscored_member_is_kept_for_a_checkpoint():
    buf = TrajectoryBuffer(TrajectoryBufferConfig(group_size=3), ManualClock())
    for k, r in enumerate([1.0, None, 0.0]):
        buf.add(_rec(f"g0-e{k}", "g0", r))
    assert sorted(r.execution_id for r in buf.held_records()) == ["g0-e0", "g0-e1", "g0-e2"]


def test_an_ordered_buffer_goes_on_past_a_dropped_group():
    buf = TrajectoryBuffer(TrajectoryBufferConfig(group_size=2, ordered=True), ManualClock())
    buf.expect(["g0", "g1"])
    buf.add(_rec("g0-e0", "g0", None))
    buf.add(_rec("g0-e1", "g0", 1.0))
    buf.add(_rec("g1-e0", "g1", 0.0))
    buf.add(_rec("g1-e1", "g1", 1.0))
    assert buf.takeable() == 1
    assert [g.group_id for g in buf.take(1, version=0)] == ["g1"]


@pytest.mark.parametrize(
    "rewards", [[1e308, 0.0, -1e308, 5.0], [1e308] * 4, [1.7e308, 1.7e308, 1.6e308], [1e-320, 0.0]]
)
def test_advantages_of_huge_finite_rewards_are_finite(rewards):
    adv = group_advantages(rewards)  # main: inf - inf -> NaN for 1e308
    assert all(math.isfinite(a) for a in adv)
    assert abs(sum(adv)) < 1e-9 * len(adv)
    if max(rewards) > min(rewards):
        assert adv.index(max(adv)) == rewards.index(max(rewards))


def test_advantages_keep_their_value_at_ordinary_scale():
    rewards = [1.0, 0.0, 0.5, 0.25]
    n = len(rewards)
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
    want = [(r - mean) / (std + 1e-6) for r in rewards]
    assert group_advantages(rewards) == pytest.approx(want, rel=1e-12)


# ---------------------------------------------------------------- the trainer loop's waits


class _Actuator:
    def __init__(self) -> None:
        self.training = {0}  # cell 0 holds the training role
        self.training_changed = asyncio.Event()


def _loop(buffer: TrajectoryBuffer, settled, step_data_timeout_s: float = 30.0):
    from pathlib import Path

    from tidal.config import load_yaml
    from tidal.control.factory import build_controller
    from tidal.runtime.trainer_loop import TrainerLoop
    from tidal.testing.actuator import FakeActuator

    tiny = load_yaml(Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml")
    cfg = tiny.model_copy(
        update={
            "runtime": tiny.runtime.model_copy(update={"step_data_timeout_s": step_data_timeout_s})
        }
    )
    clock = WallClock()
    ctl = build_controller(cfg, clock, FakeActuator())
    loop = TrainerLoop(
        cfg, None, buffer, _Actuator(), None, None, ctl, ctl.handle, clock, None, None, dict
    )
    loop.settled = settled
    return loop, ctl


def _ready(buffer: TrajectoryBuffer, n: int) -> None:
    for g in range(n):
        for k in range(4):
            buffer.add(_rec(f"b0-g{g}-e{k}", f"b0-g{g}", float(k)))


def _inputs():
    return SimpleNamespace(gpus=lambda *a: None)


def test_a_step_short_of_groups_that_cannot_come_trains_its_share():
    buffer = TrajectoryBuffer(TrajectoryBufferConfig(group_size=4), ManualClock())
    _ready(buffer, 2)
    loop, ctl = _loop(buffer, settled=lambda burst: True)
    _, need = asyncio.run(loop._core_active(_inputs(), 0, 1, left=2, need=3))
    assert need == 1  # 2 ready, 2 steps of the burst to go: 1 each
    assert ctl.batch_missing == 2  # the supply view asks only for what can come
    _, need = asyncio.run(loop._core_active(_inputs(), 0, 0, left=1, need=3))
    assert need == 2


def test_a_step_that_nothing_can_reach_stops_the_run_in_one_line():
    buffer = TrajectoryBuffer(TrajectoryBufferConfig(group_size=4), ManualClock())
    loop, _ = _loop(buffer, settled=lambda burst: True)
    with pytest.raises(RuntimeFailure, match="no group can come for it: every group of burst 0"):
        asyncio.run(loop._core_active(_inputs(), 0, 3, left=1, need=3))


def test_a_wait_without_progress_ends_at_step_data_timeout_s():
    buffer = TrajectoryBuffer(TrajectoryBufferConfig(group_size=4), ManualClock())
    _ready(buffer, 1)
    loop, _ = _loop(buffer, settled=lambda burst: False, step_data_timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(TimeoutExpired, match=r"1 of 3 groups ready and no progress for 0\.3 s"):
        asyncio.run(loop._core_active(_inputs(), 0, 0, left=1, need=3))
    assert time.monotonic() - t0 < 5.0
