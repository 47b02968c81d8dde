"""Side by side with verl's released policies: random hook sequences, answers compared.

In: verl's policy classes (``verl_wheel``) and tidal's hook objects, a seeded RNG. Out: per
policy, how many sequences diverged (a hook answered differently, or the policy state a later
answer depends on differs) and the first divergence, described.

A sequence is one random training run as verl's ``FullyAsyncTrainer`` drives its policy
(``fully_async_trainer.py``, 0.9.1): the parameter sync before ``fit`` (version 0), then per
version ``trigger`` fit steps, each asking ``should_deactivate`` (and, if it answers True,
``deactivate_wait_samples``, then deactivating: ``last_deactivate_duration_s +=``) before
collecting a batch (one wait time, one count of samples really waited for), and after the
last one the sync: context refreshed (``total_generated_samples``, ``expected_samples`` =
SR x completed rollouter steps, ``buffer_samples``, the cycle's waits), then
``should_activate_after_step``, activation (``last_activate_duration_s +=``) and
``request_rebalance`` if it answered True, ``update_after_step``, and the durations reset.
Both policies see the same context at every call (tidal's as a ``VerlContext``). Durations
are multiples of 1/64 s, so both sides' sums are exact.

Random draws cover the edges that matter: ratios at 0 and 1, only-hybrid runs, cycles with no
wait, no generation, no switch, zero-length switches.
"""

from __future__ import annotations

import contextlib
import io
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tidal.control.verl_hooks import VerlContext

VERL_NAMES = ("default", "fixed_ratio", "static_fully_async")


@dataclass
class Outcome:
    policy: str
    sequences: int = 0
    answer_divergent: int = 0  # sequences where some hook answered differently
    state_divergent: int = 0  # ... or where the state behind later answers differs
    first: str | None = None
    details: list[str] = field(default_factory=list)

    @property
    def divergent(self) -> int:
        return self.state_divergent

    def line(self) -> str:
        return (
            f"{self.policy}: {self.answer_divergent} of {self.sequences} sequences answer "
            f"differently, {self.state_divergent} diverge in answers or state"
            + (f"; first: {self.first}" if self.first else "")
        )


def _dur(rng: random.Random, p_zero: float, hi: float = 40.0) -> float:
    return 0.0 if rng.random() < p_zero else rng.randint(1, int(hi * 64)) / 64


def _state(name: str, policy: Any, verl: bool, only_hybrid: bool) -> tuple:
    """What later answers depend on: the ratio (``default``, ``fixed_ratio``), the per-sample
    time and the switch cost (``default``); nothing when ``only_hybrid`` (every answer is then
    fixed) or for ``static_fully_async`` (its answers are constants)."""
    if only_hybrid or name == "static_fully_async":
        return ()
    if name != "default":
        return (policy.deactivate_ratio,)
    if verl:
        return (policy.deactivate_ratio, policy._last_per_sample_time, policy._switch_cost())
    return (policy.deactivate_ratio, policy.per_sample_time_s, policy.switch_cost_s())


def run_sequence(
    verl_ns: Any,
    name: str,
    make_tidal: Callable[[str, float, bool], Any],
    rng: random.Random,
    to_ctx: Callable[[Any, int], Any] | None = None,
) -> tuple[str | None, str | None]:
    """One random run; returns (first answer divergence, first state divergence) or None."""
    required = rng.choice([1, 2, 3, 4, 8, 16, 32, 64, rng.randint(1, 64)])
    trigger = rng.randint(1, 8)
    ratio = rng.choice([0.0, 0.02, 0.1, 0.3, 0.5, 0.6, 1.0, rng.random(), rng.random()])
    only_hybrid = rng.random() < 0.15
    staleness = rng.choice([0.0, 0.1, 0.5, 1.0])
    rebalance = rng.random() < 0.5
    versions = rng.randint(1, 25)
    with contextlib.redirect_stdout(io.StringIO()):  # verl prints as it builds
        verl_p = verl_ns.build_policy(name, deactivate_ratio=ratio, only_hybrid=only_hybrid)
    tidal_p = make_tidal(name, ratio, only_hybrid)
    to_ctx = to_ctx or (lambda c, version: VerlContext.of(c))
    ctx = verl_ns.DynamicScheduleContext(
        required_samples=required,
        trigger_parameter_sync_step=trigger,
        total_generated_samples=0,
        expected_samples=0,
        buffer_samples=0,
        only_hybrid=only_hybrid,
    )
    sr = ctx.step_required_samples
    active = False
    answer_div: str | None = None
    state_div: str | None = None
    setup = (
        f"R={required} trigger={trigger} r0={ratio:.4g} only_hybrid={only_hybrid} "
        f"rebalance={rebalance}"
    )

    def call(hook: str, version: int, *args: Any) -> Any:
        nonlocal answer_div
        with contextlib.redirect_stdout(io.StringIO()):  # verl prints every call
            a = getattr(verl_p, hook)(*args, ctx)
        b = getattr(tidal_p, hook)(*args, to_ctx(ctx, version))
        if a != b and answer_div is None:
            answer_div = (
                f"{setup}: version {version} {hook}{args!r} verl {a!r} tidal {b!r} "
                f"(ctx {to_ctx(ctx, version)})"
            )
        return a

    def compare_state(version: int) -> None:
        nonlocal state_div
        a = _state(name, verl_p, True, only_hybrid)
        b = _state(name, tidal_p, False, only_hybrid)
        if a != b and state_div is None:
            state_div = f"{setup}: after version {version}: verl state {a} tidal {b}"

    completed = 1
    generated_in_window = 0

    def sync(version: int) -> None:
        nonlocal active, completed, generated_in_window
        ctx.expected_samples = sr * completed
        ctx.buffer_samples = sr * staleness
        if call("should_activate_after_step", version, version, active):
            active = True
            ctx.last_activate_duration_s += _dur(rng, 0.05)
            if rebalance:
                call("request_rebalance", version, version)
        call("update_after_step", version, version)
        ctx.last_activate_duration_s = ctx.last_deactivate_duration_s = 0.0
        if generated_in_window > 0:  # the rollouter's reset_staleness
            completed += 1
        generated_in_window = 0
        ctx.step_wait_times, ctx.step_wait_samples = [], []
        compare_state(version)

    sync(0)
    for version in range(versions):
        for _ in range(trigger):
            if call("should_deactivate", version, version, active):
                call("deactivate_wait_samples", version)
                active = False
                ctx.last_deactivate_duration_s += _dur(rng, 0.05)
            ctx.step_wait_times.append(_dur(rng, 0.3, 120.0))
            ctx.step_wait_samples.append(0 if rng.random() < 0.4 else rng.randint(1, required))
        new = 0 if rng.random() < 0.1 else rng.randint(0, 2 * sr)
        generated_in_window += new
        ctx.total_generated_samples += new
        sync(version + 1)
        if answer_div and state_div:
            break
    return answer_div, state_div or answer_div


def compare(
    verl_ns: Any,
    name: str,
    make_tidal: Callable[[str, float, bool], Any],
    sequences: int = 1000,
    seed: int = 0,
    to_ctx: Callable[[Any, int], Any] | None = None,
) -> Outcome:
    out = Outcome(name)
    rng = random.Random(f"{name}:{seed}")
    for _ in range(sequences):
        ans, st = run_sequence(verl_ns, name, make_tidal, rng, to_ctx)
        out.sequences += 1
        if ans:
            out.answer_divergent += 1
        if st:
            out.state_divergent += 1
            out.first = out.first or st
            if len(out.details) < 5:
                out.details.append(st)
    return out


# ------------------------------------------------------------------ verl-switch (V1 trainer)
class _Attr(dict):
    """A config node: attribute access and ``.get`` (what verl's methods use)."""

    __getattr__ = dict.__getitem__


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def perf_counter(self) -> float:
        return self.t


def switch_env(clock: _Clock) -> dict[str, Any]:
    """The globals verl's switch methods read: its clock, ``marked_timer`` (verl's
    ``_timer``: adds the elapsed time to ``timing_raw[name]``) and a logger."""

    @contextlib.contextmanager
    def marked_timer(name: str, timing_raw: dict, *args: Any, **kw: Any):
        t0 = clock.t
        yield
        timing_raw[name] = timing_raw.get(name, 0) + clock.t - t0

    return {
        "time": clock,
        "marked_timer": marked_timer,
        "logger": logging.getLogger("verl.separate_async"),
    }


class _Buffer:
    """The replay buffer as the switch sees it: scripted sampleable counts and waits."""

    def __init__(
        self,
        rng: random.Random,
        clock: _Clock,
        train_batch: int,
        poll_s: float,
        log: list[tuple[str, Any]],
    ) -> None:
        self.rng, self.clock, self.train_batch, self.log = rng, clock, train_batch, log
        self.poll_interval = poll_s

    def get_sampleable_count(self, global_steps: int, partition: str) -> int:
        n = self.rng.randint(0, 2 * self.train_batch)
        self.log.append(("sampleable", n))
        return n

    def wait_for_sampleable(self, global_steps: int, partition: str, threshold: int):
        self.clock.t += _dur(self.rng, 0.2, 60.0)
        return None, {}

    def sample(self) -> None:
        w = _dur(self.rng, 0.3, 10.0)
        self.clock.t += w
        self.log.append(("wait", w))


def run_switch_sequence(
    switch_cls: type, mode_enum: Any, config_cls: type, clock: _Clock, rng: random.Random
) -> str | None:
    """One random run of verl's switch methods and tidal's ``SwitchHooks``; the first
    divergence (threshold, switch at step begin, decision metrics), or None."""
    from tidal.control.verl_switch import SwitchHooks, SwitchSettings

    sync_step, mini = rng.randint(1, 8), rng.choice([1, 2, 4, 8, 16, rng.randint(1, 64)])
    hyb, sa = rng.choice([8, 16, 32]), rng.choice([8, 16, 24, 32])
    steps = rng.randint(1, 30)
    cfg_kw = dict(
        switch_threshold_ratio=rng.choice([0.4, 1.0, rng.randint(1, 64) / 64]),
        adaptive_switch_threshold=rng.random() < 0.8,
        switch_threshold_step_up=rng.choice([0.05, rng.randint(0, 16) / 64]),
        switch_threshold_step_down=rng.choice([0.03, rng.randint(0, 16) / 64]),
        switch_threshold_release_steps=rng.randint(1, 4),
        switch_cost_window_size=rng.randint(1, 5),
    )
    poll_s = rng.choice([2.0, rng.randint(1, 320) / 64])
    clock.t = 0.0
    log: list[tuple[str, Any]] = []
    costs: list[float] = []

    def cost() -> float:
        c = _dur(rng, 0.05, 30.0)
        costs.append(c)
        return c

    class Trainer(switch_cls):
        def switch_to_trainer(self) -> None:
            clock.t += cost()
            self.current_mode = mode_enum.TRAINER

        def switch_to_rollout(self, *, already_registered: bool = False) -> None:
            clock.t += cost()
            self.current_mode = mode_enum.ROLLOUT

        def add_replicas_to_balancer(self) -> None:
            clock.t += cost()

        def clear_sticky_cache(self) -> dict:
            clock.t += cost()
            return {}

        def _stop_rollout_profiling(self) -> None:
            pass

    v = Trainer()
    v.hybrid_rollout_config = config_cls(enable_switch=True, **cfg_kw)
    v.parameter_sync_step = sync_step
    v.config = _Attr(
        data=_Attr(train_batch_size=sync_step * mini),
        trainer=_Attr(nnodes=1, n_gpus_per_node=hyb),
        actor_rollout_ref=_Attr(rollout=_Attr(nnodes=1, n_gpus_per_node=sa)),
    )
    v.replay_buffer = _Buffer(rng, clock, sync_step * mini, poll_s, log)
    v.standalone_checkpoint_manager = _Attr(update_weights=lambda steps: {})
    v.timing_raw, v.prev_step_profile, v.total_training_steps = {}, False, steps
    v.current_mode = mode_enum.ROLLOUT
    v._init_hybrid_rollout_state()
    t = SwitchHooks(
        SwitchSettings(**cfg_kw, poll_interval_s=poll_s), sync_step * mini, sync_step, hyb, sa
    )
    in_rollout = True
    setup = f"sync_step={sync_step} mini={mini} gpus={hyb}+{sa} poll={poll_s} {cfg_kw}"
    for step in range(1, steps + 1):
        v.global_steps = step
        v.timing_raw = {}
        del log[:], costs[:]
        v.on_step_begin()
        began = v.current_mode is mode_enum.TRAINER and in_rollout
        v._wait_for_sampleable_and_switch()
        for _ in range(sync_step):
            v.on_sample_begin()
            v.replay_buffer.sample()
            v.on_sample_end()
        v.on_step_end()
        # tidal, on the same numbers
        seen = iter(log)
        step_costs = iter(costs)
        s0 = next(seen)[1] if in_rollout else 0
        t_began = t.on_step_begin(in_rollout, s0)
        if in_rollout:
            t.to_trainer_done(next(step_costs))
        in_rollout = False
        for _ in range(sync_step):
            q, w = next(seen)[1], next(seen)[1]
            t.on_sample(q, w)
        switch, metrics = t.on_step_end(next(seen)[1], is_last_step=step >= steps)
        if switch:
            prep = next(step_costs) + next(step_costs)
            t.to_rollout_done(prep + next(step_costs))
            in_rollout = True
        want = {
            k: val for k, val in v._pending_sync_metrics.items() if k.startswith("separate_async/")
        }
        got = (t_began, t.step_threshold, metrics, in_rollout)
        ref = (began, v._step_threshold, want, v.current_mode is mode_enum.ROLLOUT)
        if got != ref:
            return f"{setup}: step {step}: verl {ref} tidal {got}"
    return None


def compare_switch(
    switch_cls: type,
    mode_enum: Any,
    config_cls: type,
    clock: _Clock,
    sequences: int = 1000,
    seed: int = 0,
) -> Outcome:
    out = Outcome("verl-switch")
    rng = random.Random(f"switch:{seed}")
    for _ in range(sequences):
        div = run_switch_sequence(switch_cls, mode_enum, config_cls, clock, rng)
        out.sequences += 1
        if div:
            out.answer_divergent += 1
            out.state_divergent += 1
            out.first = out.first or div
            if len(out.details) < 5:
                out.details.append(div)
    return out
