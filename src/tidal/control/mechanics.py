"""The system mechanics a policy declares: what the simulator gives it around its decisions
(dispatch, trainer, weight sync, KV handoff, partial rollout, staleness, admission, and the
trainer's own passes: the old-log-prob forward, parameter offload of a colocated trainer).

In: nothing (a policy class sets ``mechanics = QWENGYRE`` or its own ``Mechanics(...)``; a
scenario's ``profiles`` entry overrides it per run). Out: a frozen ``Mechanics`` (pydantic,
``extra="forbid"``) that ``sim`` reads instead of guessing from the policy's name, and that
``summary.json`` reports as ``policy_mechanics``. ``MECHANICS_SETS`` names the four systems'
sets for ``tidal simulate --mechanics`` (every policy run under one system's mechanics): verl's
fully-async trainer (``verl``), QwenGyre (``waterlevel``), ``tidal`` and verl's synchronous
hybrid-engine trainer (``colocate``).
"""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field, model_validator

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


class Mechanics(BaseModel):
    """The system mechanics a policy runs with (declared by the policy, reported in every
    summary). The defaults are verl's fully-async trainer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

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
    def _admission(self) -> Mechanics:
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


#: verl's fully-async trainer: on-demand dispatch, batch trainer, syncs abort (partial rollout).
VERL = Mechanics()
#: QwenGyre: the burst's quota at once, streaming trainer, syncs keep KV, KV handed off on moves.
QWENGYRE = Mechanics(
    dispatch=DispatchStyle.BURST,
    trainer=TrainerStyle.STREAMING,
    sync=SyncStyle.KEEP,
    kv_handoff=True,
)
#: tidal: on-demand dispatch with QwenGyre's streaming trainer, kept syncs and KV handoff; its
#: GRPO loss takes the behaviour log-probs the engines reported with each token
#: (``tidal.training.loss``), so its trainer runs no old-log-prob pass.
TIDAL = Mechanics(
    trainer=TrainerStyle.STREAMING, sync=SyncStyle.KEEP, kv_handoff=True, old_log_prob=False
)
#: verl's colocated (hybrid-engine) trainer: parameters and optimizer offloaded while the
#: engine holds the GPUs, old log-probs recomputed by the trainer.
COLOCATE = Mechanics(
    dispatch=DispatchStyle.BURST,
    sync=SyncStyle.KEEP,
    staleness_threshold=0.0,
    old_log_prob=True,
    param_offload=True,
)

#: The four systems' mechanics by system name (``tidal simulate --mechanics NAME``).
MECHANICS_SETS: dict[str, Mechanics] = {
    "verl": VERL,
    "waterlevel": QWENGYRE,
    "tidal": TIDAL,
    "colocate": COLOCATE,
}


def mechanics_set(name: str, field: str = "mechanics") -> Mechanics:
    """The named system's mechanics, or a one-line ``ConfigError`` naming ``field``."""
    if name not in MECHANICS_SETS:
        raise ConfigError(field, f"unknown {name!r} (known: {', '.join(MECHANICS_SETS)})")
    return MECHANICS_SETS[name]
