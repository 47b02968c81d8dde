"""Shipped test helpers: the manual clock and a fake actuator that records plans.

For tests and docs only; production code never imports this package.
"""

from tidal.clock import ManualClock
from tidal.testing.actuator import FakeActuator

__all__ = ["FakeActuator", "ManualClock"]
