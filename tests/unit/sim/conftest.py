import pytest

from tidal.testing.sim_scenarios import tiny_scenario


@pytest.fixture
def tiny():
    return tiny_scenario()
