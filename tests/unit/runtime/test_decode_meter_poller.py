"""The run's decode meter poller (``tidal.runtime.decode_meter``), against a faked
``/tidal/stats``: the controller is not metered until the first answer, then observes the latest
pair; a failed or hung poll keeps the last pair; polls failing in a row past the bound end the
run through its task owner, named."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import httpx
import pytest

from tidal.clock import ManualClock
from tidal.config import load_yaml
from tidal.control.factory import build_controller
from tidal.runtime.cell import RuntimeFailure
from tidal.runtime.decode_meter import DecodeMeter
from tidal.runtime.tasks import PartFailed, Parts
from tidal.testing.actuator import FakeActuator

CFG = load_yaml(Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml")


class FakeStats:
    """``/tidal/stats`` answering from a script: a (tokens, inflight_s) pair, an HTTP status,
    or ``"hang"`` (no answer)."""

    def __init__(self, script: list) -> None:
        self.script, self.calls = list(script), 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/tidal/stats"
        self.calls += 1
        step = self.script.pop(0) if self.script else 503
        if step == "hang":
            await asyncio.sleep(30)
        if isinstance(step, int):
            return httpx.Response(step, json={"error": "down"})
        return httpx.Response(
            200, json={"inflight": 1, "decode_meter": {"tokens": step[0], "inflight_s": step[1]}}
        )


def _meter(script: list, clock: ManualClock, **kw) -> tuple[DecodeMeter, FakeStats]:
    fake = FakeStats(script)
    admin = httpx.AsyncClient(base_url="http://proxy", transport=httpx.MockTransport(fake))
    ctl = build_controller(CFG, clock, FakeActuator(clock))
    return DecodeMeter(admin, ctl, clock, **kw), fake


def test_the_controller_observes_the_latest_reading_and_keeps_it_over_failures(caplog):
    async def main():
        clock = ManualClock()
        m, _ = _meter([500, (10, 1.5), "hang", (40, 4.0), 503], clock, timeout_s=0.05)
        seen = []
        for _ in range(5):
            await m.poll()
            seen.append(
                (m.ctl.decode_meter is None, m.ctl.observation("test").decode_meter, m.missed)
            )
        await m.admin.aclose()
        return seen

    with caplog.at_level(logging.WARNING, logger="tidal.runtime.decode_meter"):
        seen = asyncio.run(main())
    assert seen == [
        (True, None, 1),  # not metered before the first answer
        (False, (10.0, 1.5), 0),
        (False, (10.0, 1.5), 1),  # a hung poll is bounded, the last pair kept
        (False, (40.0, 4.0), 0),
        (False, (40.0, 4.0), 1),
    ]
    warned = [r.message for r in caplog.records if "keeping the last reading" in r.message]
    assert len(warned) == 3 and "HTTPStatusError" in warned[0] and "no answer within" in warned[1]
    assert all("nothing is lost" in w for w in warned)


def test_the_bound_follows_the_load_and_misses_are_counted():
    """A timed-out poll doubles the next bound (up to the maximum); an answer sets it to 4x
    its own time (at least the base); misses and the longest gap reach the figures."""

    async def main():
        clock = ManualClock()
        m, _ = _meter(["hang", "hang", "hang", (5, 0.5)], clock, timeout_s=0.02, max_timeout_s=0.05)
        bounds = []
        for _ in range(3):
            await m.poll()
            clock.advance(2.0)
            bounds.append(m.bound_s)
        await m.poll()
        bounds.append(m.bound_s)
        await m.admin.aclose()
        return bounds, m.figures(), m.read()

    bounds, figures, reading = asyncio.run(main())
    assert bounds[:3] == [0.04, 0.05, 0.05]  # doubled, then held at the maximum
    assert bounds[3] == 0.02  # an answer: 4x its (fast) time, at least the base
    assert reading == (5.0, 0.5)  # the cumulative pair: the misses lost nothing
    assert figures["polls"] == 4 and figures["missed"] == 3
    assert figures["longest_gap_s"] == 6.0


def test_polls_failing_in_a_row_end_the_run_named():
    async def main():
        clock = ManualClock()
        m, fake = _meter(
            [(1, 0.1), 503, 503, (2, 0.2), 503, 503, 503], clock, every_s=2.0, missed_polls=3
        )
        parts = Parts()

        async def forever():
            await asyncio.sleep(30)

        with pytest.raises(PartFailed) as info:
            parts.spawn("decode meter", m.run())
            await parts.run(forever(), timeout_s=10)
        await parts.aclose()
        await m.admin.aclose()
        return info.value, fake.calls, clock.now(), m.ctl.decode_meter()

    failed, calls, now, last = asyncio.run(main())
    assert failed.part == "decode meter" and isinstance(failed.cause, RuntimeFailure)
    assert "failed 3 times in a row" in str(failed) and "503" in str(failed)
    assert calls == 7 and now == 12.0  # polled every 2 s on the run's clock
    assert last == (2.0, 0.2)
