"""A failure inside the run never vanishes: an exception raised by the controller while it
handles an event (here the first ``TransitionStepDone``, delivered from the actuator's step task,
where it used to disappear with its fire-and-forget task) ends ``tidal run`` with that exception
named on stderr and a non-zero exit code, and every part the run started is stopped."""

from __future__ import annotations

import json

import psutil

from tidal.cli import main
from tidal.control.controller import Controller
from tidal.errors import InvariantViolation
from tidal.runtime.tasks import PartFailed
from tidal.types import TransitionStepDone

from .test_tiny_run import CONFIG


def test_an_exception_in_the_controllers_handling_ends_the_run_with_it(
    tmp_path, monkeypatch, capsys
):
    real = Controller.handle
    seen: list[str] = []

    def handle(self, event):
        if isinstance(event, TransitionStepDone):
            seen.append(type(event).__name__)
            raise InvariantViolation("injected: step result out of order")
        return real(self, event)

    monkeypatch.setattr(Controller, "handle", handle)
    out = tmp_path / "run"
    code = main(["run", str(CONFIG), "--out", str(out)])
    err = capsys.readouterr().err

    assert seen, "no plan step ran: the injection point was never reached"
    assert code == PartFailed.exit_code == 3
    assert (
        "run stopped: controller handling TransitionStepDone failed: InvariantViolation: "
        "injected: step result out of order"
    ) in err
    assert not (out / "summary.json").exists()  # it did not finish as if nothing happened
    # what the run started (engines, proxy, Ray's processes) is stopped
    data = json.loads((out / "processes.json").read_text())
    started = []
    for row in data["processes"]:
        if row["pid"] == data["driver"]:
            continue
        try:
            p = psutil.Process(row["pid"])
            if abs(p.create_time() - row["create_time"]) < 1e-3:
                started.append(p)
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(started, timeout=20)
    assert [p for p in alive if p.status() != psutil.STATUS_ZOMBIE] == []
