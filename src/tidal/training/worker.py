"""Micro-step execution shared by the core and the satellites: forward, backward, commit.

In: a ``MicroStep`` and a model whose weights are fixed for the step. Out: the gradient of the
micro-step's un-normalised GRPO loss, held aside until the packing buffer confirms the claim
(``commit``) and then added to the worker's running sum; a refused claim's gradient is dropped
(``discard``), so a reclaimed micro-step is counted only by the worker that completed it
(invariant 5). The worker never changes weights: ``load_flat`` is called only between steps.
A computed micro-step's gradient waits in the parameters' ``.grad`` (no second buffer) until
``commit`` adds it to the sum or ``discard`` drops it. The sum lives on the model's device
(chosen at ``reset``, so a model moved between steps is followed); ``contribution`` hands out
that device tensor, ``cpu_grad_sum`` the copy a gloo transport sends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tidal.models.device import device_peak_mb
from tidal.training.aggregate import Contribution
from tidal.training.flat import ParamLayout
from tidal.training.loss import (
    GRPOLossConfig,
    MicroStepTensors,
    grpo_loss_sum,
    micro_step_tensors,
    target_logprobs,
)
from tidal.training.packing import MicroStep


def forward_logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Full-sequence logits [B, L, V] of a ``transformers`` causal LM. Rows are right-padded,
    so a causal mask over every position is exact for the real tokens; the explicit all-ones
    mask keeps transformers from probing ``position_ids`` for packed sequences."""
    out = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False)
    return out.logits


# Rows of logits computed at once: 256 x a 49K vocabulary is 50 MB of float32 (the whole
# micro-step's [B, L, V] would be several times that, twice over with log_softmax's copy).
CHUNK_TOKENS = 256


def _chunk_logprobs(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()  # float32 where it matters: the normaliser
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def model_logprobs(
    model: nn.Module, input_ids: torch.Tensor, chunk_tokens: int = CHUNK_TOKENS
) -> torch.Tensor:
    """Log-prob of each next token, [B, L] ids -> [B, L-1], without the full [B, L, V] logits:
    the transformer body runs once, the output head and the log-normaliser ``chunk_tokens``
    rows at a time, each chunk checkpointed (its logits recomputed in backward, never kept).
    Equal to ``target_logprobs(forward_logits(...))`` to float32 rounding; a model without a
    separable output head (no ``base_model`` body) takes that full path."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    body = getattr(model, "base_model", None)
    softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    if head is None or body is None or body is model or softcap:
        return target_logprobs(forward_logits(model, input_ids), input_ids)
    out = body(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False)
    hidden = out.last_hidden_state[:, :-1]
    b, n, h = hidden.shape
    flat_h, flat_t = hidden.reshape(b * n, h), input_ids[:, 1:].reshape(b * n)
    parts = []
    for i in range(0, b * n, chunk_tokens):
        hs, ts = flat_h[i : i + chunk_tokens], flat_t[i : i + chunk_tokens]
        if torch.is_grad_enabled():
            parts.append(checkpoint(_chunk_logprobs, head, hs, ts, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(head, hs, ts))
    return torch.cat(parts).view(b, n)


@dataclass
class StepResult:
    loss_sum: float
    n_tokens: int
    clipped_tokens: int
    mean_ratio: float
    max_staleness: int


class _Tally:
    """What a worker reports of the micro-steps it committed (either kind of worker)."""

    def contribution(self) -> Contribution:
        return Contribution(
            self.cell,
            self.grad_sum,
            self.n_micro_steps,
            self.n_tokens,
            len(self.executions),
            self.loss_sum,
            self.device_peak_mb(),
        )

    def counts(self) -> dict[str, int | float | None]:
        return {
            "n_micro_steps": self.n_micro_steps,
            "n_tokens": self.n_tokens,
            "n_executions": len(self.executions),
            "loss_sum": self.loss_sum,
            "device_peak_mb": self.device_peak_mb(),
        }

    def device_peak_mb(self) -> float | None:
        """This trainer's GPU peak (rank 0's on a sharded cell); None on the CPU."""
        return device_peak_mb(next(self.model.parameters()).device)


class GradientWorker(_Tally):
    """Accumulates committed micro-step gradients for one participant and one batch.

    Where the parameters are float32 on the sum's device (every CPU trainer, fp32 GPU ones),
    each parameter's ``.grad`` is a view of ``grad_sum``: backward adds a micro-step's gradient
    straight into the sum, so no second model-sized gradient buffer exists (one vector less
    at the peak of every trainer process). A micro-step whose claim was refused after it was
    computed (``discard``, rare: its claim was reclaimed meanwhile) is taken out again by
    computing its gradient once more and subtracting it: the sum then differs from one that
    never held it by float32 rounding only, the tolerance invariant 5 allows. Other
    parameters (bf16, another device) keep the gradient in ``.grad`` until ``commit``."""

    def __init__(
        self,
        cell: int,
        model: nn.Module,
        loss_config: GRPOLossConfig,
        reference: nn.Module | None = None,
        pad_id: int = 0,
    ) -> None:
        self.cell = cell
        self.model = model
        self.reference = reference
        self.loss_config = loss_config
        self.pad_id = pad_id
        self.layout = ParamLayout.of(model)
        self._pending_stats: tuple[MicroStep, StepResult] | None = None
        self.reset()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def reset(self) -> None:
        self.model.zero_grad(set_to_none=True)
        self.grad_sum = torch.zeros(self.layout.numel, dtype=torch.float32, device=self.device)
        self.bound = self._bind_grads()
        self.n_micro_steps = self.n_tokens = 0
        self.loss_sum = 0.0
        self.compute_s = 0.0  # wall time in ``compute`` since the last reset (calibration)
        self.executions: set[str] = set()

    def compute(self, step: MicroStep) -> StepResult:
        t0 = time.perf_counter()
        try:
            return self._compute(step)
        finally:
            self.compute_s += time.perf_counter() - t0

    def _bind_grads(self) -> bool:
        """Each parameter's ``.grad`` a view of ``grad_sum`` (True), where dtype and device
        allow; else (False) gradients stay in ``.grad`` until ``commit`` adds them."""
        params = self.layout.params(self.model)
        if any(p.dtype != torch.float32 or p.device != self.grad_sum.device for p in params):
            return False
        for p, view in zip(params, self.layout.views(self.grad_sum).values(), strict=True):
            p.grad = view
        return True

    def _compute(self, step: MicroStep) -> StepResult:
        if not self.bound:
            self.model.zero_grad(set_to_none=True)
        result = self._backward(step)
        self._pending_stats = (step, result)
        return result

    def _backward(self, step: MicroStep) -> StepResult:
        """The micro-step's loss and its gradient added into ``.grad``."""
        t = micro_step_tensors(step, self.pad_id)
        device = self.device
        if device.type != "cpu":
            t = MicroStepTensors(*(x.to(device) for x in vars(t).values()))
        logprobs = model_logprobs(self.model, t.input_ids)
        ref = None
        if self.loss_config.kl_coef > 0 and self.reference is not None:
            with torch.no_grad():
                ref = model_logprobs(self.reference, t.input_ids)
        loss, stats = grpo_loss_sum(logprobs, t, self.loss_config, ref)
        loss.backward()  # into the sum (bound) or ``.grad`` until commit/discard
        stale = int((t.staleness * t.mask).max()) if bool(t.mask.any()) else 0
        return StepResult(
            stats.loss_sum, stats.n_tokens, stats.clipped_tokens, stats.mean_ratio, stale
        )

    def commit(self) -> None:
        assert self._pending_stats is not None, "commit without compute"
        step, result = self._pending_stats
        if not self.bound:
            for p, view in zip(
                self.layout.params(self.model),
                self.layout.views(self.grad_sum).values(),
                strict=True,
            ):
                if p.grad is not None:
                    view += p.grad
            self.model.zero_grad(set_to_none=True)
        self.n_micro_steps += 1
        self.n_tokens += result.n_tokens
        self.loss_sum += result.loss_sum
        self.executions |= step.execution_ids()
        self._pending_stats = None

    def discard(self) -> None:
        assert self._pending_stats is not None, "discard without compute"
        if self.bound:  # already in the sum: its gradient once more, taken out
            step = self._pending_stats[0]
            self.model.zero_grad(set_to_none=True)
            self._backward(step)
            for p, view in zip(
                self.layout.params(self.model),
                self.layout.views(self.grad_sum).values(),
                strict=True,
            ):
                if p.grad is not None:
                    view -= p.grad
            self._bind_grads()
        else:
            self.model.zero_grad(set_to_none=True)
        self._pending_stats = None

    def release(self) -> None:
        """Drop the gradient buffers (between steps: the trainer's device memory is offloaded);
        the next ``reset`` allocates them again where the model is then."""
        self.model.zero_grad(set_to_none=True)
        self.grad_sum = torch.zeros(0, dtype=torch.float32)
        self.bound = False

    def cpu_grad_sum(self) -> torch.Tensor:
        """The committed gradient sum on the CPU (what a gloo broadcast sends)."""
        return self.grad_sum.cpu()


class ShardedWorker(_Tally):
    """``GradientWorker``'s surface for a cell of k FSDP2 ranks (rank 0 calls it): micro-steps
    are computed by all ranks, the gradient sum stays sharded, ``cpu_grad_sum`` gathers it."""

    reference = None

    def __init__(self, cell: int, sharded) -> None:
        self.cell, self.sharded = cell, sharded
        self.model, self.layout = sharded.model, sharded.full_layout
        self._pending: tuple[MicroStep, StepResult] | None = None
        self.reset()

    @property
    def grad_sum(self) -> torch.Tensor:
        return self.sharded.grad_sum

    def reset(self) -> None:
        self.sharded.reset()
        self.n_micro_steps = self.n_tokens = 0
        self.loss_sum = 0.0
        self.compute_s = 0.0
        self.executions: set[str] = set()

    def compute(self, step: MicroStep) -> StepResult:
        t0 = time.perf_counter()
        stats = self.sharded.compute(micro_step_tensors(step, self.sharded.pad_id))
        loss_sum, n, clipped, ratio_sum, stale = (float(x) for x in stats)
        result = StepResult(loss_sum, int(n), int(clipped), ratio_sum / max(n, 1), int(stale))
        self._pending = (step, result)
        self.compute_s += time.perf_counter() - t0
        return result

    def commit(self) -> None:
        assert self._pending is not None, "commit without compute"
        step, result = self._pending
        self.sharded.commit()
        self.n_micro_steps += 1
        self.n_tokens += result.n_tokens
        self.loss_sum += result.loss_sum
        self.executions |= step.execution_ids()
        self._pending = None

    def discard(self) -> None:
        self.sharded.discard()
        self._pending = None

    def release(self) -> None:
        """Nothing to drop: the shards' buffers are reused by the next ``reset``."""

    def cpu_grad_sum(self) -> torch.Tensor:
        return self.sharded.gather_grad_sum()
