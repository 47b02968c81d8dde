"""One copy of the weights (issue 25): ``ParamLayout.bind`` makes the parameters views of one
flat vector, so a pull into the vector is a load and the vector is the step's snapshot; a
model moved to another device is rebound to the moved vector (as the core's offload does)."""

from __future__ import annotations

import torch

from tidal.models.hf import tiny_model
from tidal.training.flat import ParamLayout


def _model():
    return tiny_model("llama", 0, 64, n_layers=1, n_heads=2, d_model=16, d_ff=32, max_seq_len=32)


def test_bound_parameters_are_views_of_one_vector_and_keep_their_values():
    model = _model()
    layout = ParamLayout.of(model)
    before = layout.params_to_flat(model)
    flat = layout.bind(model)
    assert torch.equal(flat, before) and layout.is_bound(model, flat)
    flat.copy_(torch.arange(layout.numel, dtype=torch.float32))  # a pull lands in the weights
    assert torch.equal(layout.params_to_flat(model), flat)
    ids = torch.randint(0, 64, (1, 5))
    model(input_ids=ids).logits.sum().backward()  # autograd works on views
    assert all(p.grad is not None for p in layout.params(model))


def test_a_moved_vector_is_rebound_and_a_copy_is_not_bound():
    model = _model()
    layout = ParamLayout.of(model)
    flat = layout.bind(model)
    moved = flat.clone()  # what ``.to(device)`` returns: another vector, the same values
    layout.bind(model, moved)
    assert layout.is_bound(model, moved) and not layout.is_bound(model, flat)
    moved.zero_()
    assert float(layout.params_to_flat(model).abs().sum()) == 0.0


def test_gradients_handed_over_as_views_when_device_and_dtype_match():
    model = _model()
    layout = ParamLayout.of(model)
    grad = torch.randn(layout.numel)
    layout.flat_to_grads_(model, grad)
    p0 = layout.params(model)[0]
    assert p0.grad.data_ptr() == grad.data_ptr()  # no copy
