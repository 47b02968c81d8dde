"""GRPO loss on logits: micro-step tensors in, an un-normalised loss sum and statistics out.

In: a ``MicroStep`` (packed sequences with behaviour log-probs, advantages and the per-execution
weight ``1 / T_e``) turned into padded tensors by ``micro_step_tensors``, and the logits of a
full-sequence forward pass. Out: ``sum_e (1/T_e) sum_t loss_t`` over the micro-step's trainable
tokens - the per-execution mean, not yet divided by the number of executions. The division by
the batch's global execution count happens once, at the core (``aggregate.py``), which is what
makes the update independent of how micro-steps were split among workers (invariant 5).

Per token: ratio = exp(logp - behaviour_logp); loss = -min(ratio * A, clip(ratio) * A), plus an
optional ``kl_coef`` * k3 estimate of KL(policy || reference) given reference log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal.contracts.trainer import GRPOLossConfig
from tidal.training.packing import MicroStep


@dataclass
class MicroStepTensors:
    """Padded [B, L] inputs; target-side tensors are [B, L-1] (position t predicts t+1)."""

    input_ids: torch.Tensor
    mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    token_weights: torch.Tensor
    staleness: torch.Tensor


def micro_step_tensors(step: MicroStep, pad_id: int = 0) -> MicroStepTensors:
    seqs = step.sequences
    length = max(len(s) for s in seqs)
    b = len(seqs)
    ids = torch.full((b, length), pad_id, dtype=torch.long)
    mask = torch.zeros((b, length), dtype=torch.bool)
    behav = torch.zeros((b, length), dtype=torch.float32)
    adv = torch.zeros((b, length), dtype=torch.float32)
    weight = torch.zeros((b, length), dtype=torch.float32)
    stale = torch.zeros((b, length), dtype=torch.long)
    for i, s in enumerate(seqs):
        n = len(s)
        ids[i, :n] = torch.tensor(s.token_ids, dtype=torch.long)
        mask[i, :n] = torch.tensor(s.trainable, dtype=torch.bool)
        behav[i, :n] = torch.tensor(s.behaviour_logprobs, dtype=torch.float32)
        adv[i, :n] = s.advantage
        weight[i, :n] = s.execution_weight
        stale[i, :n] = torch.tensor(s.staleness, dtype=torch.long)
    # Token 0 of a sequence has no predecessor inside it, so it can never be a target.
    mask[:, 0] = False
    return MicroStepTensors(ids, mask[:, 1:], behav[:, 1:], adv[:, 1:], weight[:, 1:], stale[:, 1:])


def target_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Log-prob of each next token: logits [B, L, V], ids [B, L] -> [B, L-1]. The picked logit
    minus the log-normaliser (float32): no [B, L, V] log-softmax is kept for backward."""
    x = logits[:, :-1].float()
    picked = x.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(x, dim=-1)


@dataclass
class LossStats:
    loss_sum: float
    n_tokens: int
    clipped_tokens: int
    mean_ratio: float
    kl_sum: float


def grpo_loss_sum(
    logprobs: torch.Tensor,
    t: MicroStepTensors,
    config: GRPOLossConfig,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Returns (loss sum to backpropagate, statistics); see the module docstring."""
    mask = t.mask
    log_ratio = torch.where(mask, logprobs - t.behaviour_logprobs, torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high)
    per_token = -torch.minimum(ratio * t.advantages, clipped * t.advantages)
    kl_sum = 0.0
    if config.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs reference log-probs")
        d = torch.where(mask, ref_logprobs - logprobs, torch.zeros_like(logprobs))
        kl = torch.exp(d) - d - 1.0
        per_token = per_token + config.kl_coef * kl
        kl_sum = float((kl * mask).sum())
    weights = t.token_weights * mask
    loss = (per_token * weights).sum()
    n = int(mask.sum())
    with torch.no_grad():
        is_clipped = (ratio != clipped) & mask
        mean_ratio = float((ratio * mask).sum() / max(n, 1))
    return loss, LossStats(float(loss.detach()), n, int(is_clipped.sum()), mean_ratio, kl_sum)
