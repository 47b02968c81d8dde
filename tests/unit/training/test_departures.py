"""Log levels that mean something: a satellite the runtime stops (its cell returns to rollout)
leaves at INFO with its reason; one whose connection drops unannounced is a WARNING; and the
run's last line counts every warning class (``tidal.logcount``)."""

import logging

from tidal.clock import ManualClock
from tidal.logcount import counting_warnings
from tidal.training.coordinator import Coordinator, CoordinatorConfig
from tidal.training.groups import GroupRegistry
from tidal.training.packing import PackingBuffer, PackingConfig


def _coordinator() -> Coordinator:
    clock = ManualClock()
    coord = Coordinator(
        CoordinatorConfig(),
        PackingBuffer(PackingConfig(token_budget=64), clock),
        GroupRegistry(0, "127.0.0.1", 0, "core"),
        clock,
    )
    coord.fingerprint, coord.numel, coord.loss = "fp", 1, {}
    return coord


def _join(coord: Coordinator, cell: int) -> dict:
    session: dict = {}
    coord.handle(
        {"op": "hello", "cell": cell, "incarnation": f"i{cell}", "fingerprint": "fp"}, session
    )
    return session


def test_planned_departures_are_info_unannounced_losses_warnings(caplog):
    coord = _coordinator()
    stopped, said_bye, dropped = _join(coord, 1), _join(coord, 2), _join(coord, 3)
    coord.expect_departure(1)  # what the runtime's actuator does before stopping cell 1
    coord.handle({"op": "bye"}, said_bye)
    with (
        caplog.at_level(logging.INFO, logger="tidal.training.coordinator"),
        counting_warnings() as counter,
    ):
        for session in (stopped, said_bye, dropped):
            coord.on_disconnect(session)
    by_level = {(r.levelno, r.getMessage()) for r in caplog.records if "cell" in r.getMessage()}
    assert (
        logging.INFO,
        "cell 1 (i1) left training: the runtime stopped it (the cell returns "
        "to rollout); 0 micro-steps reopened",
    ) in by_level
    assert (
        logging.INFO,
        "cell 2 (i2) left training: it said bye; 0 micro-steps reopened",
    ) in by_level
    assert (
        logging.WARNING,
        "cell 3 (i3) lost: its connection closed without a bye; 0 micro-steps reopened",
    ) in by_level
    assert counter.total == 1
    assert counter.line() == (
        "warnings: 1 (1 × tidal.training.coordinator "
        '"cell %d (%s) lost: %s; %d micro-steps reopened")'
    )


def test_a_connection_closed_once_the_core_shut_down_is_the_runs_end_not_a_loss(caplog):
    """At a run's end the core closes its server before the runtime stops the satellites:
    their connections then close without a bye, which is the run ending (CI 2026-12-06:
    ``warnings: 1`` on a clean tiny run whose last step had a satellite training)."""
    coord = _coordinator()
    session = _join(coord, 1)
    coord.shutdown()
    with (
        caplog.at_level(logging.INFO, logger="tidal.training.coordinator"),
        counting_warnings() as counter,
    ):
        coord.on_disconnect(session)
    assert counter.total == 0
    assert [r.getMessage() for r in caplog.records] == [
        "cell 1 (i1) left training: the run ended (the core shut down); 0 micro-steps reopened"
    ]


def test_no_warning_is_the_line_warnings_none():
    with counting_warnings() as counter:
        logging.getLogger("tidal.x").info("a normal event")
    assert counter.line() == "warnings: none"


def test_a_replaced_incarnations_late_disconnect_never_loses_the_newcomer(caplog):
    """The re-join failure of issue 25: the stopped satellite's handler thread was still in
    ``join`` when its replacement said hello; its disconnect, handled late, declared the new
    incarnation lost and dropped its link (its first pull: 'Connection closed by peer')."""
    coord = _coordinator()
    old = _join(coord, 1)
    coord.expect_departure(1)
    new: dict = {}
    coord.handle({"op": "hello", "cell": 1, "incarnation": "i1-new", "fingerprint": "fp"}, new)
    with (
        caplog.at_level(logging.INFO, logger="tidal.training.coordinator"),
        counting_warnings() as counter,
    ):
        coord.on_disconnect(old)  # late: after the newcomer's hello
    assert coord.registered() == [1] and coord._sats[1].incarnation == "i1-new"
    assert counter.total == 0
    try:
        coord.handle({"op": "pulled", "version": 3}, old)
    except Exception as exc:  # the old session cannot act for the newcomer
        assert "replaced" in str(exc)
    else:
        raise AssertionError("a replaced incarnation's request was served")
    coord.handle({"op": "pulled", "version": 3}, new)
    assert coord._sats[1].version == 3
