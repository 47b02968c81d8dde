"""The simulated trainer: optimizer steps over ready groups on the cells in training.

In: ready groups (from the real ledger), the training GPUs / cells (from the real cell roles),
virtual time. Out: ``TrainerReady``, ``GroupsAssigned`` and ``TrainerStepDone`` events for the
controller; a weight publication request to the world after the final update of a burst.

Two styles (``TrainerStyle``): BATCH (verl fully-async: wait until the queue holds a whole
batch and the trainer has GPUs, take it, train) and STREAMING (QwenGyre: claim ready groups as
they come, micro-step by micro-step, whoever is in training). Compute is a fluid: tokens of the
claimed groups processed at ``train_rate_tok_s(gpus, cells)``, re-rated whenever cells join or
leave; then gradient aggregation (per extra cell), one optimizer update per mini-batch
(``mini_batch_groups``) and the step's fixed costs (``fixed_step_s``). A trainer that offloads
its parameters (``Mechanics.param_offload``: verl's colocated trainer) also moves each GPU's
parameter shard over the host link on every pass of every micro-batch, and its gradients and
weights on every update. Weights are fixed during a step (one version per step).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from tidal.control.mechanics import TrainerStyle
from tidal.control.step_inputs import StepInputs
from tidal.sim.costs import train_rate_tok_s
from tidal.sim.scenario import TrainerConfig
from tidal.types import GroupsAssigned, TrainerReady, TrainerStepDone

if TYPE_CHECKING:
    from tidal.sim.world import World


class TState(enum.Enum):
    IDLE = 0
    COLLECT = 1
    COMPUTE = 2
    OPTIM = 3
    SYNC = 4
    DONE = 5


class Trainer:
    def __init__(
        self,
        world: World,
        style: TrainerStyle,
        cfg: TrainerConfig,
        batch_groups: int,
        updates_per_burst: int,
        total_steps: int,
        offload: tuple[float, float] | None = None,
    ) -> None:
        self.w = world
        self.offload = offload  # (weight GB, host GB/s) of a parameter-offloading trainer
        mini = cfg.mini_batch_groups
        self.updates_per_step = -(-batch_groups // mini) if mini else 1
        self.style = style
        self.cfg = cfg
        self.batch_groups = batch_groups
        self.updates_per_burst = updates_per_burst
        self.total_steps = total_steps
        self.state = TState.IDLE
        self.step = 0
        self.gpus = 0
        self.cells = 0
        self.rate = 0.0
        self.epoch = 0
        self._last_t = 0.0
        self.inputs = StepInputs()  # wait, queue and allocation as verl measures them
        self.assigned = 0
        self.work_total = 0.0
        self.work_done = 0.0
        self.compute_s = 0.0
        # Run totals.
        self.busy_gpu_s = 0.0
        self.steps_log: list[dict[str, float]] = []
        self.stale_sum = 0
        self.stale_n = 0

    # ------------------------------------------------------------------ flow
    def begin_step(self, now: float) -> None:
        self.state = TState.COLLECT
        self.inputs.ready(now, self.gpus > 0, self.w.ledger.ready_unassigned)
        self.assigned = 0
        self.work_total = self.work_done = self.compute_s = 0.0
        self._last_t = now
        self.w.emit(TrainerReady(now, self.step))
        self.pull(now)

    def pull(self, now: float) -> None:
        """Claims ready groups if the step can use them now."""
        if self.state not in (TState.COLLECT, TState.COMPUTE) or self.gpus <= 0:
            return
        need = self.batch_groups - self.assigned
        if need <= 0:
            return
        lg = self.w.ledger
        if self.style is TrainerStyle.BATCH:
            if self.state is not TState.COLLECT or lg.ready_unassigned < need:
                return
            take = lg.ready_group_ids()[:need]
        else:
            # Micro-steps are claimed on demand: one group once the claimed work is done, so a
            # cell leaving mid-step strands at most one group.
            self._advance(now)
            if lg.ready_unassigned == 0 or self.work_total - self.work_done > 1e-6:
                return
            take = lg.ready_group_ids()[:1]
        self._advance(now)
        self.w.emit(GroupsAssigned(now, tuple(take)))
        self.assigned += len(take)
        version = self.w.version
        for gid in take:
            tokens, stale_sum, n = self.w.consume_group(gid, version)
            self.work_total += tokens
            self.stale_sum += stale_sum
            self.stale_n += n
        if self.state is TState.COLLECT:
            self.state = TState.COMPUTE
            self.inputs.collected(now, lg.ready_unassigned + len(take))
        self._reschedule(now)

    def set_gpus(self, gpus: int, cells: int, now: float) -> None:
        if gpus == self.gpus and cells == self.cells:
            return
        self._advance(now)
        self.gpus, self.cells = gpus, cells
        self.rate = train_rate_tok_s(gpus, cells, self.cfg)
        if self.offload is not None and self.rate > 0:
            # Each GPU brings its parameter shard over the host link for every pass of every
            # micro-batch: weight_gb / gpus per ``micro_batch_tokens`` tokens of its share.
            weight_gb, host = self.offload
            micro = self.w.scenario.sim.micro_batch_tokens
            per_tok_s = self.cfg.weight_passes * weight_gb / (gpus * gpus * micro * host)
            self.rate = 1.0 / (1.0 / self.rate + per_tok_s)
        self.inputs.gpus(now, gpus > 0, self.w.ledger.ready_unassigned)
        self._reschedule(now)
        self.pull(now)

    # --------------------------------------------------------------- compute
    def _advance(self, now: float) -> None:
        dt = now - self._last_t
        self._last_t = now
        if dt <= 0 or self.state is not TState.COMPUTE or self.rate <= 0:
            return
        left = self.work_total - self.work_done
        if left <= 0:
            return
        dt_eff = min(dt, left / self.rate)
        self.work_done += self.rate * dt_eff
        self.compute_s += dt_eff
        self.busy_gpu_s += dt_eff * self.gpus

    def _reschedule(self, now: float) -> None:
        if self.state is not TState.COMPUTE:
            return
        self.epoch += 1
        left = self.work_total - self.work_done
        if left <= 1e-6 * max(1.0, self.work_total):
            self.work_done = self.work_total
            if self.assigned >= self.batch_groups:
                self._start_optimizer(now)
            elif self.style is TrainerStyle.STREAMING:
                self.pull(now)
            return
        if self.rate > 0:
            self.w.schedule_trainer(now + left / self.rate, self.epoch)

    def on_timer(self, epoch: int, now: float) -> None:
        if epoch != self.epoch:
            return
        if self.state is TState.COMPUTE:
            self._advance(now)
            self._reschedule(now)
        elif self.state is TState.OPTIM:
            self._finish_step(now)

    def _start_optimizer(self, now: float) -> None:
        # The core gathers and normalises the satellites' gradients, then one update.
        # Every update of the step (one per mini-batch); an offloading trainer moves each
        # GPU's gradient shard to the host (fp32) and its new weights back (bf16) per update.
        per_update = self.cfg.optimizer_s
        if self.offload is not None and self.gpus > 0:
            weight_gb, host = self.offload
            per_update += 3.0 * weight_gb / (self.gpus * host)
        dur = (
            self.updates_per_step * per_update
            + self.cfg.fixed_step_s
            + self.cfg.aggregate_s_per_cell * max(0, self.cells - 1)
        )
        self.state = TState.OPTIM
        self.epoch += 1
        self.busy_gpu_s += dur * self.gpus
        self.compute_s += dur
        self.w.schedule_trainer(now + dur, self.epoch)

    def _finish_step(self, now: float) -> None:
        final = (self.step + 1) % self.updates_per_burst == 0
        tm = self.inputs.done(now)
        self.steps_log.append(
            {
                "step": self.step,
                "t": now,
                "wait_s": tm.wait_s,
                "compute_s": self.compute_s,
                "alloc_s": tm.alloc_s,
                "gpus": self.gpus,
                "queue_at_start": tm.queue_at_start,
            }
        )
        self.w.emit(
            TrainerStepDone(
                now,
                self.step,
                wait_s=tm.wait_s,
                queue_at_start=tm.queue_at_start,
                compute_s=self.compute_s,
                alloc_s=tm.alloc_s,
                final_of_burst=final,
                wait_for_samples_s=tm.no_gpu_s,
            )
        )
        self.step += 1
        if self.step >= self.total_steps:
            self.state = TState.DONE
            self.w.finish(now)
        elif final:
            self.state = TState.SYNC
            self.w.start_sync(now)
        else:
            self.begin_step(now)

    @property
    def mean_staleness(self) -> float:
        return self.stale_sum / self.stale_n if self.stale_n else 0.0
