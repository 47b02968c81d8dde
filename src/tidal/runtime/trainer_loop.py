"""The trainer loop: every optimizer step of the run, in order, on the core trainer.

In: ready groups in the trajectory buffer, the actuator's view of which cells train (a step runs
only while cell 0 holds the training role, under the actuator's trainer lock). Out: per step a
``TrainerReady`` / ``GroupsAssigned`` / ``TrainerStepDone`` to the controller, a ``metrics.jsonl``
line, a checkpoint (every ``runtime.checkpoint_every_steps`` and at each burst end); after the
final step of a burst the publisher loads the new version and ``bursts_published`` advances
(the dispatcher waits on it). Invariant 7's second half: each group is trained exactly once
(``trained_groups``, restored from the checkpoint on a resume).

Every wait for data is bounded. A step waits for ``control.batch_groups`` ready groups (a
streaming trainer, where the policy's mechanics and the core say so: for one, and the core takes
the rest as they get ready); once
nothing more can arrive before its burst is published (``settled``: the burst fully dispatched,
every execution closed and its record delivered, so groups dropped by the ledger's rule or lost
will not come), it trains on its share of what is ready (``BatchShort`` tells the controller),
and with nothing ready it stops the run with a ``RuntimeFailure`` naming the burst. Without
progress (an execution closing, a record arriving, a group getting ready, cell 0's role
changing, a move of cells advancing) for ``runtime.step_data_timeout_s`` (plus
``runtime.execution_timeout_s`` while executions run, plus ``control.step_timeout_s`` while a
move is in flight) it stops with ``TimeoutExpired``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from tidal.clock import Clock
from tidal.config import RunConfig
from tidal.control.mechanics import TrainerStyle
from tidal.control.policy import policy_mechanics
from tidal.control.step_inputs import StepInputs
from tidal.errors import TimeoutExpired
from tidal.runtime import checkpoint
from tidal.runtime.actuator import RayActuator
from tidal.runtime.cell import RuntimeFailure
from tidal.runtime.outputs import RunOutputs, step_line
from tidal.runtime.publisher import Publisher
from tidal.types import BatchShort, Event, GroupsAssigned, TrainerReady, TrainerStepDone

if TYPE_CHECKING:
    from tidal.control.controller import Controller
    from tidal.runtime.cpuquota import CpuGroups
    from tidal.training.core import CoreTrainer
    from tidal.training.trajectory_buffer import TrajectoryBuffer


def core_pool(
    cfg: RunConfig, cpu_groups: CpuGroups | None
) -> concurrent.futures.ThreadPoolExecutor:
    """The one thread the core trainer computes on (seeded torch; with ``runtime.cell_cpus``
    it lives in cell 0's CPU group, and its OpenMP team is born there too)."""
    import torch

    rt, threads, join = cfg.runtime, cfg.runtime.torch_threads, None
    torch.manual_seed(cfg.seed)
    if rt.deterministic:  # where an op has a deterministic variant, use it (else it raises)
        torch.use_deterministic_algorithms(True)
    if cpu_groups is not None:  # more threads than cores would spin on the quota
        from tidal.runtime.cpuquota import join_thread

        threads = min(threads, max(1, int(rt.cell_cpus or 1)))
        join = functools.partial(join_thread, cpu_groups.path("c0"))
    torch.set_num_threads(threads)
    return concurrent.futures.ThreadPoolExecutor(
        1, thread_name_prefix="tidal-core", initializer=join
    )


class TrainerLoop:
    def __init__(
        self,
        cfg: RunConfig,
        core: CoreTrainer,
        buffer: TrajectoryBuffer,
        actuator: RayActuator,
        publisher: Publisher,
        outputs: RunOutputs,
        ctl: Controller,
        handle: Callable[[Event], None],
        clock: Clock,
        pool: concurrent.futures.ThreadPoolExecutor,
        ck: checkpoint.Checkpoint | None,
        close_reasons: Callable[[], dict[str, int]],
    ) -> None:
        self.cfg, self.core, self.buffer, self.actuator = cfg, core, buffer, actuator
        self.publisher, self.outputs, self.ctl, self.clock = publisher, outputs, ctl, clock
        self.handle = handle  # the run's guarded controller.handle (a failure stops the run)
        self.pool, self.ck = pool, ck
        self.close_reasons = close_reasons  # over incarnations, up to now (the checkpoint's cut)
        self.trained_groups: list[str] = list(ck.state.trained_groups) if ck else []
        self.first_step = ck.state.step if ck else 0
        self.bursts_published = self.first_step // cfg.control.updates_per_burst
        self._published = asyncio.Condition()
        self._rows_logged = 0  # verl metric rows (one per closed version) already in a line
        # burst -> True once no more data can arrive before it is published (wired to the
        # dispatcher: ``Dispatcher.settled``); None: always wait for a full batch
        self.settled: Callable[[int], bool] | None = None
        # a streaming trainer (the policy's mechanics, as the simulator runs it:
        # ``TrainerStyle.STREAMING``) starts a step once a group is ready and takes the rest
        # as they get ready, where the core can (``streams_steps``: the emulated core; the
        # real core's step data bound is shorter than a rollout, so it waits for a full batch)
        self.streaming = bool(getattr(core, "streams_steps", False)) and (
            policy_mechanics(cfg.policy.name).trainer is TrainerStyle.STREAMING
        )

    async def wait_published(self, burst: int, trainer: asyncio.Task) -> None:
        """Until ``burst`` bursts are published (the dispatcher starts the next one then)."""
        async with self._published:
            while self.bursts_published < burst:
                if trainer.done():
                    trainer.result()  # raises the trainer's error
                    raise RuntimeFailure("the trainer ended before the run did")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._published.wait(), 1.0)

    async def run(self) -> None:
        c = self.cfg.control
        step = self.first_step
        first_b, first_u = divmod(step, c.updates_per_burst)
        for b in range(first_b, c.bursts or 0):
            for u in range(first_u if b == first_b else 0, c.updates_per_burst):
                await self._step(
                    b, step, final=u == c.updates_per_burst - 1, left=c.updates_per_burst - u
                )
                step += 1
            async with self._published:
                self.bursts_published = b + 1
                self._published.notify_all()

    async def _step(self, burst: int, step: int, final: bool, left: int = 1) -> None:
        """Step ``step`` of ``burst``, with ``left`` steps of the burst to go (this one too)."""
        wait_s, inputs = 0.0, StepInputs()  # verl's: from the GPUs' return
        inputs.ready(self.clock.now(), 0 in self.actuator.training, len(self.buffer))
        self.handle(TrainerReady(self.clock.now(), step))  # wants the next batch
        need = self.cfg.control.batch_groups
        while True:
            waited, need = await self._core_active(inputs, burst, step, left, need)
            wait_s += waited
            await self.actuator.revive_satellites()
            async with self.actuator.trainer_lock:
                if 0 not in self.actuator.training:
                    continue  # offloaded between the check and the lock
                t0 = self.clock.now()
                inputs.collected(t0, len(self.buffer))
                report = await asyncio.get_running_loop().run_in_executor(
                    self.pool, self.core.train_step, final, need
                )
                break
        dt = self.clock.now() - t0
        if report is None:
            raise RuntimeFailure(f"step {step}: the trainer got no data")
        self.handle(GroupsAssigned(self.clock.now(), tuple(report.group_ids)))
        tm = inputs.done(self.clock.now())
        self.handle(
            TrainerStepDone(
                self.clock.now(),
                step,
                wait_s=tm.wait_s,
                queue_at_start=tm.queue_at_start,
                compute_s=report.compute_s + report.update_s,
                alloc_s=tm.alloc_s,
                final_of_burst=final,
                wait_for_samples_s=tm.no_gpu_s,
            )
        )
        if final:
            await self.publisher.publish(self.core.version)
        self.trained_groups += report.group_ids
        line = step_line(
            self.ctl, burst, step, self.core.version, report, dt, wait_s, self.outputs.elapsed()
        )
        rows = self.ctl.metrics.rows
        if len(rows) > self._rows_logged:  # a weight version closed: verl's metric names
            line.update({k: round(v, 4) for k, v in rows[-1].items() if "/" in k})
            self._rows_logged = len(rows)
        self.outputs.step(line)
        await self._checkpoint(step, final)

    async def _core_active(
        self, inputs: StepInputs, burst: int, step: int, left: int, need: int
    ) -> tuple[float, int]:
        """Wait until cell 0's trainer worker is active and ``need`` groups are ready (so a
        step never holds the trainer lock while waiting for data, which would keep the core
        from returning to rollout); returns the wait and the groups the step trains (fewer
        than ``need`` once no more can come: its share of the ready ones over the ``left``
        steps of the burst). Bounded: see the module's docstring."""
        t0 = self.clock.now()
        rt, ledger = self.cfg.runtime, self.ctl.ledger
        seen, since = None, t0
        while True:
            # takeable: ready groups (deterministic: the ready ones next in dispatch order)
            have, training = self.buffer.takeable(), 0 in self.actuator.training
            if have < need and self.settled is not None and self.settled(burst):
                if have == 0:
                    raise RuntimeFailure(
                        f"step {step}: no group can come for it: every group of burst {burst} "
                        f"was trained or dropped ({ledger.groups_dropped} dropped: fewer than "
                        f"2 scored members; {self.buffer.stats.groups_dropped_stale} stale)"
                    )
                need = -(-have // left)  # this step's share of what is left
                self.handle(BatchShort(self.clock.now(), step, need))
            if training and (have >= need or (self.streaming and have > 0)):
                return self.clock.now() - t0, need
            fl = self.ctl.inflight  # a move of cells: its steps are bounded on their own
            mark = (
                ledger.total.dispatched,
                ledger.total.finished,
                self.buffer.stats.records_in,
                have,
                training,
                len(self.ctl.plans_done),
                self.ctl.plans_aborted,
                fl and (fl.plan.plan_id, fl.step),
            )
            now = self.clock.now()
            if mark != seen:
                seen, since = mark, now
            bound = (
                rt.step_data_timeout_s
                + (rt.execution_timeout_s if ledger.waterlevel else 0)
                + (self.cfg.control.step_timeout_s if fl else 0)
            )
            if now - since > bound:
                raise TimeoutExpired(
                    f"step {step}: {have} of {need} groups ready and no progress for "
                    f"{bound:g} s (runtime.step_data_timeout_s"
                    f"{' + execution_timeout_s: executions running' if ledger.waterlevel else ''}"
                    f"{' + control.step_timeout_s: a move in flight' if fl else ''})"
                )
            inputs.gpus(now, training, len(self.buffer))
            self.actuator.training_changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.actuator.training_changed.wait(), 0.05)

    async def _checkpoint(self, step: int, final: bool) -> None:
        every = self.cfg.runtime.checkpoint_every_steps
        if not every or ((step + 1) % every and not final):
            return
        w = self.publisher.weights
        st = checkpoint.RunState(
            step=step + 1,
            bursts_published=self.bursts_published + int(final),
            published_version=w.version,
            published_path=w.path,
            trained_groups=list(self.trained_groups),
            metrics_lines=len(self.outputs.metrics),
            execution_lines=self.outputs.executions.lines,
            elapsed_s=round(self.outputs.elapsed(), 3),
            resumes=(self.ck.state.resumes + 1) if self.ck else 0,
            close_reasons=self.close_reasons(),
        )
        records, trainer = self.buffer.held_records(), self.core.state_dict()
        out = self.outputs.out
        await asyncio.to_thread(
            checkpoint.save, out, st, records, trainer, max(1, self.cfg.runtime.keep_checkpoints)
        )
        await asyncio.to_thread(checkpoint.record_processes, out)
