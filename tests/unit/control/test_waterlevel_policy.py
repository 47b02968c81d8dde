from tidal.control.policy import Action
from tidal.control.waterlevel import WaterlevelPolicy


def test_core_moves_first_when_capacity_after_covers_waterlevel(obs):
    p = WaterlevelPolicy()
    # 4 cells x 10 slots: capacity 40. Moving the core leaves 30.
    assert p.decide(obs(waterlevel=31)).action is Action.HOLD
    d = p.decide(obs(waterlevel=30))
    assert d.action is Action.TO_TRAINING and d.cells == (0,)


def test_satellites_follow_in_order(obs):
    p = WaterlevelPolicy()
    # core training; capacity 30; moving sat1 leaves 20.
    assert p.decide(obs(roles="TRRR", waterlevel=21)).action is Action.HOLD
    d = p.decide(obs(roles="TRRR", waterlevel=20))
    assert d.cells == (1,)
    assert p.decide(obs(roles="TTTR", waterlevel=0)).cells == (3,)
    assert p.decide(obs(roles="TTTT", waterlevel=0)).action is Action.HOLD


def test_standalone_slots_count_as_capacity(obs):
    p = WaterlevelPolicy()
    d = p.decide(obs(standalone_slots=15, waterlevel=45))  # 55 - 10 >= 45
    assert d.cells == (0,)


def test_supply_must_reach_threshold_and_hold(obs):
    p = WaterlevelPolicy()
    assert "supply" in p.decide(obs(waterlevel=0, supply=3)).reason
    assert "held" in p.decide(obs(waterlevel=0, supply=5, held=False)).reason
    assert p.decide(obs(waterlevel=0, supply=5)).action is Action.TO_TRAINING


def test_burst_end_returns_satellites_last_first_then_core_stays(obs):
    p = WaterlevelPolicy()
    d = p.decide(obs(roles="TTTR", bursts_ended=1, waterlevel=0))
    assert d.action is Action.TO_ROLLOUT and d.cells == (2,)
    assert p.decide(obs(roles="TTRR", bursts_ended=1)).cells == (1,)
    # only the core left: capacity 30 covers w + pending (10 + 16) and supply passes: stays.
    d = p.decide(obs(roles="TRRR", bursts_ended=1, waterlevel=10, pending_dispatch=16))
    assert d.action is Action.HOLD and "core stays" in d.reason


def test_burst_end_core_returns_when_capacity_short(obs):
    p = WaterlevelPolicy()
    d = p.decide(obs(roles="TRRR", bursts_ended=1, waterlevel=10, pending_dispatch=32))
    assert d.action is Action.TO_ROLLOUT and d.cells == (0,)


def test_burst_end_core_returns_without_supply(obs):
    p = WaterlevelPolicy()
    d = p.decide(obs(roles="TRRR", bursts_ended=1, waterlevel=0, supply=0))
    assert d.cells == (0,)


def test_core_may_stay_false_always_returns_core(obs):
    p = WaterlevelPolicy(core_may_stay=False)
    assert p.decide(obs(roles="TRRR", bursts_ended=1)).cells == (0,)


def test_in_flight_holds(obs):
    assert WaterlevelPolicy().decide(obs(in_flight=True)).action is Action.HOLD


def test_pending_dispatch_counts_before_moving(obs):
    p = WaterlevelPolicy()
    assert p.decide(obs(waterlevel=20, pending_dispatch=11)).action is Action.HOLD
    assert p.decide(obs(waterlevel=20, pending_dispatch=10)).cells == (0,)


def test_after_core_stays_normal_rule_resumes(obs):
    p = WaterlevelPolicy()
    assert p.decide(obs(roles="TRRR", bursts_ended=1, waterlevel=10)).action is Action.HOLD
    assert p.decide(obs(roles="TRRR", bursts_ended=1, waterlevel=10)).cells == (1,)
