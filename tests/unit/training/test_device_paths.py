"""The training path's tensors follow the model's device: micro-step tensors, the flat gradient
buffer, the gradients and AdamW's state. ``meta`` stands in for a GPU (it refuses to mix with CPU
tensors as CUDA does). The transformers forward itself reads mask values, which a meta tensor
has none of: it runs on the CPU here and on a real GPU in ``tests/gpu``."""

from __future__ import annotations

from pathlib import Path

import torch

from tidal.models.hf import tiny_model
from tidal.training.flat import ParamLayout
from tidal.training.loss import micro_step_tensors, target_logprobs
from tidal.training.packing import MicroStep, PackedSequence
from tidal.training.worker import forward_logits


def test_forward_backward_flat_gradients_and_adamw_stay_on_the_device():
    model = tiny_model("llama", 0, 64, n_layers=1, n_heads=2, d_model=16, d_ff=32, max_seq_len=32)
    seqs = [
        PackedSequence(
            f"e{i}",
            [1, 2, 3, 4, 5],
            [False, False, True, True, True],
            [-1.0] * 5,
            [0] * 5,
            1.0,
            1 / 3,
        )
        for i in range(2)
    ]
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


def test_a_version_is_published_in_float32_or_bfloat16_as_asked(tmp_path):
    """float32: the trainer's values as they are; bfloat16 (engines that serve in it): each
    value cast to bfloat16 exactly as the engine would, in half the bytes; readable by
    safetensors itself (what vLLM's workers and ``read_weights`` open) with the version label."""
    import pytest
    from safetensors import safe_open

    from tidal.training.transport import FilePublisher, TransportError

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(33, 17), torch.nn.Linear(17, 5))
    layout = ParamLayout.of(net)
    flat = layout.params_to_flat(net)
    for dtype in (torch.float32, torch.bfloat16):
        pub = FilePublisher(tmp_path / str(dtype), layout, dtype=dtype)
        pub.publish(3, flat)
        with safe_open(pub.path(3), framework="pt") as f:
            assert f.metadata() == {"weight_version": "v3"}
            for name, view in layout.views(flat).items():
                got = f.get_tensor(name)
                assert got.dtype == dtype and torch.equal(got, view.to(dtype)), name
        raw = Path(pub.path(3)).read_bytes()  # 8 bytes of header length, the header, data
        data = len(raw) - 8 - int.from_bytes(raw[:8], "little")
        assert data == layout.numel * dtype.itemsize  # 4 bytes a value, or 2
    with pytest.raises(TransportError, match=r"float32 or bfloat16, not torch\.float16"):
        FilePublisher(tmp_path / "f16", layout, dtype=torch.float16)
