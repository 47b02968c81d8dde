"""A trainer step's inputs to verl's policies and metrics, measured as verl's trainer does.

In: the times a trainer step is asked for, gets (or loses) its GPUs, has its batch, ends, and
the ready queue at those times. Out: ``StepTiming`` (the fields of ``TrainerStepDone``).

verl's ``FullyAsyncTrainer.fit_step`` first waits for the hybrid replicas to deactivate (the
trainer's GPUs come back), and only then starts collecting: the queue size behind
``step_wait_samples`` is snapshotted there, the wait time (``step_wait_times``, ``timing_s/gen``)
runs from there until the batch is complete, and the allocated time (``_allocated_start``)
starts there too. The time without GPUs before it is the hybrids' rollout wait plus the
deactivation. Losing the GPUs again before the batch is complete starts the measurement over.
Pure: the caller passes the times (the simulator's virtual clock, the runtime's wall clock).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepTiming:
    wait_s: float  # from the GPUs' return to a complete batch
    queue_at_start: int  # ready groups when the GPUs came back
    alloc_s: float  # from the GPUs' return to the step's end
    no_gpu_s: float  # from the request to the GPUs' return


class StepInputs:
    def __init__(self) -> None:
        self.ready_s: float | None = None
        self.gpus_s: float | None = None
        self.collected_s: float | None = None
        self.queue = 0

    def ready(self, t_s: float, has_gpus: bool, queue: int) -> None:
        """The trainer asks for its next batch."""
        self.ready_s, self.gpus_s, self.collected_s = t_s, None, None
        self.gpus(t_s, has_gpus, queue)

    def gpus(self, t_s: float, has_gpus: bool, queue: int) -> None:
        """The trainer's GPUs changed (call on every change; cheap)."""
        if self.ready_s is None or self.collected_s is not None:
            return
        if not has_gpus:
            self.gpus_s = None
        elif self.gpus_s is None:
            self.gpus_s, self.queue = t_s, queue

    def collected(self, t_s: float, queue: int) -> None:
        """The batch is complete (a streaming trainer: its first group)."""
        if self.collected_s is None:
            if self.gpus_s is None:
                self.gpus_s, self.queue = t_s, queue
            self.collected_s = t_s

    def done(self, t_s: float) -> StepTiming:
        ready = self.ready_s if self.ready_s is not None else t_s
        gpus = self.gpus_s if self.gpus_s is not None else ready
        collected = self.collected_s if self.collected_s is not None else gpus
        return StepTiming(
            wait_s=collected - gpus,
            queue_at_start=self.queue,
            alloc_s=t_s - gpus,
            no_gpu_s=gpus - ready,
        )
