from __future__ import annotations

import pytest
import torch

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from tidal.models import create_tiny

    return create_tiny(
        tmp_path_factory.mktemp("tiny") / "model", seed=1, n_layers=2, d_model=64, max_seq_len=256
    )


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    from tidal.models import create_tiny

    return create_tiny(
        tmp_path_factory.mktemp("tiny-qwen2") / "model",
        seed=2,
        arch="qwen2",
        n_layers=2,
        d_model=64,
        max_seq_len=256,
    )


@pytest.fixture(scope="session")
def smollm2_dir(smollm2):
    return smollm2
