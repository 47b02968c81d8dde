"""The emulated core trainer: optimizer steps that take the simulator's trainer time, no model.

In: ready groups from the real ``TrajectoryBuffer`` (the records the proxy recorded: their
token counts), the cells training now (``bind``: the actuator's view; each cell's GPUs from the
scenario's cluster) and the scenario's trainer costs, a time scale ``k`` and a clock. Out:
``train_step`` -> a ``training.core.StepReport`` after the time the simulator's trainer spends
on the same groups (``sim.trainer``: each sequence's training work ``train_work_tokens`` at
``train_rate_tok_s(gpus, cells)``, re-rated while cells join or leave, then one optimizer
update per mini-batch, the per-extra-cell aggregation and the fixed step cost), divided by
``k``; after a burst's final step a version published as a marker directory
(``EmulatedVersions``): a version of the scenario's size in time (the engines' load takes the
scenario's load time), not bytes. Satellites are emulated by the cells' roles: a cell in
training adds its GPUs to the rate at once (its host records the join, ``runtime.emulated_host``).
A test double at scale, named as such in every file it writes.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from tidal.clock import Clock
from tidal.sim.costs import train_rate_tok_s
from tidal.sim.scenario import Scenario, train_work_tokens
from tidal.training.core import StepReport
from tidal.training.trajectory_buffer import ReadyGroup, TrajectoryBuffer, mean_of

POLL_S = 0.02  # real seconds between re-ratings of a step in progress


class EmulatedVersions:
    """Where emulated versions are published: ``weights/v<N>-emulated/`` holding a marker
    file (what the version would weigh, and that it is emulated); the newest ``keep`` stay."""

    def __init__(self, root: Path, weight_gb: float, keep: int = 2) -> None:
        self.root, self.weight_gb, self.keep = root, weight_gb, keep
        self.write_s = 0.0

    def path(self, version: int) -> str:
        return str(self.root / f"v{version}-emulated")

    def publish(self, version: int) -> None:
        d = Path(self.path(version))
        d.mkdir(parents=True, exist_ok=True)
        (d / "EMULATED.json").write_text(
            json.dumps({"emulated": True, "version": version, "weight_gb": self.weight_gb})
        )
        old = sorted(self.root.glob("v*-emulated"), key=lambda p: int(p.name[1:].split("-")[0]))
        for stale in old[: -self.keep]:
            for f in stale.iterdir():
                f.unlink()
            stale.rmdir()


class _NoCoordinator:
    """The core's coordinator as the runtime asks it, for a core without satellites."""

    def registered(self) -> list[int]:
        return []

    def expect_departure(self, cell: int) -> None:
        return None

    # membership: a leaving cell stops counting at once (``EmulatedCore.rate`` reads the
    # actuator's training set), as a satellite leaves a step without waiting for it
    def activate(self, cell: int) -> None:
        return None

    def deactivate(self, cell: int) -> None:
        return None

    def wait_parked(self, cell: int, timeout_s: float) -> bool:
        return True


class EmulatedDevice:
    type = "cpu"


class EmulatedCore:
    """Duck-types ``training.core.CoreTrainer`` for the trainer loop and the wiring."""

    def __init__(
        self,
        sc: Scenario,
        k: float,
        buffer: TrajectoryBuffer,
        clock: Clock,
        versions: EmulatedVersions,
        groups_per_step: int,
        cell_gpus: list[int],
    ) -> None:
        self.sc, self.k, self.trajectories, self.clock = sc, k, buffer, clock
        self.versions, self.groups_per_step = versions, groups_per_step
        self.cell_gpus = cell_gpus
        self.version, self._step = 0, 0
        mini = sc.trainer.mini_batch_groups
        self.updates_per_step = -(-groups_per_step // mini) if mini else 1
        self.coordinator = _NoCoordinator()
        self.device = EmulatedDevice()
        self._training: Callable[[], Iterable[int]] = lambda: [0]
        self._stop = threading.Event()
        self.busy_gpu_s = 0.0  # emulated GPU-seconds of training
        # a streaming step (the policy's mechanics: ``TrainerLoop`` starts it with the groups
        # ready so far): groups taken as they get ready until the step has its share, as the
        # simulator's streaming trainer claims them; a step with no new group for
        # ``stream_wait_s`` (real seconds) trains on what it has
        self.stream_wait_s = 120.0

    def bind(self, training: Callable[[], Iterable[int]]) -> None:
        """Where the cells in training are read (the actuator's ``training``)."""
        self._training = training

    def rate(self) -> tuple[float, int, int]:
        """(training tokens/s, GPUs, cells) of the cells training now."""
        while True:
            try:
                now = list(self._training())  # the actuator's set, changed on the loop
                break
            except RuntimeError:  # changed while copied: read it again
                continue
        cells = [c for c in now if 0 <= c < len(self.cell_gpus)]
        gpus = sum(self.cell_gpus[c] for c in cells)
        return train_rate_tok_s(gpus, len(cells), self.sc.trainer), gpus, len(cells)

    def work_of(self, group: ReadyGroup) -> float:
        tr = self.sc.trainer
        return float(sum(train_work_tokens(len(s), tr) for seqs in group.sequences for s in seqs))

    #: ``TrainerLoop`` may start a step before its batch is ready (a streaming trainer):
    #: ``train_step`` takes the rest as it gets ready
    streams_steps = True

    def train_step(self, final: bool = True, groups: int | None = None) -> StepReport | None:
        want = groups or self.groups_per_step
        taken = self.trajectories.take(want, self.version, timeout_s=5.0)
        step, version = self._step, self.version
        self._step += 1
        if not taken:
            return None
        work = sum(self.work_of(g) for g in taken)
        t0 = self.clock.now()
        done, cells_seen, idle_s = 0.0, 1, 0.0
        rate, gpus, cells = self.rate()
        last = fed = t0
        while not self._stop.is_set():  # a fluid, re-rated as cells change
            if done >= work * (1 - 1e-9):  # what it holds is done: more to stream, or the end
                done = work
                if len(taken) >= want:
                    break
                more = self.trajectories.take(want - len(taken), version, timeout_s=0.0)
                if more:
                    taken += more
                    work += sum(self.work_of(g) for g in more)
                    fed = self.clock.now()
                elif self.clock.now() - fed > self.stream_wait_s:
                    break  # no group came for long: the step trains on what it has
                else:
                    self.clock.sleep(POLL_S)  # waiting for data: no compute
                    idle_s += self.clock.now() - last
                    last = self.clock.now()
                    continue
            cells_seen = max(cells_seen, cells)
            left_s = (work - done) / rate / self.k if rate > 0 else POLL_S
            self.clock.sleep(min(POLL_S, left_s))
            now = self.clock.now()
            dt = (now - last) * self.k  # emulated seconds since the last look (its rate held)
            last = now
            done += rate * dt
            self.busy_gpu_s += gpus * dt
            rate, gpus, cells = self.rate()
        t_update = self.clock.now()
        tr = self.sc.trainer
        _, gpus, cells = self.rate()
        update = (
            self.updates_per_step * tr.optimizer_s
            + tr.fixed_step_s
            + tr.aggregate_s_per_cell * max(0, cells - 1)
        )
        self.clock.sleep(update / self.k)
        self.busy_gpu_s += gpus * update
        self.version += 1
        if final:
            self.publish()
        n_tokens = sum(len(s) for g in taken for seqs in g.sequences for s in seqs)
        return StepReport(
            step,
            version,
            final,
            len(taken),
            sum(len(g.records) for g in taken),
            n_tokens,
            {0: len(taken)},
            0,
            0,
            0.0,
            0.0,
            mean_of([g.mean_reward() for g in taken]),
            max((version - g.min_version() for g in taken), default=0),
            list(range(cells_seen)),
            [g.group_id for g in taken],
            t_update - t0 - idle_s,  # compute: a streaming step's waits for data excluded
            self.clock.now() - t_update,
            t_update - t0 - idle_s,
            n_tokens,
        )

    def publish(self) -> None:
        self.versions.publish(self.version)

    def address(self) -> None:
        return None

    def offload(self) -> None:
        return None

    def onload(self) -> None:
        return None

    def stream_params(self):
        return iter(())

    def state_dict(self) -> dict[str, object]:
        return {"emulated": True, "version": self.version, "step": self._step}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.version, self._step = int(state["version"]), int(state["step"])  # type: ignore[call-overload]

    def close(self) -> None:
        self._stop.set()


def emulated_core(cfg, out: Path, clock: Clock):
    """The trajectory buffer, the emulated core and its version publisher of an emulated run
    (``runtime.emulate``): what ``runtime.wiring`` builds instead of a model's."""
    from tidal.control.carry_over import max_policy_lag
    from tidal.serving.emulated_timing import resolved_scenario
    from tidal.training.trajectory_buffer import TrajectoryBufferConfig

    emu, c = cfg.runtime.emulate, cfg.control
    sc = resolved_scenario(emu.scenario)
    lag = max_policy_lag(c.updates_per_burst, c.staleness)  # carried groups train (carry_over)
    buffer = TrajectoryBuffer(
        TrajectoryBufferConfig(group_size=c.group_size, max_policy_lag=lag), clock
    )
    versions = EmulatedVersions(out / "weights", sc.costs.weight_gb)
    core = EmulatedCore(
        sc,
        emu.k,
        buffer,
        clock,
        versions,
        c.batch_groups,
        [s.gpus for s in cfg.cluster.cell_specs()],
    )
    return buffer, core, versions
