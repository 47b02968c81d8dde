"""tidal's verl policies against verl's released code (verl 0.9.1, fetched with pip).

The wheel is downloaded once into ``~/.cache/tidal/verl`` (``$TIDAL_CACHE_DIR``) with
``pip download verl==0.9.1 --no-deps`` and its policy files run as released, without verl's
dependencies (``tidal.integrations.verl_wheel``). These tests skip only when no package
registry is reachable (and the wheel is not cached yet); any other failure to fetch or load
the wheel fails them.

Differential: random hook sequences, in the order verl's ``FullyAsyncTrainer`` calls the hooks,
each answered by verl's policy object and by tidal's, compared answer by answer and on the
state later answers depend on (``tidal.integrations.verl_conformance``): 1000 sequences each
for ``default``, ``fixed_ratio``, ``static_fully_async`` and the V1 trainer's switch policy
(``verl-switch``). Excluded from the comparison, with its reason: ``colocated_fallback=true``
(verl-static with no standalone engine rolls out on the hybrids, where verl's policy never
activates; off by default, so the default is compared) and ``clamp=true`` (verl-default's
ratio kept in [1/trigger, 1]; verl has no lower bound; off by default).
"""

from __future__ import annotations

import contextlib
import io
import logging
import random
import time
from collections import defaultdict

import pytest

from tidal.control.metrics import aggregate, rollout_resource_utilization, special_metrics
from tidal.control.verl_hooks import HOOKS, StaticHooks
from tidal.integrations import verl_conformance as vc
from tidal.integrations import verl_wheel

SEQUENCES = 1000


@pytest.fixture(scope="module")
def verl():
    return verl_wheel.ensure_loaded(pytest.skip)


def _tidal(name: str, ratio: float, only_hybrid: bool):
    return HOOKS[name](ratio, only_hybrid)


@pytest.mark.parametrize("name", vc.VERL_NAMES)
def test_no_divergence_from_verls_policies(verl, name):
    out = vc.compare(verl, name, _tidal, SEQUENCES)
    assert out.sequences == SEQUENCES
    assert out.state_divergent == 0, out.line() + "\n" + "\n".join(out.details)


def test_the_comparison_sees_a_divergence(verl):
    """The departures are real departures: the differential is not vacuous."""
    fallback = vc.compare(
        verl,
        "static_fully_async",
        lambda n, r, oh: StaticHooks(r, oh, colocated_fallback=True),
        300,
    )
    assert fallback.answer_divergent > 0  # only-hybrid runs (~15 %) activate in tidal only
    clamped = vc.compare(verl, "default", lambda n, r, oh: HOOKS[n](r, oh, clamp=True), 300)
    assert clamped.state_divergent > 0


def test_no_divergence_from_verls_switch_policy(verl):
    clock = vc._Clock()
    switch_cls, mode = verl_wheel.load_switch(vc.switch_env(clock))
    config_cls = verl_wheel.load_switch_config()
    out = vc.compare_switch(switch_cls, mode, config_cls, clock, SEQUENCES)
    assert out.sequences == SEQUENCES
    assert out.state_divergent == 0, out.line() + "\n" + "\n".join(out.details)


def test_verls_registry_builds_its_policies_by_name(verl):
    assert {"default", "fixed_ratio", "static_fully_async"} <= set(verl.registry)
    p = verl.build_policy("default", deactivate_ratio=0.6, only_hybrid=False)
    assert isinstance(p, verl.DynamicSchedulePolicyBase) and p.deactivate_ratio == 0.6


def test_metrics_aggregator_matches_verls(verl):
    """verl's ``MetricsAggregator`` (compiled from ``detach_utils.py``; its module imports
    torch and verl's trainer, the class needs numpy) against tidal's rules on random rows."""
    np = pytest.importorskip("numpy")
    cls = verl_wheel.load_class(
        "verl/experimental/fully_async_policy/detach_utils.py",
        "MetricsAggregator",
        {"defaultdict": defaultdict, "time": time, "np": np, "Any": object},
    )
    rng = random.Random(3)
    keys = [
        "timing_s/step",
        "timing_s/gen",
        "timing_s/wait_for_enough_samples",
        "timing_s/timing_s/param_sync",
        "timing_s/update_actor",
        "dynamic_resource/train_compute_time_s",
        "dynamic_resource/train_allocated_time_s",
        "dynamic_resource/mq_size",
        "fully_async/total_wait_time",
    ]
    for _ in range(200):
        a, b = rng.choice([8, 16]), rng.choice([0, 8, 16])
        agg = cls(total_gpus=a + b, hybrid_gpus=a, standalone_gpus=b)
        values: dict[str, list[float]] = defaultdict(list)
        for _ in range(rng.randint(1, 6)):
            row = {k: rng.randint(0, 4000) / 64 for k in keys if rng.random() < 0.9}
            row["timing_s/step"] = rng.randint(1, 4000) / 64
            agg.add_step_metrics(row, sample_count=16)
            for k, v in row.items():
                values[k].append(v)
        u_roll = rng.choice([None, rng.random()])
        want = agg.get_aggregated_metrics(rollout_resource_utilization=u_roll)
        got = special_metrics(aggregate(values), u_roll, a, b)
        assert got == want


def test_rollout_utilization_matches_verls(verl):
    """verl's ``_compute_rollout_resource_utilization`` on random event histories."""

    class Clock:
        t = 0.0

        def time(self):
            return self.t

    clock = Clock()
    cls = verl_wheel.load_class(
        "verl/experimental/fully_async_policy/fully_async_rollouter.py",
        "FullyAsyncRollouter",
        {"time": clock, "logger": logging.getLogger("verl")},
        methods=("_compute_rollout_resource_utilization",),
    )
    rng = random.Random(5)
    for _ in range(300):
        rollouter = cls()
        t, points = 0.0, []
        for _ in range(rng.randint(1, 12)):
            points.append((t, rng.randint(0, 40), rng.choice([0, 8, 16, 32])))
            t += rng.randint(0, 640) / 64
        rollouter._active_count_history = list(points)
        rollouter.active_tasks = set(range(rng.randint(0, 40)))
        rollouter.max_concurrent_samples = rng.choice([None, 0, 16, 32])
        clock.t = t
        with contextlib.redirect_stdout(io.StringIO()):
            want = rollouter._compute_rollout_resource_utilization()
        closing = (t, len(rollouter.active_tasks), rollouter.max_concurrent_samples or 0)
        assert rollout_resource_utilization([*points, closing]) == want
