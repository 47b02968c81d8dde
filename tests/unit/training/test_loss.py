"""GRPO loss on logits, per-execution averaging, aggregation and flat parameter layouts."""

from __future__ import annotations

import math

import pytest
import torch

from tidal.clock import ManualClock
from tidal.models.hf import tiny_model
from tidal.training.aggregate import Contribution, aggregate, clip_
from tidal.training.flat import ParamLayout
from tidal.training.loss import GRPOLossConfig, MicroStepTensors, grpo_loss_sum
from tidal.training.packing import PackingBuffer, PackingConfig
from tidal.training.records import single_call_record
from tidal.training.trajectory_buffer import TrajectoryBuffer, TrajectoryBufferConfig
from tidal.training.worker import GradientWorker

SHAPE = {"n_layers": 1, "n_heads": 2, "d_model": 32, "d_ff": 64, "max_seq_len": 64}

torch.set_num_threads(1)


def tensors(logp, behav, adv, weight) -> MicroStepTensors:
    row = lambda v: torch.tensor([v], dtype=torch.float32)  # noqa: E731
    n = len(logp)
    return MicroStepTensors(
        torch.zeros(1, n + 1, dtype=torch.long),
        torch.ones(1, n, dtype=torch.bool),
        row(behav),
        row(adv),
        row(weight),
        torch.zeros(1, n, dtype=torch.long),
    )


def test_ratio_clipping_and_weights():
    cfg = GRPOLossConfig(clip_eps_low=0.2, clip_eps_high=0.2)
    logp = torch.tensor([[math.log(0.5), math.log(0.9), math.log(0.1)]], requires_grad=True)
    behav = [math.log(0.5), math.log(0.5), math.log(0.5)]  # ratios 1.0, 1.8, 0.2
    t = tensors(logp[0].tolist(), behav, [1.0, 1.0, -1.0], [0.5, 0.5, 0.25])
    loss, stats = grpo_loss_sum(logp, t, cfg)
    # token 0: -1*1; token 1: ratio clipped at 1.2 -> -1.2; token 2: A<0, min(-0.2, -0.8) -> 0.8
    assert float(loss.detach()) == pytest.approx(0.5 * -1.0 + 0.5 * -1.2 + 0.25 * 0.8, rel=1e-6)
    assert stats.clipped_tokens == 2
    loss.backward()
    g = logp.grad[0]
    assert g[0] == pytest.approx(-0.5) and g[1] == 0 and g[2] == 0  # clipped tokens: no grad


def test_kl_to_reference_is_zero_at_the_reference_and_positive_elsewhere():
    cfg = GRPOLossConfig(kl_coef=0.1)
    logp = torch.tensor([[-1.0, -2.0]])
    t = tensors([-1.0, -2.0], [-1.0, -2.0], [0.0, 0.0], [1.0, 1.0])
    assert float(grpo_loss_sum(logp, t, cfg, ref_logprobs=logp.clone())[0]) == 0.0
    loss, stats = grpo_loss_sum(logp, t, cfg, ref_logprobs=torch.tensor([[-1.5, -1.0]]))
    assert float(loss) > 0 and stats.kl_sum > 0
    with pytest.raises(ValueError):
        grpo_loss_sum(logp, t, cfg)


def _batch(model, n_groups=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    buf = TrajectoryBuffer(TrajectoryBufferConfig(group_size=2), ManualClock())
    for k in range(n_groups):
        for i in range(2):
            n = 4 + 3 * i + k
            out = torch.randint(1, 60, (n,), generator=g).tolist()
            lp = (-2.0 - torch.rand(n, generator=g)).tolist()
            buf.add(single_call_record(f"g{k}e{i}", f"g{k}", [1, 2, 3], out, lp, 0, float(i)))
    return buf.take(n_groups, version=0)


def _grad_sum(model, groups, budget):
    pb = PackingBuffer(PackingConfig(token_budget=budget), ManualClock())
    pb.open_batch(0, 0)
    pb.add_groups(groups)
    pb.seal()
    w = GradientWorker(0, model, GRPOLossConfig())
    while (c := pb.claim("w")).kind == "micro_step":
        w.compute(c.micro_step)
        assert pb.complete("w", 0, c.micro_step.index)
        w.commit()
    return w.grad_sum, pb.finish().n_micro_steps


def test_gradient_sum_does_not_depend_on_how_the_batch_is_packed():
    model = tiny_model("llama", 0, 64, **SHAPE)
    groups = _batch(model)
    whole, n1 = _grad_sum(model, groups, budget=1000)
    split, n2 = _grad_sum(model, groups, budget=12)
    assert n1 == 1 and n2 >= 5
    assert torch.allclose(whole, split, rtol=1e-5, atol=1e-7)
    assert float(whole.abs().max()) > 0


def test_backward_adds_into_the_sum_and_a_discard_takes_its_micro_step_out():
    """fp32 parameters' ``.grad`` are views of ``grad_sum`` (no second gradient buffer); a
    micro-step computed and then discarded leaves the sum as if it never ran (to float32
    rounding), and the next ones still add into it."""
    model = tiny_model("llama", 0, 64, **SHAPE)
    groups = _batch(model, n_groups=3)
    want, n = _grad_sum(model, groups, budget=12)
    pb = PackingBuffer(PackingConfig(token_budget=12), ManualClock())
    pb.open_batch(0, 0)
    pb.add_groups(groups)
    pb.seal()
    w = GradientWorker(0, model, GRPOLossConfig())
    assert w.bound
    base = w.grad_sum.untyped_storage().data_ptr()
    assert all(p.grad.untyped_storage().data_ptr() == base for p in model.parameters())
    k = 0
    while (c := pb.claim("x" if k == 1 else "w")).kind == "micro_step":
        w.compute(c.micro_step)
        if k == 1:  # computed, then refused: out of the sum, and claimed again below
            w.discard()
            assert pb.reopen("x") == 1
        else:
            assert pb.complete("w", 0, c.micro_step.index)
            w.commit()
        k += 1
    assert w.n_micro_steps == n and k == n + 1
    assert torch.allclose(w.grad_sum, want, rtol=1e-5, atol=1e-6)
    assert float(w.grad_sum.abs().max()) > 0


def test_aggregation_divides_by_the_global_execution_count():
    def contribs():
        g1, g2 = torch.tensor([3.0, 0.0]), torch.tensor([1.0, 4.0])
        return [Contribution(1, g2, 1, 10, 1, 0.0), Contribution(0, g1, 3, 30, 3, 0.0)]

    given = contribs()
    total = aggregate(given, 4)
    assert torch.allclose(total, torch.tensor([1.0, 1.0]))
    assert total is given[1].grad  # written into the lowest cell's sum (consumed), no new one
    naive = aggregate(contribs(), 4, "local_mean")  # (g1/3 + g2/1) / 2
    assert torch.allclose(naive, torch.tensor([1.0, 2.0]))
    grad = torch.tensor([3.0, 4.0])
    assert clip_(grad, 1.0) == pytest.approx(5.0)
    assert float(torch.linalg.vector_norm(grad)) == pytest.approx(1.0, rel=1e-5)


def test_flat_layout_round_trips_and_detects_other_models():
    a, b = tiny_model("qwen2", 0, 64, **SHAPE), tiny_model("qwen2", 1, 64, **SHAPE)
    la = ParamLayout.of(a)
    flat = la.params_to_flat(a)
    assert flat.numel() == sum(p.numel() for p in a.parameters())
    ptr = b.model.embed_tokens.weight.data_ptr()
    la.flat_to_params_(b, flat)
    assert b.model.embed_tokens.weight.data_ptr() == ptr, "weights are loaded in place"
    assert torch.equal(ParamLayout.of(b).params_to_flat(b), flat)
    other = tiny_model("qwen2", 0, 64, **{**SHAPE, "n_layers": 2})
    assert ParamLayout.of(other).fingerprint() != la.fingerprint()
