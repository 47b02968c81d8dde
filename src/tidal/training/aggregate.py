"""Gradient aggregation at the core: per-worker gradient sums in, one normalised gradient out.

In: one ``Contribution`` per participant (the core and every satellite that delivered), each the
sum over its micro-steps of ``grad(sum_e (1/T_e) sum_t loss_t)``, with its counts. Out: the
gradient of the batch loss ``(1/E) sum_e (1/T_e) sum_t loss_t`` where ``E`` is the batch's
global execution count, clipped to a maximum norm.

Invariant 5: because each worker's sum is un-normalised and the division by the *global* count
happens here once, the result is the same however micro-steps were split. ``local_mean`` is the
naive data-parallel rule (each worker averages over what it saw, the core averages workers);
it is wrong whenever workers consume unequal shares and exists so the invariance test can show
that it catches exactly this mistake. Contributions are summed in cell order so that the
reduction order is fixed for a given split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from tidal.errors import InvariantViolation

Normalization = Literal["global", "local_mean"]


@dataclass
class Contribution:
    cell: int
    grad: torch.Tensor
    n_micro_steps: int
    n_tokens: int
    n_executions: int  # distinct executions this worker saw (for ``local_mean`` only)
    loss_sum: float
    device_peak_mb: float | None = None  # its trainer's GPU peak so far (None on the CPU)


def aggregate(
    contributions: list[Contribution], n_executions: int, normalization: Normalization = "global"
) -> torch.Tensor:
    """The batch gradient; under ``global`` it is written into the first active (lowest cell)
    contribution's ``grad``, which the caller must not use again."""
    if n_executions <= 0:
        raise InvariantViolation("a batch without executions cannot be normalised")
    ordered = sorted(contributions, key=lambda c: c.cell)
    active = [c for c in ordered if c.n_micro_steps > 0]
    if not active:
        raise InvariantViolation("no participant processed a micro-step")
    if normalization == "global":
        # summed into the first participant's tensor (consumed: the caller's contributions end
        # with the step), not into a fresh one: one vector of the model's size less at the
        # core's peak; the order and so every float are those of summing onto zeros
        total = active[0].grad
        for c in active[1:]:
            total += c.grad
        total /= n_executions
    elif normalization == "local_mean":
        total = torch.zeros_like(active[0].grad)
        for c in active:
            total += c.grad / c.n_executions
        total /= len(active)
    else:
        raise ValueError(f"unknown normalization {normalization!r}")
    return total


def clip_(grad: torch.Tensor, max_norm: float | None) -> float:
    """Clip in place to ``max_norm`` (None: no clipping); returns the norm before clipping."""
    norm = float(torch.linalg.vector_norm(grad))
    if max_norm is not None and norm > max_norm:
        grad.mul_(max_norm / (norm + 1e-6))
    return norm
