"""The training path's tensors follow the model's device: micro-step tensors, the flat gradient
buffer, the gradients and AdamW's state. ``meta`` stands in for a GPU (it refuses to mix with CPU
tensors as CUDA does). The transformers forward itself reads mask values, which a meta tensor
has none of: it runs on the CPU here and on a real GPU in ``tests/gpu``."""

from __future__ import annotations

import torch

from tidal.models.hf import tiny_model
from tidal.training.flat import ParamLayout
from tidal.training.loss import micro_step_tensors, target_logprobs
from tidal.training.packing import MicroStep, PackedSequence
from tidal.training.worker import forward_logits


def test_forward_backward_flat_gradients_and_adamw_stay_on_the_device():
    model = tiny_model("llama", 0, 64, n_layers=1, n_heads=2, d_model=16, d_ff=32,
                       max_seq_len=32)
    seqs = [PackedSequence(f"e{i}", [1, 2, 3, 4, 5], [False, False, True, True, True],
                           [-1.0] * 5, [0] * 5, 1.0, 1 / 3) for i in range(2)]
    t = micro_step_tensors(MicroStep(0, 0, 0, seqs))
    assert {x.to("meta").device.type for x in vars(t).values()} == {"meta"}  # as the worker does
    logp = target_logprobs(forward_logits(model, t.input_ids), t.input_ids)
    ratio = torch.exp(torch.where(t.mask, logp - t.behaviour_logprobs, torch.zeros_like(logp)))
    (-(ratio * t.advantages) * t.token_weights * t.mask).sum().backward()
    model.to("meta")  # gradients move along with their parameters
    layout = ParamLayout.of(model)
    flat = torch.zeros(layout.numel, device="meta")
    layout.grads_to_flat(model, flat)
    model.zero_grad(set_to_none=True)
    layout.flat_to_grads_(model, flat)
    assert {p.grad.device.type for p in model.parameters()} == {"meta"}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()
    state = next(iter(opt.state.values()))
    assert state["exp_avg"].is_meta and state["step"].device.type == "cpu"


def test_a_version_with_non_finite_weights_is_never_published(tmp_path):
    """The file every backend loads from (built-in, vLLM, SGLang): a NaN in any parameter is an
    error naming it, and no file of that version appears; the last good one stays."""
    import pytest

    from tidal.training.transport import FilePublisher, TransportError

    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    layout = ParamLayout.of(net)
    pub = FilePublisher(tmp_path, layout)
    flat = torch.zeros(layout.numel)
    pub.publish(1, flat)
    flat[-1] = float("nan")
    with pytest.raises(TransportError, match=r"v2: parameter 1\.bias holds NaN"):
        pub.publish(2, flat)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1.safetensors"]
