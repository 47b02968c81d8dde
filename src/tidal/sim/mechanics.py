"""The system mechanics a policy family runs with: dispatch, trainer, weight sync, KV
handoff, partial rollout, staleness, admission, and the trainer's own mechanics per mode
(the old-log-prob pass, parameter offload of a colocated trainer).

In: a policy name (``family_of``) or a scenario's ``profiles`` entry. Out: a ``Profile``
(pydantic, ``extra="forbid"``), reported in every summary (``Profile.label``). The families:
verl's fully-async trainer (``verl``, also ``static``), QwenGyre (``waterlevel``), ``tidal``
and synchronous ``colocate`` (verl's hybrid-engine trainer).
"""

from __future__ import annotations

import enum

from pydantic import Field, model_validator

from tidal.config import Strict
from tidal.errors import ConfigError


class DispatchStyle(enum.StrEnum):
    ON_DEMAND = "on_demand"  # verl rollouter: a group whenever a slot is free, within budget
    BURST = "burst"  # QwenGyre: the burst's whole quota is dispatched when it starts


class TrainerStyle(enum.StrEnum):
    BATCH = "batch"  # verl: collect a full batch from the queue, then train
    STREAMING = "streaming"  # QwenGyre: claim micro-steps as groups become ready


class SyncStyle(enum.StrEnum):
    ABORT = "abort"  # verl: a sync aborts in-flight requests (partial rollout re-prefills)
    KEEP = "keep"  # pause in place, KV kept


class Profile(Strict):
    """The system mechanics a policy family runs with (reported in every summary)."""

    dispatch: DispatchStyle = DispatchStyle.ON_DEMAND
    trainer: TrainerStyle = TrainerStyle.BATCH
    sync: SyncStyle = SyncStyle.ABORT
    kv_handoff: bool = False
    partial_rollout: bool = Field(
        True, description="an aborted request keeps its tokens (else its turn starts over)"
    )
    staleness_threshold: float | None = Field(None, ge=0.0)
    admission: str | float = Field(
        "off",
        description="engine admission control of this "
        "family (control.admission; a scenario's own setting "
        "other than 'off' applies to every policy)",
    )
    old_log_prob: bool | None = Field(
        None,
        description="the trainer runs a forward pass for "
        "the old log-probs (False: the rollout's log-probs are "
        "used; None: the cost model's setting)",
    )
    param_offload: bool = Field(
        False,
        description="the trainer keeps parameters and optimizer "
        "state on the host (a colocated trainer sharing GPU memory "
        "with an engine): every micro-batch pass brings its shard "
        "over the host link, every update its gradients and weights",
    )

    @model_validator(mode="after")
    def _admission(self) -> Profile:
        from tidal.control.admission import AdmissionRule

        try:
            AdmissionRule.parse(self.admission, field="admission")
        except ConfigError as exc:
            raise ValueError(exc.message) from None
        return self

    def label(self) -> str:
        """The mechanics in a few words, for table rows: dispatch (on demand / burst), trainer
        (batch / streaming), weight sync (abort / keep), KV handoff or re-prefill, and
        ``restart`` when an aborted turn starts over (no partial rollout)."""
        parts = [
            "demand" if self.dispatch is DispatchStyle.ON_DEMAND else "burst",
            "stream" if self.trainer is TrainerStyle.STREAMING else "batch",
            self.sync.value,
            "kv" if self.kv_handoff else "prefill",
        ]
        parts += [] if self.partial_rollout else ["restart"]
        return "/".join(parts + ([] if self.admission == "off" else ["admit"]))


FAMILY_PROFILES: dict[str, Profile] = {
    "verl": Profile(),
    "waterlevel": Profile(
        dispatch=DispatchStyle.BURST,
        trainer=TrainerStyle.STREAMING,
        sync=SyncStyle.KEEP,
        kv_handoff=True,
    ),
    "tidal": Profile(trainer=TrainerStyle.STREAMING, sync=SyncStyle.KEEP, kv_handoff=True),
    # verl's colocated (hybrid-engine) trainer: parameters and optimizer offloaded while the
    # engine holds the GPUs, old log-probs recomputed by the trainer.
    "colocate": Profile(
        dispatch=DispatchStyle.BURST,
        sync=SyncStyle.KEEP,
        staleness_threshold=0.0,
        old_log_prob=True,
        param_offload=True,
    ),
}


def family_of(policy: str) -> str:
    if policy.startswith("verl") or policy == "static":
        return "verl"
    return policy if policy in FAMILY_PROFILES else "verl"
