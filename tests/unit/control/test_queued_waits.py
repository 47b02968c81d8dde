"""The queued-execution figures (``tidal.control.queued_waits``): per execution, measured."""

from tidal.control.queued_waits import KEYS, QueuedWaits, figures


def test_waits_sum_per_execution_and_give_count_total_p99_and_max():
    q = QueuedWaits()
    q.add("a", 2.0)
    q.add("a", 3.0)  # displaced twice: waited twice
    q.add("b", 1.0)
    q.add("c", 0.0)  # no wait
    f = q.figures()
    assert set(f) == set(KEYS)
    assert f == {
        "queued_executions": 2,
        "queued_execution_s": 6.0,
        "queued_execution_p99_s": 5.0,
        "queued_execution_max_s": 5.0,
    }
    # a wait still going on counts up to now, without being recorded
    assert q.figures({"b": 9.0})["queued_execution_max_s"] == 10.0
    assert q.figures()["queued_execution_max_s"] == 5.0


def test_bounded_by_executions_kept_open_without_losing_a_wait():
    q = QueuedWaits(max_open=2)
    for i in range(5):
        q.add(str(i), float(i + 1))
    assert q.figures()["queued_execution_s"] == 15.0 and len(q._open) == 2


def test_p99_over_a_hundred_executions_and_none_at_all():
    assert figures([float(i) for i in range(1, 101)])["queued_execution_p99_s"] == 99.0
    assert figures([]) == dict.fromkeys(KEYS, 0) | {"queued_execution_max_s": 0.0}
