"""The tidal policy's rules, each on its own (``tidal.control.tidal_rules``): each returns its
decision on the situation it names and None (the next rule's turn) otherwise."""

import dataclasses
import math

import pytest

from tidal.control import tidal_rules as rules
from tidal.control.policy import Action, CellView, Observation
from tidal.control.supply import SupplyView
from tidal.control.tidal_policy import TidalPolicy
from tidal.control.tidal_rules import Situation
from tidal.errors import ConfigError
from tidal.types import CellKind, Role

K = TidalPolicy()  # horizon 60 s, dwell 20 s, low 2 batches, high 0, floor 1
ON = TidalPolicy(max_queued=256)  # over-subscription on (off by default)


def sit(
    roles=("training", "rollout"),
    waterlevel=10,
    pending=0,
    ready=20,
    p=0.01,
    c=0.001,
    known=True,
    supply_ok=True,
    slots=128,
    last=Action.HOLD,
    last_move_s=-1e9,
    t=100.0,
    q=0.0,
    since=None,
    generated=100,
    move_s=0.0,
    per_gpu=math.inf,
    todo_peak=0,
) -> Situation:
    cells = tuple(CellView(i, slots, 8, CellKind.HYBRID, Role(r)) for i, r in enumerate(roles))
    cap = sum(x.slots for x in cells if x.role is Role.ROLLOUT) + 256
    o = Observation(
        now_s=t,
        trigger="Tick",
        cells=cells,
        standalone_slots=256,
        standalone_gpus=16,
        rollout_capacity=cap,
        waterlevel=waterlevel,
        queued=0,
        running=waterlevel,
        pending_dispatch=pending,
        supply=SupplyView(min(ready, 16), 16, 8.0, supply_ok, 0.0, supply_ok),
        ready_groups=ready,
        groups_generated=generated,
        batch_groups=16,
        updates_per_burst=4,
        trainer_waiting=True,
        trainer_step=0,
        steps_in_version=0,
        version=0,
        bursts_ended=0,
        in_flight=False,
    )
    gpus = sum(x.gpus for x in cells if x.role is Role.TRAINING)
    rollout_gpus = 16 + sum(x.gpus for x in cells if x.role is Role.ROLLOUT)
    return Situation(
        o, p, c, known, gpus, last, last_move_s, q, since, move_s, rollout_gpus, per_gpu, todo_peak
    )


def test_measuring_holds_until_both_rates_are_known_unless_a_side_is_empty():
    assert rules.measuring(sit(known=False)).reason == "measuring rates"
    assert rules.measuring(sit(known=True)) is None
    assert rules.measuring(sit(known=False, roles=("rollout", "rollout"))) is None  # no gpus
    assert rules.measuring(sit(known=False, ready=32)) is None  # a backlog of two batches


def test_train_floor_is_min_train_cells_unless_no_rollout_or_a_starving_trainer():
    assert rules.train_floor(sit(), K) == 1
    # queue below a batch and not one batch within the horizon even with every slot
    assert rules.train_floor(sit(ready=0, p=1e-6, waterlevel=10), K) == 0
    assert rules.train_floor(sit(ready=0, p=1.0, waterlevel=10), K) == 1
    # before a batch has completed the production rate is biased low: no starvation verdict
    assert rules.train_floor(sit(ready=0, p=1e-6, waterlevel=10, generated=15), K) == 1
    assert rules.train_floor(sit(ready=0, p=1e-6, waterlevel=10, generated=16), K) == 0


def test_return_block_is_the_smallest_that_covers_the_missing_slots():
    s = sit(roles=("training", "training", "training", "rollout"), waterlevel=600, p=0.0)
    movable = [v for v in s.obs.cells if v.role is Role.TRAINING]
    # capacity 384, 600 to run: two cells of 128 cover 640 >= 600
    assert rules.return_block(s, movable) == (1, 2)


def test_return_cells_when_rollout_is_short_and_the_queue_runs_dry():
    s = sit(roles=("training", "training", "rollout"), waterlevel=500, ready=0, p=1e-4)
    d = rules.return_cells(s, K)
    assert d.action is Action.TO_ROLLOUT and d.cells == (1,)
    assert "rollout short: 500 executions to run > 384 slots" in d.reason
    assert (
        rules.return_cells(sit(roles=("training", "training", "rollout"), waterlevel=100), K)
        is None
    )  # enough slots
    dwell = sit(
        roles=("training", "training", "rollout"),
        waterlevel=500,
        ready=0,
        p=1e-4,
        last=Action.TO_TRAINING,
        last_move_s=90.0,
    )
    assert rules.return_cells(dwell, K).reason == "dwell before reversing the last move"


def test_idle_trainer_lends_or_holds_dispatch_at_the_capacity_after_the_move():
    s = sit(roles=("rollout", "rollout"), waterlevel=100, ready=16)
    nxt = s.obs.cells[0]
    d = rules.idle_trainer(s, K, nxt, 384)
    assert d.action is Action.TO_TRAINING and d.cells == (0,) and d.dispatch_limit is None
    held = rules.idle_trainer(
        sit(roles=("rollout", "rollout"), waterlevel=450, ready=16), K, nxt, 384
    )
    assert held.action is Action.HOLD and held.dispatch_limit == 384
    assert rules.idle_trainer(sit(roles=("rollout", "rollout"), ready=15), K, nxt, 384) is None
    assert rules.idle_trainer(sit(ready=16), K, nxt, 384) is None  # something trains


def test_waterlevel_blocked_holds_and_holds_dispatch_when_production_leads():
    s = sit(waterlevel=300)
    nxt = s.obs.cells[1]
    assert rules.waterlevel_blocked(s, K, nxt, 256, 0.5).dispatch_limit == 256
    d = rules.waterlevel_blocked(s, K, nxt, 256, -0.5)
    assert d.reason == "capacity after move 256 < waterlevel 300" and d.dispatch_limit is None
    assert rules.waterlevel_blocked(sit(waterlevel=200), K, nxt, 256, -0.5) is None


def test_rollout_needs_slots_unless_the_queue_grows_or_a_backlog_is_ready():
    assert (
        "rollout needs the slots"
        in rules.rollout_needs_slots(sit(waterlevel=300), 256, -0.1).reason
    )
    assert rules.rollout_needs_slots(sit(waterlevel=300), 256, 0.1) is None
    assert rules.rollout_needs_slots(sit(waterlevel=300, ready=32), 256, -0.1) is None
    assert rules.rollout_needs_slots(sit(waterlevel=200), 256, -0.1) is None


def test_supply_not_held_holds():
    assert rules.supply_not_held(sit(supply_ok=False)).reason == "supply 16 not ok"
    assert rules.supply_not_held(sit()) is None


def test_queue_too_low_holds_below_high_batches():
    k = TidalPolicy(high_batches=1.0)
    assert "projected queue 10.0 < 16" in rules.queue_too_low(sit(), k, 10.0).reason
    assert rules.queue_too_low(sit(), k, 16.0) is None


def test_lend_next_lends_with_spare_slots_and_holds_when_balanced():
    d = rules.lend_next(sit(), K)
    assert d.action is Action.TO_TRAINING and d.cells == (1,)
    assert d.reason.startswith("rollout has spare slots (10 executions to run <= 256)")
    assert rules.lend_next(sit(roles=("training", "training")), K).reason == "balanced"
    dwell = rules.lend_next(sit(last=Action.TO_ROLLOUT, last_move_s=95.0), K)
    assert dwell.reason == "dwell before reversing the last move"


def test_tail_lend_only_while_the_trainer_is_the_bottleneck():
    # the version still needs 16 + 3 * 16 = 64 groups; 44 are missing, produced at
    # p * running = 0.01 * 10 = 0.1 groups/s: 440 s
    slow = sit(c=0.001)  # 8 GPUs at 0.001 groups/GPU-s: 8000 s to train them
    assert rules.tail_lend_idle(slow, 256) is None
    fast = sit(c=0.1)  # 80 s to train: the lent cell would wait for data
    d = rules.tail_lend_idle(fast, 256)
    assert d.action is Action.HOLD and d.reason == (
        "spare slots but the trainer waits for data: 64 groups take 80s to train, 440s to "
        "produce (+0s move)"
    )
    assert rules.lend_next(fast, K).reason == d.reason
    # the lend's own duration counts against it: 500 s to train, 440 s + 100 s move
    assert rules.tail_lend_idle(sit(c=0.016, move_s=100.0), 256) is not None
    assert rules.tail_lend_idle(sit(c=0.016, move_s=0.0), 256) is None
    assert rules.tail_lend_idle(sit(c=0.1, ready=40), 256) is None  # a backlog lends anyway
    assert rules.tail_lend_idle(sit(c=0.1, waterlevel=300, ready=0), 256) is None  # not spare
    nothing = sit(c=0.1, roles=("rollout", "rollout"))  # nothing trains: the idle-trainer rule
    assert rules.tail_lend_idle(nothing, 128) is None


def test_start_cells_is_where_the_policy_starts_not_the_floor():
    cells = tuple(CellView(i, 128, 8, CellKind.HYBRID, Role.ROLLOUT) for i in range(3))
    assert TidalPolicy().initial_prefix(cells) == 0  # every cell rolls out until a batch
    assert TidalPolicy(start_cells=2).initial_prefix(cells) == 2
    assert TidalPolicy(start_cells=9).initial_prefix(cells) == 3
    with pytest.raises(ConfigError, match=r"policy\.args\.start_cells"):
        TidalPolicy(start_cells=-1)


def test_decide_asks_the_rules_in_order():
    assert rules.decide(sit(known=False), K).reason == "measuring rates"
    assert (
        rules.decide(
            sit(roles=("training", "training", "rollout"), waterlevel=500, ready=0, p=1e-4), K
        ).action
        is Action.TO_ROLLOUT
    )
    assert rules.decide(sit(), K).action is Action.TO_TRAINING


def test_forecast_prices_the_queue_against_the_training_it_buys():
    # capacity 384, cell 1 (128 slots, 8 GPUs) leaves 256 < waterlevel 300: 44 wait
    s = sit(waterlevel=300, ready=48, p=0.0005, c=0.01, q=0.001)
    f = rules.forecast(s, s.obs.cells[1], 256)
    assert f.excess == 44 and abs(f.wait_s - 44 / 0.256) < 1e-9
    assert abs(f.cost_groups - 0.0005 * 44 * f.wait_s / 2) < 1e-9
    assert abs(f.benefit_groups - 0.01 * 8 * f.wait_s) < 1e-9
    assert rules.forecast(sit(waterlevel=300, q=0.0), s.obs.cells[1], 256) is None  # q unknown
    assert rules.forecast(sit(waterlevel=200, q=0.001), s.obs.cells[1], 256) is None  # fits


def test_oversubscribe_moves_when_training_bought_exceeds_queueing_within_the_caps():
    s = sit(waterlevel=300, ready=48, p=0.0005, c=0.01, q=0.001)
    nxt = s.obs.cells[1]
    d = rules.oversubscribe(s, ON, nxt, 256)
    assert d.action is Action.TO_TRAINING and d.cells == (1,) and d.oversubscribe
    assert d.dispatch_limit is None and "44 executions wait" in d.reason
    # the same move through the lend chain: it is the waterlevel-blocked case
    assert rules.waterlevel_blocked(s, ON, nxt, 256, -0.032).oversubscribe
    # queueing costs more than the training it buys (production dear, training cheap)
    assert (
        rules.oversubscribe(sit(waterlevel=300, ready=48, p=0.01, c=0.001, q=0.001), ON, nxt, 256)
        is None
    )
    # caps: too many waiting, or the last would wait too long
    assert rules.oversubscribe(s, TidalPolicy(max_queued=43), nxt, 256) is None
    assert rules.oversubscribe(s, TidalPolicy(max_queued=256, max_wait_s=100.0), nxt, 256) is None
    assert rules.oversubscribe(s, TidalPolicy(max_queued=0), nxt, 256) is None  # off
    assert rules.oversubscribe(s, K, nxt, 256) is None  # off by default
    # the ready queue does not cover the new split's training over the wait (20 < 0.01 * 16
    # GPUs * 172 s): the trainer would need the groups the waiting executions delay
    assert (
        rules.oversubscribe(sit(waterlevel=300, ready=20, p=0.0005, c=0.01, q=0.001), ON, nxt, 256)
        is None
    )
    # supply not held, or dwelling after a return
    assert (
        rules.oversubscribe(
            sit(waterlevel=300, ready=48, p=0.0005, c=0.01, q=0.001, supply_ok=False), K, nxt, 256
        )
        is None
    )
    assert (
        rules.oversubscribe(
            sit(
                waterlevel=300,
                ready=48,
                p=0.0005,
                c=0.01,
                q=0.001,
                last=Action.TO_ROLLOUT,
                last_move_s=95.0,
            ),
            ON,
            nxt,
            256,
        )
        is None
    )


def test_wait_cap_returns_the_last_training_cell_once_executions_waited_too_long():
    roles = ("training", "training", "rollout")  # capacity 384
    s = sit(roles=roles, waterlevel=500, t=1000.0)
    assert rules.wait_capped(s, K) is None  # nothing over-subscribed
    assert rules.wait_capped(sit(roles=roles, waterlevel=500, t=1000.0, since=500.0), K) is None
    d = rules.wait_capped(sit(roles=roles, waterlevel=500, t=1000.0, since=50.0), K)
    assert d.action is Action.TO_ROLLOUT and d.cells == (1,) and "116 without one" in d.reason
    fits = sit(roles=roles, waterlevel=384, t=1000.0, since=50.0)
    assert rules.wait_capped(fits, K) is None  # every launched execution has a slot


def test_return_rule_waits_while_an_over_subscription_is_within_its_cap():
    roles = ("training", "training", "rollout")
    short = dict(roles=roles, waterlevel=500, ready=0, p=1e-4, t=1000.0)
    assert rules.return_cells(sit(**short), K).action is Action.TO_ROLLOUT
    assert rules.return_cells(sit(**short, since=900.0), K) is None  # 100 s <= 900 s
    assert rules.return_cells(sit(**short, since=50.0), K).action is Action.TO_ROLLOUT


def test_a_lend_counts_the_throughput_the_engines_left_keep_past_their_knee():
    # 10 executions to run fit the 256 slots left, but at 0.5 executions per rollout GPU the
    # 16 GPUs left serve 8 at full speed: production falls below the doubled consumption
    assert rules.lend_next(sit(c=0.01), K).action is Action.TO_TRAINING  # no knee seen
    d = rules.lend_next(sit(c=0.01, per_gpu=0.5), K)
    assert d.action is Action.HOLD
    assert d.reason.startswith("rollout needs the throughput (knee at 8): 10 executions")


def test_past_their_knee_the_engines_get_back_the_block_that_raises_throughput():
    def knee(c):  # 300 to run fit the 384 slots; 5 executions per GPU: 120 at full speed
        return sit(
            roles=("training", "training", "rollout"),
            waterlevel=300,
            ready=0,
            p=1e-4,
            c=c,
            per_gpu=5.0,
        )

    d = rules.return_cells(knee(0.01), K)
    assert d.action is Action.TO_ROLLOUT and d.cells == (1,)
    assert d.reason.startswith("engines at their knee (300 executions to run, 120 at full")
    # min(production, consumption) 0.012 -> 0.012 groups/s: no gain, no return
    assert rules.return_cells(knee(0.0015), K) is None
    assert (
        rules.return_cells(
            sit(roles=("training", "training", "rollout"), waterlevel=300, ready=0, p=1e-4, c=0.01),
            K,
        )
        is None
    )  # no knee: slots enough


def test_a_return_for_slots_with_a_batch_ready_must_raise_throughput():
    def short(ready):  # 500 to run > 384 slots; production 0.0384 > consumption 0.016
        return sit(
            roles=("training", "training", "rollout"), waterlevel=500, ready=ready, p=1e-4, c=0.001
        )

    # the queue (20, a batch ready) projects below two batches, but returning cell 1 cuts
    # the split's throughput from 0.016 to 0.008 groups/s: it would only buy a lend back
    assert rules.return_cells(short(20), K) is None
    assert rules.return_cells(short(0), K).cells == (1,)  # the trainer about to starve


def test_no_lend_that_the_next_versions_peak_would_bring_back():
    # now: production min(384, 5 * 24 = 120) at the recent peak of 200 executions; after
    # the lend 5 * 16 = 80: 0.8 < 1.2 groups/s with consumption 0.2 * 16 = 3.2
    s = sit(c=0.2, per_gpu=5.0, todo_peak=200)
    nxt = s.obs.next_to_train()
    d = rules.past_knee_at_peak(s, nxt, 256)
    assert d.action is Action.HOLD and d.reason.startswith(
        "at the recent peak (200 executions) the engines left pass their knee (80)"
    )
    assert rules.lend_next(s, K).reason == d.reason
    assert rules.past_knee_at_peak(sit(c=0.05, per_gpu=5.0, todo_peak=200), nxt, 256) is None
    assert rules.past_knee_at_peak(sit(c=0.2, todo_peak=200), nxt, 256) is None  # no knee


def _metered(obs, t, tokens, seq_s, running):
    return dataclasses.replace(obs, now_s=t, decode_meter=(tokens, seq_s), running=running)


@pytest.mark.parametrize(("per_seq", "knee"), [(20.0, True), (2.0, False)])
def test_the_policy_finds_the_knee_from_the_decode_meter(per_seq, knee):
    """10 sequences at 50 tokens/s for a minute, then 40 at ``per_seq``: sequences slower
    while the 24 rollout GPUs make more tokens is the knee; slower sequences on GPUs making
    fewer tokens (longer contexts) is not."""
    pol, obs = TidalPolicy(), sit().obs
    pol._observe_meter(_metered(obs, 0.0, 0.0, 0.0, 10))
    pol._observe_meter(_metered(obs, 60.0, 30000.0, 600.0, 10))
    assert pol.gpu_capacity == 0.0 and pol.servable(24) == math.inf
    tokens = 30000.0 + 40 * per_seq * 60
    pol._observe_meter(_metered(obs, 120.0, tokens, 3000.0, 40))
    if knee:
        assert pol.gpu_capacity == pytest.approx(30.0, rel=0.02)  # tokens per GPU-second
        d = pol.demand.rate  # tokens per running-execution-second
        assert pol.servable(24) == pytest.approx(pol.gpu_capacity * 24 / d)
    else:
        assert pol.gpu_capacity == 0.0 and pol.servable(24) == math.inf
