"""The core trainer's device handling on the CPU: an explicit ``device="cpu"`` trains exactly
like the default, checkpoints hold CPU tensors and restore the same state, and offload / onload
are no-ops off CUDA."""

from __future__ import annotations

import pytest
import torch
from satellite_harness import GROUP_SIZE, build_model, params

from tidal.clock import WallClock
from tidal.training.core import CoreTrainer, TrainerConfig
from tidal.training.flat import ParamLayout
from tidal.training.packing import PackingConfig
from tidal.training.records import single_call_record
from tidal.training.trajectory_buffer import TrajectoryBuffer, TrajectoryBufferConfig

torch.set_num_threads(1)


def _core(**cfg) -> CoreTrainer:
    buf = TrajectoryBuffer(
        TrajectoryBufferConfig(group_size=GROUP_SIZE, max_policy_lag=4), WallClock()
    )
    for g in range(4):
        for i in range(GROUP_SIZE):
            buf.add(
                single_call_record(
                    f"g{g}-{i}",
                    f"g{g}",
                    [1, 2, 3 + g],
                    [5 + i, 6, 7 + g, 8],
                    [-3.0] * 4,
                    0,
                    float(i % 2),
                )
            )
    config = TrainerConfig(
        groups_per_step=2, lr=1e-2, data_poll_s=0.01, packing=PackingConfig(token_budget=32), **cfg
    )
    return CoreTrainer(build_model(0), config, buf, WallClock())


def test_explicit_cpu_trains_bit_identically_and_offload_is_a_no_op():
    a, b = _core(), _core(device="cpu")
    try:
        assert b.device == torch.device("cpu")
        b.offload()
        assert not b.offloaded
        for final in (False, True):
            ra, rb = a.train_step(final), b.train_step(final)
            assert (ra.loss, ra.grad_norm) == (rb.loss, rb.grad_norm)
        assert torch.equal(params(a.model), params(b.model))
    finally:
        a.close()
        b.close()


def test_checkpoint_state_is_on_the_cpu_and_restores_the_same_core(tmp_path):
    core = _core(device="cpu")
    other = _core(device="cpu")
    try:
        core.train_step(final=False)
        state = core.state_dict()
        tensors = [*state["model"].values()]
        for s in state["optimizer"]["state"].values():
            tensors += [v for v in s.values() if isinstance(v, torch.Tensor)]
        assert tensors and {t.device.type for t in tensors} == {"cpu"}
        torch.save(state, tmp_path / "trainer.pt")
        other.load_state_dict(
            torch.load(tmp_path / "trainer.pt", weights_only=False, map_location="cpu")
        )
        assert other.version == core.version == 1
        assert torch.equal(params(other.model), params(core.model))
        assert len(other.trajectories.take(2, 1, timeout_s=0.0)) == 2  # what core trained
        ra, rb = core.train_step(final=True), other.train_step(final=True)
        assert ra.group_ids == rb.group_ids
        assert ra.grad_norm == pytest.approx(rb.grad_norm, rel=1e-6)
        assert torch.equal(params(other.model), params(core.model))
    finally:
        core.close()
        other.close()


def test_flat_gradients_are_copied_in_the_parameters_dtype():
    model = build_model(0).to(torch.bfloat16)
    layout = ParamLayout.of(model)
    flat = torch.linspace(-1, 1, layout.numel)
    layout.flat_to_grads_(model, flat)
    assert {p.grad.dtype for p in model.parameters()} == {torch.bfloat16}
    back = layout.grads_to_flat(model, torch.empty(layout.numel))
    torch.testing.assert_close(back, flat, atol=1e-2, rtol=1e-2)
